"""jobs.attempts (the runs of a job: its first run and each `batchllm retry`),
checkpoints.job_attempt (the run that committed a part file)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 07:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("attempts", sa.JSON(), nullable=True))
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("job_attempt", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("job_attempt")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("attempts")
