"""The queries that move stuck states on, for the reconciler (batchllm/worker/reconciler.py).

Each move is one conditional UPDATE, so several workers reconciling at once never both win it:
the one whose UPDATE changed the row acts (re-sends the task, ends the job), the others skip.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from batchllm.store import state_machine
from batchllm.store.clock import lease_clock
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus, utcnow

log = logging.getLogger(__name__)

RUNNABLE_JOBS = state_machine.RUNNABLE
TAKING_WORK = state_machine.TAKING_WORK
FINAL_JOBS = [status for status in JobStatus if status.is_final]


def end_stale_shards_of_cancelled_jobs(
    session: Session, lease_seconds: float, job_id: str | None = None
) -> list[str]:
    """End as cancelled the running shards of cancelling jobs whose worker stopped
    heartbeating (no live worker will see the cancel), and any queued shard of such a job.
    Returns the ids of the jobs this ended (now `cancelled`)."""
    stale = lease_clock(session) - timedelta(seconds=lease_seconds)
    query = (
        select(Shard)
        .join(Job)
        .where(
            Job.status == JobStatus.CANCELLING,
            or_(
                Shard.status == ShardStatus.QUEUED,
                (Shard.status == ShardStatus.RUNNING)
                & (Shard.heartbeat_at.is_(None) | (Shard.heartbeat_at < stale)),
            ),
        )
    )
    if job_id is not None:
        query = query.where(Job.id == job_id)
    ended = []
    for shard in session.scalars(query).all():
        if state_machine.end_shard(
            session, shard.id, ShardStatus.CANCELLED, attempt=shard.attempts
        ) in (JobStatus.CANCELLED, JobStatus.EXPIRED):
            ended.append(shard.job_id)
    return ended


def expire_overdue_jobs(session: Session, job_id: str | None = None) -> list[str]:
    """Jobs whose completion window has passed stop like a cancel (running shards abort and
    keep their finished rows, queued ones end) and then end `expired` (state_machine)."""
    query = select(Job.id).where(Job.expires_at < utcnow(), Job.status.in_(RUNNABLE_JOBS))
    if job_id is not None:
        query = query.where(Job.id == job_id)
    overdue = session.scalars(query).all()
    moved = []
    for job_id in overdue:
        if state_machine.begin_expiry(session, job_id):
            moved.append(job_id)
    return moved


def expire_jobs(session: Session, lease_seconds: float, job_id: str | None = None) -> list[str]:
    """The expiry part of a reconciler pass, for `batchllm serve`, which may run with no worker
    and so no reconciler: a batch must still end when its window passes. Overdue jobs stop;
    those whose shards no live worker holds end `expired` now (a running shard's worker ends
    it itself). Returns the ids of the jobs this ended."""
    expire_overdue_jobs(session, job_id)
    stopping = select(Job.id).where(Job.status == JobStatus.CANCELLING, Job.expires_at < utcnow())
    if job_id is not None:
        stopping = stopping.where(Job.id == job_id)
    ended = []
    for stopping_id in session.scalars(stopping).all():
        ended += end_stale_shards_of_cancelled_jobs(session, lease_seconds, stopping_id)
    return ended + end_cancelling_jobs_without_shards(session)


def end_cancelling_jobs_without_shards(session: Session) -> list[str]:
    """A cancelling job whose shards have all ended (e.g. the last one ended between the
    cancel and its commit) becomes `cancelled`."""
    ended = []
    for job_id in session.scalars(
        select(Job.id).where(
            Job.status == JobStatus.CANCELLING, Job.shards_done >= Job.shards_total
        )
    ).all():
        if state_machine.after_last_shard(session, job_id) in (
            JobStatus.CANCELLED,
            JobStatus.EXPIRED,
        ):
            ended.append(job_id)
    return ended


def jobs_ended_before(session: Session, cutoff: datetime, limit: int) -> list[str]:
    """Up to `limit` ended jobs that ended before `cutoff` (those that never started count
    from their creation), oldest first: the ones retention deletes."""
    ended_at = func.coalesce(Job.finished_at, Job.created_at)
    return list(
        session.scalars(
            select(Job.id)
            .where(Job.status.in_(FINAL_JOBS), ended_at < cutoff)
            .order_by(ended_at)
            .limit(limit)
        )
    )


def finalizing_jobs(session: Session) -> list[str]:
    """Jobs whose last shard ended but that are not completed yet: the worker that ended it
    died before writing the manifest, or is writing it now (finalizing is then a no-op)."""
    return list(session.scalars(select(Job.id).where(Job.status == JobStatus.FINALIZING)))


def queued_shards_to_check(
    session: Session, grace_seconds: float
) -> list[tuple[int, dict[str, Any]]]:
    """(shard id, job spec) of queued shards of runnable jobs whose task was sent long enough
    ago to be in the broker (or to have been picked up)."""
    sent_before = lease_clock(session) - timedelta(seconds=grace_seconds)
    return list(
        session.execute(
            select(Shard.id, Job.spec)
            .join(Job)
            .where(
                Shard.status == ShardStatus.QUEUED,
                Job.status.in_(RUNNABLE_JOBS),
                Job.local_run.is_(False),
                Shard.dispatched_at.is_(None) | (Shard.dispatched_at < sent_before),
            )
        ).all()
    )


def mark_dispatched(session: Session, shard_ids: list[int]) -> None:
    if shard_ids:
        session.execute(
            update(Shard).where(Shard.id.in_(shard_ids)).values(dispatched_at=lease_clock(session))
        )


def claim_redispatch(session: Session, shard_id: int, grace_seconds: float) -> bool:
    """Take the right to re-send this queued shard's task; False if another reconciler took
    it (or a worker claimed the shard) since it was read."""
    now = lease_clock(session)  # one read of the database's clock, not two
    sent_before = now - timedelta(seconds=grace_seconds)
    return state_machine.update_shard(
        session,
        shard_id,
        Shard.status == ShardStatus.QUEUED,
        Shard.dispatched_at.is_(None) | (Shard.dispatched_at < sent_before),
        dispatched_at=now,
    )


def fail_abandoned_local_runs(session: Session, lease_seconds: float) -> list[str]:
    """Jobs of a `batchllm run` that was killed (no heartbeat for a lease) end `failed`: no
    fleet will ever pick their shards up, and `in_progress` forever would be a lie."""
    stale = lease_clock(session) - timedelta(seconds=lease_seconds)
    job_ids = session.scalars(
        select(Job.id)
        .join(Shard)
        .where(
            Job.status.in_(RUNNABLE_JOBS),
            Job.local_run.is_(True),
            Shard.status == ShardStatus.RUNNING,
            Shard.heartbeat_at < stale,
        )
        .distinct()
    ).all()
    for job_id in job_ids:
        state_machine.fail_job(
            session,
            job_id,
            "the `batchllm run` process running it stopped without ending it (killed?)",
        )
    return list(job_ids)
