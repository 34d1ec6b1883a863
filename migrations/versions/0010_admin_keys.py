"""api_keys.admin: an admin key sees every job in the dashboard (`keys create --admin`)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 10:40:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys') as batch:
        batch.add_column(
            sa.Column('admin', sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table('api_keys') as batch:
        batch.drop_column('admin')
