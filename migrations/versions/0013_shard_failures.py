"""shards.failures, shards.retry_at: failed runs of a shard counted, retried with backoff

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 09:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('shards') as batch:
        batch.add_column(sa.Column('failures', sa.Integer(), nullable=False, server_default='0'))
        batch.add_column(sa.Column('retry_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('shards') as batch:
        batch.drop_column('retry_at')
        batch.drop_column('failures')
