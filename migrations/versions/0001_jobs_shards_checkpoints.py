"""jobs shards checkpoints

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 19:15:59.261343
"""

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('jobs',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('status', sa.Enum('validating', 'queued', 'in_progress', 'finalizing', 'completed', 'failed', 'cancelling', 'cancelled', name='job_status', native_enum=False, length=16), nullable=False),
    sa.Column('model', sa.String(length=512), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('input_file', sa.Text(), nullable=False),
    sa.Column('storage_root', sa.Text(), nullable=False),
    sa.Column('output_dir', sa.Text(), nullable=False),
    sa.Column('max_model_len', sa.Integer(), nullable=True),
    sa.Column('request_total', sa.Integer(), nullable=False),
    sa.Column('request_completed', sa.Integer(), nullable=False),
    sa.Column('request_failed', sa.Integer(), nullable=False),
    sa.Column('shards_total', sa.Integer(), nullable=False),
    sa.Column('shards_done', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('engine_seconds', sa.Float(), nullable=False),
    sa.Column('wall_seconds', sa.Float(), nullable=True),
    sa.Column('requests_per_s', sa.Float(), nullable=True),
    sa.Column('output_tokens_per_s', sa.Float(), nullable=True),
    sa.Column('total_tokens_per_s', sa.Float(), nullable=True),
    sa.Column('hardware', sa.String(length=256), nullable=True),
    sa.Column('vllm_version', sa.String(length=64), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_status'), ['status'], unique=False)

    op.create_table('shards',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('status', sa.Enum('queued', 'running', 'completed', 'failed', 'cancelled', name='shard_status', native_enum=False, length=16), nullable=False),
    sa.Column('input_path', sa.Text(), nullable=False),
    sa.Column('rows', sa.Integer(), nullable=False),
    sa.Column('first_line', sa.Integer(), nullable=False),
    sa.Column('last_line', sa.Integer(), nullable=False),
    sa.Column('rows_ok', sa.Integer(), nullable=False),
    sa.Column('rows_failed', sa.Integer(), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('engine_seconds', sa.Float(), nullable=False),
    sa.Column('next_seq', sa.Integer(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('worker', sa.String(length=256), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'index')
    )
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_shards_job_id'), ['job_id'], unique=False)

    op.create_table('checkpoints',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('shard_id', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('rows', sa.Integer(), nullable=False),
    sa.Column('rows_ok', sa.Integer(), nullable=False),
    sa.Column('rows_failed', sa.Integer(), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('engine_seconds', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['shard_id'], ['shards.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('shard_id', 'seq')
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_shard_id'), ['shard_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_shard_id'))

    op.drop_table('checkpoints')
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_shards_job_id'))

    op.drop_table('shards')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_status'))

    op.drop_table('jobs')
