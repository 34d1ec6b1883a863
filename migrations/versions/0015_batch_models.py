"""batches.model and the indexes a key's long history needs on the dashboard

- batches.model: its job's model (jobs have no owner), filled in from the jobs for the batches
  there are.
- batches (owner, model, created_at): the dashboard lists a key's models one index step each (it
  read every one of the key's jobs on each refresh: 75 ms on PostgreSQL at 100,000 batches), and
  pages a key's newest batches of one model.
- jobs (model, created_at): likewise for an admin, who sees every job, and a model's newest jobs
  for the page filtered by model (jobs.model alone, SQLite sorted every job of the model).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07 06:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('batches') as batch:
        batch.add_column(sa.Column('model', sa.String(length=512), nullable=True))
    op.execute(
        'UPDATE batches SET model = (SELECT jobs.model FROM jobs WHERE jobs.id = batches.job_id)'
    )
    with op.batch_alter_table('batches') as batch:
        batch.alter_column('model', existing_type=sa.String(length=512), nullable=False)
    op.create_index(
        'ix_batches_owner_model_created_at', 'batches', ['owner', 'model', 'created_at']
    )
    op.create_index('ix_jobs_model_created_at', 'jobs', ['model', 'created_at'])


def downgrade() -> None:
    op.drop_index('ix_jobs_model_created_at', table_name='jobs')
    op.drop_index('ix_batches_owner_model_created_at', table_name='batches')
    with op.batch_alter_table('batches') as batch:
        batch.drop_column('model')
