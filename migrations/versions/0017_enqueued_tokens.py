"""Tokens as the unit of admission and fair share (issue 64, item 3).

jobs.prompt_tokens_estimate: a batch's prompt tokens as estimated at create, what its key's
enqueued-token limit reserves (released as its rows finish, whole when it ends).
api_keys.enqueued_token_limit: a key's own limit (null: BATCHLLM_API_MAX_ENQUEUED_TOKENS).
api_keys.share_weight: the key's weight in the fair share of tokens served (1 by default).
checkpoints.created_at indexed: fair share sums the tokens each tenant was served within a
recent window, a range of that column.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07 17:15:00
"""

from alembic import op
import sqlalchemy as sa


revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("prompt_tokens_estimate", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("enqueued_token_limit", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("share_weight", sa.Float(), nullable=False, server_default="1"))
    op.create_index("ix_checkpoints_created_at", "checkpoints", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_checkpoints_created_at", table_name="checkpoints")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("share_weight")
        batch.drop_column("enqueued_token_limit")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("prompt_tokens_estimate")
