"""job_parents: the jobs a job reads its rows from (`--from`)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 13:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'job_parents',
        sa.Column(
            'child_id',
            sa.String(length=32),
            sa.ForeignKey('jobs.id', ondelete='CASCADE'),
            primary_key=True,
        ),
        sa.Column('parent_id', sa.String(length=32), primary_key=True),
        sa.Column('kind', sa.String(length=16), nullable=False, server_default='from'),
    )
    op.create_index('ix_job_parents_parent_id', 'job_parents', ['parent_id'])


def downgrade() -> None:
    op.drop_index('ix_job_parents_parent_id', table_name='job_parents')
    op.drop_table('job_parents')
