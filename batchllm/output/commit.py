"""The exactly-once commit protocol, its one owner: write a part file, then record its checkpoint
(the part's counts added in the same transaction), and tidy the part files no checkpoint records.

A row counts once because a part file counts only once its checkpoint is committed: a worker
that dies between the two leaves a file that resume (`resume_shard`) or the job's end
(`tidy_ended_jobs`, finalize) deletes, and its rows run again. The state machine only notes
which jobs ended; the storage I/O of tidying is done here, before the transaction that ended
them commits (a `before_commit` hook of store/db.py), whichever caller ended them."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import CursorResult, Table, bindparam, delete, insert, select, update
from sqlalchemy.orm import Session

from batchllm.errors import ShardLost
from batchllm.output.parts import (
    Part,
    part_name,
    read_lines,
    remove_unrecorded_parts,
    write_table,
)
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store.db import before_commit, session_scope, settings_of
from batchllm.store.models import Checkpoint, Job, Shard, ShardStatus
from batchllm.store.state_machine import take_ended_jobs

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
        cached_tokens=_JOBS.c.cached_tokens + bindparam("add_cached_tokens"),
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
    job_attempt: int = 1,
    cached_tokens: int = 0,
) -> None:
    """Record one committed part file and add its counts, in the caller's transaction.
    `job_attempt`: the job's run writing it (1, or a retry's: output/replace.py).
    `cached_tokens` (the rows' prefix-cache hits) is added to the job only.

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
            **_checkpoint_counts(rows_ok, rows_failed, prompt_tokens, completion_tokens),
            "engine_seconds": engine_seconds,
            "job_attempt": job_attempt,
        },
    )
    session.execute(
        _ADD_TO_JOB,
        {
            **counts,
            "job_id": job_id,
            "add_cached_tokens": cached_tokens,
            "add_structured_rows": structured_rows,
            "add_structured_valid": structured_valid,
        },
    )


def take_off(session: Session, *, shard_id: int, job_id: str, part: Part, next_seq: int) -> None:
    """Take the counts of rows a retry replaced off their shard and job (output/replace.py),
    in the transaction that records the rows replacing them. Not their prefix-cache hits: no
    row records them, so the job's cached_tokens counts every run's hits (a usage figure, like
    the tokens OpenAI bills), not only those of the rows its output holds."""
    counts = {
        "add_rows_ok": -part.rows_ok,
        "add_rows_failed": -part.rows_failed,
        "add_prompt_tokens": -part.prompt_tokens,
        "add_completion_tokens": -part.completion_tokens,
        "add_engine_seconds": 0.0,  # the engine did spend that time
    }
    session.execute(_ADD_TO_ANY_SHARD, {**counts, "shard_id": shard_id, "next_seq": next_seq})
    session.execute(
        _ADD_TO_JOB,
        {
            **counts,
            "job_id": job_id,
            "add_cached_tokens": 0,
            "add_structured_rows": -part.structured_rows,
            "add_structured_valid": -part.structured_valid,
        },
    )


def _checkpoint_counts(
    rows_ok: int, rows_failed: int, prompt_tokens: int, completion_tokens: int
) -> dict[str, int]:
    """The counts a checkpoint row holds of its part: its rows (ok and failed) and tokens."""
    return {
        "rows": rows_ok + rows_failed,
        "rows_ok": rows_ok,
        "rows_failed": rows_failed,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
    }


def _rowcount(result: Any) -> int:
    return cast("CursorResult[Any]", result).rowcount


def replace_checkpoint(
    session: Session, old: Checkpoint, *, path: str | None, kept: Part, seq: int
) -> None:
    """A recorded part rewritten without some of its lines (a retry's rows replace them,
    output/replace.py): the old file's checkpoint goes and the rewritten file's comes, holding
    the kept rows' counts and the old run's engine time and job attempt; with `path` None
    nothing of the part was kept. The counts the rows leave go through `take_off`."""
    session.execute(delete(Checkpoint).where(Checkpoint.id == old.id))
    if path is None:
        return
    session.add(
        Checkpoint(
            shard_id=old.shard_id,
            seq=seq,
            path=path,
            engine_seconds=old.engine_seconds,
            job_attempt=old.job_attempt,
            **_checkpoint_counts(
                kept.rows_ok, kept.rows_failed, kept.prompt_tokens, kept.completion_tokens
            ),
        )
    )


def checkpoints_of(session: Session, shard_id: int) -> list[Checkpoint]:
    return list(
        session.scalars(
            select(Checkpoint).where(Checkpoint.shard_id == shard_id).order_by(Checkpoint.seq)
        )
    )


@dataclass(frozen=True, slots=True)
class PartPlace:
    """Where a shard's run puts its next part file, and whose rows it holds: what writing and
    recording a part takes besides the part."""

    shard_id: int
    shard: int  # the shard's index in its job, which names its part files
    job_id: str
    out_dir: str
    seq: int  # the part's number in the shard
    attempt: int  # the run's claim on the shard, which fences the commit
    job_attempt: int  # the job's run (a retry's is 2, 3...)

    @property
    def file_name(self) -> str:
        return part_name(self.shard, self.seq, self.attempt)


def record_part(
    session: Session, part: Part, place: PartPlace, *, path: str, engine_seconds: float
) -> None:
    """record_checkpoint with the counts of a written `part` (a commit's, or a retry's)."""
    record_checkpoint(
        session,
        shard_id=place.shard_id,
        job_id=place.job_id,
        seq=place.seq,
        path=path,
        engine_seconds=engine_seconds,
        attempt=place.attempt,
        job_attempt=place.job_attempt,
        **part.counts(),
    )


def commit_part(
    storage: Storage, settings: Settings, part: Part, place: PartPlace, *, engine_seconds: float
) -> str:
    """Write one part file, then record its checkpoint; returns the file's path. A worker that
    lost its shard in between deletes its file and gets ShardLost: the rows belong to the
    worker that took the shard over."""
    path = write_table(storage, place.out_dir, place.file_name, part.table)
    try:
        with session_scope(settings) as session:
            record_part(session, part, place, path=path, engine_seconds=engine_seconds)
    except ShardLost:
        storage.delete(path)
        raise
    return path


def resume_shard(
    storage: Storage, out_dir: str, shard: int, committed: Iterable[Checkpoint], attempt: int
) -> set[int]:
    """The input lines a claimed shard's checkpoints already hold. Its part files no checkpoint
    records, of this attempt (`attempt`: the claim's) or an earlier one, were written by a
    worker that died between the file and the database commit: they are deleted, and their
    rows run again. A later attempt's files are not this run's to judge: this run may have
    been paused since its claim while another worker took the shard over, wrote and recorded
    them (the chaos run's long run lost a shard's 1,000 committed rows that way)."""
    committed = list(committed)
    recorded = (c.path for c in committed)
    for name in remove_unrecorded_parts(
        storage, out_dir, recorded, shard=shard, up_to_attempt=attempt
    ):
        log.warning("shard %d: removed uncommitted part file %s", shard, name)
    done: set[int] = set()
    for checkpoint in committed:
        done.update(read_lines(storage, checkpoint.path))
    return done


def tidy_unrecorded_parts(session: Session, storage: Storage, job_id: str) -> list[str]:
    """Delete the job's part files that no checkpoint records, once no shard of it runs: left
    by a worker that died between writing a file and its commit, or that lost its shard. The
    output of an ended job then holds exactly its committed rows."""
    recorded = session.scalars(select(Checkpoint.path).join(Shard).where(Shard.job_id == job_id))
    removed = remove_unrecorded_parts(storage, storage.output_dir(job_id), list(recorded))
    for name in removed:
        log.warning("job %s: removed unrecorded part file %s", job_id, name)
    return removed


@before_commit
def tidy_ended_jobs(session: Session) -> None:
    """Tidy the output of every job this transaction ended without completing it (cancelled,
    expired, failed). A storage error is logged, not raised: the job's end must not be undone."""
    settings = settings_of(session)
    for job_id in take_ended_jobs(session):
        job = session.get(Job, job_id)
        if job is None:
            continue
        try:
            tidy_unrecorded_parts(session, Storage.for_job(job, settings), job_id)
        except OSError as exc:
            log.warning("job %s: could not tidy its output (%s)", job_id, exc)
