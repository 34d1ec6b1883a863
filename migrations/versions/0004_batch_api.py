"""The Batch API server: api_keys, files, batches; jobs.expires_at

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 07:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        'api_keys',
        sa.Column('id', sa.String(length=32), primary_key=True),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('key_hash', sa.String(length=64), nullable=False, unique=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        'files',
        sa.Column('id', sa.String(length=40), primary_key=True),
        sa.Column('owner', sa.String(length=32), nullable=False, index=True),
        sa.Column('filename', sa.String(length=512), nullable=False),
        sa.Column('purpose', sa.String(length=32), nullable=False),
        sa.Column('bytes', sa.Integer(), nullable=False),
        sa.Column('lines', sa.Integer(), nullable=False),
        sa.Column('path', sa.Text(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        'batches',
        sa.Column('job_id', sa.String(length=32),
                  sa.ForeignKey('jobs.id', ondelete='CASCADE'), primary_key=True),
        sa.Column('owner', sa.String(length=32), nullable=False, index=True),
        sa.Column('endpoint', sa.String(length=64), nullable=False),
        sa.Column('completion_window', sa.String(length=16), nullable=False),
        sa.Column('input_file_id', sa.String(length=40), nullable=False),
        sa.Column('output_file_id', sa.String(length=40), nullable=True),
        sa.Column('error_file_id', sa.String(length=40), nullable=True),
        sa.Column('errors', sa.JSON(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('batches')
    op.drop_table('files')
    op.drop_table('api_keys')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('expires_at')
