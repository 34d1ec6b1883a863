"""jobs.cached_tokens: prompt tokens vLLM served from its prefix cache (Batch.usage)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-08 07:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(
            sa.Column('cached_tokens', sa.BigInteger(), nullable=False, server_default='0')
        )


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('cached_tokens')
