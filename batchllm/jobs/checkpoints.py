"""Checkpoints: each committed part file and the counts it adds, recorded in one transaction."""

from __future__ import annotations

import logging
from typing import Any, cast

from sqlalchemy import CursorResult, Table, bindparam, insert, select, update
from sqlalchemy.orm import Session

from batchllm.errors import ShardLost
from batchllm.jobs.models import Checkpoint, Job, Shard, ShardStatus

log = logging.getLogger(__name__)

# The statements are built once, with bound parameters: building them (and the ORM's unit of
# work for the checkpoint row) cost more than running them, a few milliseconds per commit.
_SHARDS = cast(Table, Shard.__table__)
_JOBS = cast(Table, Job.__table__)
_CHECKPOINTS = cast(Table, Checkpoint.__table__)
# Parameter names differ from the column names: those are reserved for the SET clause.
_ADD_TO_SHARD = _SHARDS.update().values(
    rows_ok=_SHARDS.c.rows_ok + bindparam("add_rows_ok"),
    rows_failed=_SHARDS.c.rows_failed + bindparam("add_rows_failed"),
    prompt_tokens=_SHARDS.c.prompt_tokens + bindparam("add_prompt_tokens"),
    completion_tokens=_SHARDS.c.completion_tokens + bindparam("add_completion_tokens"),
    engine_seconds=_SHARDS.c.engine_seconds + bindparam("add_engine_seconds"),
    next_seq=bindparam("next_seq"),
)
_ADD_TO_ANY_SHARD = _ADD_TO_SHARD.where(_SHARDS.c.id == bindparam("shard_id"))
# Fenced: only while the shard is still running under the caller's attempt.
_ADD_TO_OWNED_SHARD = _ADD_TO_ANY_SHARD.where(
    _SHARDS.c.attempts == bindparam("attempt"), _SHARDS.c.status == ShardStatus.RUNNING
)
_ADD_TO_JOB = (
    update(_JOBS)
    .where(_JOBS.c.id == bindparam("job_id"))
    .values(
        request_completed=_JOBS.c.request_completed + bindparam("add_rows_ok"),
        request_failed=_JOBS.c.request_failed + bindparam("add_rows_failed"),
        prompt_tokens=_JOBS.c.prompt_tokens + bindparam("add_prompt_tokens"),
        completion_tokens=_JOBS.c.completion_tokens + bindparam("add_completion_tokens"),
        engine_seconds=_JOBS.c.engine_seconds + bindparam("add_engine_seconds"),
        structured_rows=_JOBS.c.structured_rows + bindparam("add_structured_rows"),
        structured_valid=_JOBS.c.structured_valid + bindparam("add_structured_valid"),
    )
)
_INSERT_CHECKPOINT = insert(_CHECKPOINTS)


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
    counts = {
        "add_rows_ok": rows_ok,
        "add_rows_failed": rows_failed,
        "add_prompt_tokens": prompt_tokens,
        "add_completion_tokens": completion_tokens,
        "add_engine_seconds": engine_seconds,
    }
    to_shard = _ADD_TO_ANY_SHARD if attempt is None else _ADD_TO_OWNED_SHARD
    owned = _rowcount(
        session.execute(
            to_shard, {**counts, "shard_id": shard_id, "attempt": attempt, "next_seq": seq + 1}
        )
    )
    if not owned:
        raise ShardLost(f"shard {shard_id} is no longer run by attempt {attempt}")
    session.execute(
        _INSERT_CHECKPOINT,
        {
            "shard_id": shard_id,
            "seq": seq,
            "path": path,
            "rows": rows_ok + rows_failed,
            "rows_ok": rows_ok,
            "rows_failed": rows_failed,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "engine_seconds": engine_seconds,
        },
    )
    session.execute(
        _ADD_TO_JOB,
        {
            **counts,
            "job_id": job_id,
            "add_structured_rows": structured_rows,
            "add_structured_valid": structured_valid,
        },
    )


def _rowcount(result: Any) -> int:
    return cast("CursorResult[Any]", result).rowcount


def checkpoints_of(session: Session, shard_id: int) -> list[Checkpoint]:
    return list(
        session.scalars(
            select(Checkpoint).where(Checkpoint.shard_id == shard_id).order_by(Checkpoint.seq)
        )
    )
