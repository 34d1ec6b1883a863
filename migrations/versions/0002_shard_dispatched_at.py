"""shards.dispatched_at (when the shard's task was last sent), jobs.local_run

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 03:10:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('shards') as batch:
        batch.add_column(sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('local_run', sa.Boolean(), nullable=False,
                                   server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('local_run')
    with op.batch_alter_table('shards') as batch:
        batch.drop_column('dispatched_at')
