"""Checkpoints: each committed part file and the counts it adds, recorded in one transaction."""

from __future__ import annotations

import logging

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batchllm.errors import ShardLost
from batchllm.jobs.db import changed
from batchllm.jobs.models import Checkpoint, Job, Shard, ShardStatus

log = logging.getLogger(__name__)


def record_checkpoint(
    session: Session,
    *,
    shard_id: int,
    job_id: str,
    seq: int,
    path: str,
    rows_ok: int,
    rows_failed: int,
    prompt_tokens: int,
    completion_tokens: int,
    engine_seconds: float,
    attempt: int | None = None,
    structured_rows: int = 0,
    structured_valid: int = 0,
) -> None:
    """Record one committed part file and add its counts, in the caller's transaction.

    With `attempt`, the write is fenced: it only lands while the shard is still running under
    that attempt. A worker that lost its shard (its lease ran out and another worker took the
    shard over) gets ShardLost and must not count its rows.
    """
    fence = [Shard.id == shard_id]
    if attempt is not None:
        fence += [Shard.attempts == attempt, Shard.status == ShardStatus.RUNNING]
    owned = changed(
        session,
        update(Shard)
        .where(*fence)
        .values(
            rows_ok=Shard.rows_ok + rows_ok,
            rows_failed=Shard.rows_failed + rows_failed,
            prompt_tokens=Shard.prompt_tokens + prompt_tokens,
            completion_tokens=Shard.completion_tokens + completion_tokens,
            engine_seconds=Shard.engine_seconds + engine_seconds,
            next_seq=seq + 1,
        )
        .execution_options(synchronize_session=False),
    )
    if not owned:
        raise ShardLost(f"shard {shard_id} is no longer run by attempt {attempt}")
    session.add(
        Checkpoint(
            shard_id=shard_id,
            seq=seq,
            path=path,
            rows=rows_ok + rows_failed,
            rows_ok=rows_ok,
            rows_failed=rows_failed,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            engine_seconds=engine_seconds,
        )
    )
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(
            request_completed=Job.request_completed + rows_ok,
            request_failed=Job.request_failed + rows_failed,
            prompt_tokens=Job.prompt_tokens + prompt_tokens,
            completion_tokens=Job.completion_tokens + completion_tokens,
            engine_seconds=Job.engine_seconds + engine_seconds,
            structured_rows=Job.structured_rows + structured_rows,
            structured_valid=Job.structured_valid + structured_valid,
        )
    )


def checkpoints_of(session: Session, shard_id: int) -> list[Checkpoint]:
    return list(
        session.scalars(
            select(Checkpoint).where(Checkpoint.shard_id == shard_id).order_by(Checkpoint.seq)
        )
    )
