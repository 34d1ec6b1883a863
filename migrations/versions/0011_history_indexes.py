"""Indexes for a database with history (benchmarks/history.py: 10,000 jobs, 100k shards)

- jobs.created_at: `batchllm jobs` lists the newest jobs (it sorted every job).
- shards.status: the reconciler looks for running and queued shards among every shard ever.
- batches (owner, created_at): GET /v1/batches pages a key's newest batches.
- jobs.status where notify_url is set: the reconciler's webhook pass reads only notified jobs.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 11:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_jobs_created_at', 'jobs', ['created_at'])
    op.create_index('ix_shards_status', 'shards', ['status'])
    op.create_index('ix_batches_owner_created_at', 'batches', ['owner', 'created_at'])
    op.create_index(
        'ix_jobs_notified_status',
        'jobs',
        ['status'],
        postgresql_where=sa.text('notify_url IS NOT NULL'),
        sqlite_where=sa.text('notify_url IS NOT NULL'),
    )


def downgrade() -> None:
    op.drop_index('ix_jobs_notified_status', table_name='jobs')
    op.drop_index('ix_batches_owner_created_at', table_name='batches')
    op.drop_index('ix_shards_status', table_name='shards')
    op.drop_index('ix_jobs_created_at', table_name='jobs')
