"""jobs.cancelling_at, jobs.finalizing_at: when a job entered `cancelling` (a cancel asked for)
and `finalizing`, which a Batch object reports as OpenAI fills them (it had them always null).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07 15:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('cancelling_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('finalizing_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('finalizing_at')
        batch.drop_column('cancelling_at')
