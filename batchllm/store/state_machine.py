"""The job and shard state machine: a shard ends once, the last one moves its job on
(finalizing, failed, cancelled), and the job completes once. Every transition is one
conditional SQL UPDATE, so concurrent workers on PostgreSQL cannot both win it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from batchllm.store.db import changed
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus, utcnow

log = logging.getLogger(__name__)


ACTIVE = (
    JobStatus.VALIDATING,
    JobStatus.WAITING,
    JobStatus.QUEUED,
    JobStatus.IN_PROGRESS,
    JobStatus.FINALIZING,
    JobStatus.CANCELLING,
)
RUNNABLE = (JobStatus.QUEUED, JobStatus.IN_PROGRESS)
# Jobs whose queued shards workers run: a job submitted to the fleet releases its shards while
# it is still validating (store/shard_recording.py).
TAKING_WORK = (JobStatus.VALIDATING, *RUNNABLE)


def end_validation(
    session: Session, job_id: str, *, shards_total: int, request_total: int, hold: bool = False
) -> JobStatus | None:
    """validating -> queued once its input is stored and every shard recorded; in_progress
    when workers already took shards it released while validating (store/shard_recording.py).
    Returns, like end_shard, the state the caller must finish the job in when its shards have
    all ended meanwhile (FINALIZING: write the manifest; CANCELLED/FAILED: already set).

    The counts' UPDATE comes before the shards are counted done, in one transaction: it takes
    the job's row lock (SQLite: the write lock), so a worker ending the last shard at the same
    time either ended it before (and is counted here) or waits and then sees the final counts
    and state in after_last_shard: one of the two moves the job on, never neither.

    `hold`: validating -> waiting instead, for a job that runs after others (its shards were
    not released: store/dependencies.py releases them)."""
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(shards_total=shards_total, request_total=request_total)
    )
    started = session.scalar(
        select(Shard.id).where(Shard.job_id == job_id, Shard.started_at.is_not(None)).limit(1)
    )
    target = JobStatus.QUEUED if started is None else JobStatus.IN_PROGRESS
    if hold:
        _move_job(session, job_id, (JobStatus.VALIDATING,), JobStatus.WAITING)
        return None
    _move_job(session, job_id, (JobStatus.VALIDATING,), target)
    return after_last_shard(session, job_id)


def release_waiting_job(session: Session, job_id: str) -> bool:
    """waiting -> queued, once the jobs it runs after completed (store/dependencies.py)."""
    return _move_job(session, job_id, (JobStatus.WAITING,), JobStatus.QUEUED)


def fail_waiting_job(session: Session, job_id: str, reason: str) -> bool:
    """waiting -> failed, because a job it runs after did not complete; its shards, none of
    which ran, end cancelled."""
    if not changed(
        session,
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.WAITING)
        .values(status=JobStatus.FAILED, error=reason, finished_at=utcnow()),
    ):
        return False
    session.execute(
        update(Shard)
        .where(Shard.job_id == job_id, Shard.status == ShardStatus.QUEUED)
        .values(status=ShardStatus.CANCELLED, finished_at=utcnow())
    )
    note_job_ended(session, job_id)
    return True


def start_job(session: Session, job_id: str) -> bool:
    """queued -> in_progress, when a worker claims its first shard (a job still validating
    moves on when its validation ends: end_validation)."""
    return _move_job(session, job_id, (JobStatus.QUEUED,), JobStatus.IN_PROGRESS)


def begin_cancel(session: Session, job_id: str) -> bool:
    """Any active state -> cancelling: its shards end as their workers see it (or are gone)."""
    return _move_job(session, job_id, ACTIVE, JobStatus.CANCELLING, cancelling_at=utcnow())


def begin_expiry(session: Session, job_id: str) -> bool:
    """queued or in_progress -> cancelling, because its completion window passed: it stops
    like a cancel and ends `expired` (after_last_shard tells the two apart)."""
    return _move_job(session, job_id, RUNNABLE, JobStatus.CANCELLING)


def _move_job(
    session: Session,
    job_id: str,
    sources: tuple[JobStatus, ...],
    target: JobStatus,
    **values: Any,
) -> bool:
    return bool(
        changed(
            session,
            update(Job)
            .where(Job.id == job_id, Job.status.in_(sources))
            .values(status=target, **values),
        )
    )


def update_shard(session: Session, shard_id: int, *conditions: Any, **values: Any) -> bool:
    """Set `values` on one shard while `conditions` hold: the conditional UPDATE a shard's
    transitions are; True when it changed. Not mirrored by the ORM in Python (the shard may
    not be loaded; a caller that holds it refreshes it)."""
    return bool(
        changed(
            session,
            update(Shard)
            .where(Shard.id == shard_id, *conditions)
            .values(**values)
            .execution_options(synchronize_session=False),
        )
    )


def end_open_shard(
    session: Session,
    shard: Shard,
    status: ShardStatus,
    error: str | None = None,
    attempt: int | None = None,
) -> bool:
    """End a shard that is still queued or running (under `attempt`, if given) and count it
    done on its job; False when it had already ended (or another attempt holds it)."""
    fence = [Shard.id == shard.id, Shard.status.in_([ShardStatus.QUEUED, ShardStatus.RUNNING])]
    if attempt is not None:
        fence.append(Shard.attempts == attempt)
    ended = changed(
        session,
        update(Shard).where(*fence).values(status=status, finished_at=utcnow(), error=error),
    )
    if ended:
        session.execute(
            update(Job).where(Job.id == shard.job_id).values(shards_done=Job.shards_done + 1)
        )
    return bool(ended)


def run_shard(
    session: Session, shard_id: int, worker: str, *, now: datetime, stale_before: datetime
) -> bool:
    """queued -> running under a new attempt for `worker`; also a running shard whose heartbeat
    is older than `stale_before` (its worker died) or that `worker` itself ran (its run is over:
    a worker runs a shard once at a time). False when the shard was not claimable."""
    return update_shard(
        session,
        shard_id,
        or_(
            Shard.status == ShardStatus.QUEUED,
            and_(
                Shard.status == ShardStatus.RUNNING,
                or_(
                    Shard.heartbeat_at.is_(None),
                    Shard.heartbeat_at < stale_before,
                    Shard.worker == worker,
                ),
            ),
        ),
        status=ShardStatus.RUNNING,
        worker=worker,
        attempts=Shard.attempts + 1,
        heartbeat_at=now,
        started_at=func.coalesce(Shard.started_at, now),
    )


def requeue_shard(
    session: Session,
    shard_id: int,
    *,
    attempt: int | None = None,
    heartbeat_before: datetime | None = None,
) -> bool:
    """running -> queued: handed back by the run holding `attempt` (a warm shutdown), or taken
    back when its heartbeat is older than `heartbeat_before` (its worker died)."""
    fence = [Shard.id == shard_id, Shard.status == ShardStatus.RUNNING]
    if attempt is not None:
        fence.append(Shard.attempts == attempt)
    statement = update(Shard).where(*fence).values(status=ShardStatus.QUEUED)
    if heartbeat_before is not None:
        # Not mirrored by the ORM in Python: the shards were read by a query, not loaded.
        statement = statement.where(Shard.heartbeat_at < heartbeat_before).execution_options(
            synchronize_session=False
        )
    return bool(changed(session, statement))


def count_shard_failure(
    session: Session,
    shard_id: int,
    error: str,
    *,
    worker: str,
    delay: Callable[[int], float],
    count: bool = True,
) -> int | None:
    """A run of a shard failed with an error no row explains: count it, keep its message,
    and put the shard back (queued, not run before `delay(failures)` seconds from now). A shard
    running under another worker is not touched. `count=False`: not the shard's fault (its
    storage was away), put back without counting. Returns the failures so far, None when the
    shard had ended or is not this worker's."""
    counted = update_shard(
        session,
        shard_id,
        or_(
            Shard.status == ShardStatus.QUEUED,
            and_(Shard.status == ShardStatus.RUNNING, Shard.worker == worker),
        ),
        status=ShardStatus.QUEUED,
        failures=Shard.failures + (1 if count else 0),
        error=error,
    )
    if not counted:
        return None
    failures = int(session.scalar(select(Shard.failures).where(Shard.id == shard_id)) or 0)
    update_shard(session, shard_id, retry_at=utcnow() + timedelta(seconds=delay(failures)))
    return failures


def end_shard(
    session: Session,
    shard_id: int,
    status: ShardStatus,
    error: str | None = None,
    attempt: int | None = None,
) -> JobStatus | None:
    """End a shard once. When it was the job's last, move the job on and return the state the
    caller must finish it in (FINALIZING: write the manifest; CANCELLED/FAILED: already set)."""
    shard = session.get(Shard, shard_id)
    if shard is None or not end_open_shard(session, shard, status, error, attempt):
        return None
    return after_last_shard(session, shard.job_id)


def note_job_ended(session: Session, job_id: str) -> None:
    """Remember a job this transaction ended without completing it. Its output still holds the
    part files no checkpoint records; the output's owner (output/commit.py) tidies them, so the
    state machine itself never touches storage."""
    session.info.setdefault(_ENDED_JOBS, set()).add(job_id)


def take_ended_jobs(session: Session) -> list[str]:
    """The jobs this transaction ended without completing them, each handed out once."""
    return sorted(session.info.pop(_ENDED_JOBS, set()))


_ENDED_JOBS = "batchllm.jobs_ended"


def after_last_shard(session: Session, job_id: str) -> JobStatus | None:
    done, total, status = session.execute(
        select(Job.shards_done, Job.shards_total, Job.status).where(Job.id == job_id)
    ).one()
    if done < total or status == JobStatus.VALIDATING:
        # Still validating: more shards are coming (end_validation moves it on).
        return None
    failed = session.scalar(
        select(func.count())
        .select_from(Shard)
        .where(Shard.job_id == job_id, Shard.status == ShardStatus.FAILED)
    )
    now = utcnow()
    expires_at = session.scalar(select(Job.expires_at).where(Job.id == job_id))
    # A job moved to cancelling because its completion window passed ends `expired`.
    ended = (
        JobStatus.EXPIRED if expires_at is not None and expires_at <= now else JobStatus.CANCELLED
    )
    if changed(
        session,
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.CANCELLING)
        .values(status=ended, finished_at=now),
    ):
        note_job_ended(session, job_id)
        return ended
    if failed:
        errors = session.scalars(
            select(Shard.error)
            .where(Shard.job_id == job_id, Shard.status == ShardStatus.FAILED)
            .limit(3)
        ).all()
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status.in_(ACTIVE))
            .values(
                status=JobStatus.FAILED,
                finished_at=utcnow(),
                error=f"{failed} shard(s) failed: " + "; ".join(e or "?" for e in errors),
            )
        )
        note_job_ended(session, job_id)
        return JobStatus.FAILED
    moved = changed(
        session,
        update(Job)
        .where(Job.id == job_id, Job.status.in_([JobStatus.QUEUED, JobStatus.IN_PROGRESS]))
        .values(status=JobStatus.FINALIZING, finalizing_at=utcnow()),
    )
    return JobStatus.FINALIZING if moved else None


FINAL = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED)


def reopen_for_retry(
    session: Session, job_id: str, shard_ids: list[int], *, lines: int, all_errors: bool
) -> Job | None:
    """An ended job -> queued as its next attempt (`batchllm retry`), with these shards queued
    again (the caller includes every shard that had not ended; the others stay counted done).
    The run that ended is closed in the job's `attempts` history and the new one opened.
    None when the job is not ended (still running, or another retry reopened it first: the
    update is fenced on the state and end time read)."""
    job = session.get(Job, job_id)
    if job is None or job.status not in FINAL:
        return None
    now = utcnow()
    history = _closed_history(job)
    attempt = len(history) + 1
    history.append(
        {
            "attempt": attempt,
            "lines": lines,
            "all_errors": all_errors,
            "status": None,
            "started_at": now.isoformat(),
            "finished_at": None,
            "wall_seconds": None,
        }
    )
    reopened = changed(
        session,
        update(Job)
        .where(
            Job.id == job_id,
            Job.status == job.status,
            Job.finished_at.is_(None)
            if job.finished_at is None
            else Job.finished_at == job.finished_at,
        )
        .values(
            status=JobStatus.QUEUED,
            attempts=history,
            finished_at=None,
            error=None,
            # A retried batch gets no new completion window: the one that passed is dropped.
            expires_at=None,
            shards_done=Job.shards_total - len(shard_ids),
            wall_seconds=sum(run["wall_seconds"] or 0.0 for run in history[:-1]),
        )
        .execution_options(synchronize_session=False),
    )
    if not reopened:
        return None
    # Any state: no worker runs a shard of an ended job (one still holding its claim, e.g. of a
    # `run` killed mid-write, is fenced out of its commits by the state it no longer sees).
    session.execute(
        update(Shard)
        .where(Shard.id.in_(shard_ids))
        .values(status=ShardStatus.QUEUED, finished_at=None, error=None, dispatched_at=None)
        .execution_options(synchronize_session=False)
    )
    session.expire(job)
    return job


def _closed_history(job: Job) -> list[dict[str, Any]]:
    """The job's runs so far, the last one closed with how and when it ended."""
    first_run: dict[str, Any] = {
        "attempt": 1,
        "lines": job.request_total,
        "all_errors": False,
        "started_at": (job.started_at or job.created_at).isoformat(),
    }
    history = [dict(run) for run in job.attempts] if job.attempts else [first_run]
    last = history[-1]
    started = datetime.fromisoformat(last["started_at"])
    if last.get("finished_at") is None:
        finished = job.finished_at or utcnow()
        last["status"] = job.status.value
        last["finished_at"] = finished.isoformat()
        last["wall_seconds"] = max((finished - started).total_seconds(), 0.0)
    return history


def complete_job(
    session: Session, job_id: str, *, hardware: str | None, vllm_version: str | None
) -> Job | None:
    """Compute the job's throughput and mark it completed; None if it is not finalizing
    (another worker finished it first). The row lock makes the check-and-set one step."""
    job = session.get(Job, job_id, with_for_update=True)
    if job is None or job.status is not JobStatus.FINALIZING:
        return None
    finished = utcnow()
    if job.attempts:  # retried: the time of its runs, not of the idle hours between them
        history = [dict(run) for run in job.attempts]
        run = history[-1]
        run_wall = max((finished - datetime.fromisoformat(run["started_at"])).total_seconds(), 0.0)
        run.update(status=JobStatus.COMPLETED.value, finished_at=finished.isoformat())
        run["wall_seconds"] = run_wall
        job.attempts = history
        wall = max(sum(r["wall_seconds"] or 0.0 for r in history), 1e-9)
    else:
        started = job.started_at or job.created_at
        wall = max((finished - started).total_seconds(), 1e-9)
    requests = job.request_completed + job.request_failed
    job.status = JobStatus.COMPLETED
    job.finished_at = finished
    job.wall_seconds = wall
    job.requests_per_s = requests / wall
    job.output_tokens_per_s = job.completion_tokens / wall
    job.total_tokens_per_s = (job.prompt_tokens + job.completion_tokens) / wall
    job.hardware = hardware or job.hardware
    job.vllm_version = vllm_version or job.vllm_version
    return job


def fail_job(session: Session, job_id: str, error: str) -> None:
    """An active job -> failed, with or without a worker (the one failure path): its output is
    tidied like any other ended job's."""
    if changed(
        session,
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE))
        .values(status=JobStatus.FAILED, error=error, finished_at=utcnow()),
    ):
        note_job_ended(session, job_id)
