"""jobs.structured_rows, jobs.structured_valid (rows with a structured output constraint, and
those whose text satisfied it)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 07:20:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('structured_rows', sa.Integer(), nullable=False,
                                   server_default='0'))
        batch.add_column(sa.Column('structured_valid', sa.Integer(), nullable=False,
                                   server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('structured_valid')
        batch.drop_column('structured_rows')
