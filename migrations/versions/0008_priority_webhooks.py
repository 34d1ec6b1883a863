"""Webhooks: jobs.notify_url/notify_secret, api_keys.webhook_url/webhook_secret, webhook_attempts

Revision ID: 0008
Revises: 0005
Create Date: 2026-12-07 07:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('notify_url', sa.Text(), nullable=True))
        batch.add_column(sa.Column('notify_secret', sa.String(length=128), nullable=True))
    with op.batch_alter_table('api_keys') as batch:
        batch.add_column(sa.Column('webhook_url', sa.Text(), nullable=True))
        batch.add_column(sa.Column('webhook_secret', sa.String(length=128), nullable=True))
    op.create_table(
        'webhook_attempts',
        sa.Column('id', sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column('job_id', sa.String(length=32),
                  sa.ForeignKey('jobs.id', ondelete='CASCADE'), nullable=False, index=True),
        sa.Column('url', sa.Text(), nullable=False),
        sa.Column('event', sa.String(length=32), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('status_code', sa.Integer(), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('delivered', sa.Boolean(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint('job_id', 'attempt'),
    )


def downgrade() -> None:
    op.drop_table('webhook_attempts')
    with op.batch_alter_table('api_keys') as batch:
        batch.drop_column('webhook_secret')
        batch.drop_column('webhook_url')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('notify_secret')
        batch.drop_column('notify_url')
