"""Shard leases: a worker claims a shard, heartbeats it while it runs, hands it back, and a
shard whose worker stopped heartbeating for a lease can be taken over. Each claim is a numbered
attempt that fences the writes of the run that holds it."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchllm.errors import ShardBusy
from batchllm.store.clock import lease_clock
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus
from batchllm.store.state_machine import (
    TAKING_WORK,
    end_shard,
    requeue_shard,
    run_shard,
    start_job,
    update_shard,
)

log = logging.getLogger(__name__)


def claim_shard(
    session: Session, shard_id: int, worker: str, lease_seconds: float = 120.0
) -> Shard | None:
    """Mark a shard running for this worker; None when it must not run (done, or cancelled).

    A shard already `running` is claimable again when its heartbeat is older than the lease:
    that is a redelivery after its worker died. With a fresh heartbeat it raises ShardBusy,
    unless the claim comes from the worker that ran it: a worker runs one shard at a time, so
    its earlier run is over (it ended on an error, e.g. the database went away mid-shard).
    """
    shard = session.get(Shard, shard_id)
    if shard is None or shard.status not in (ShardStatus.QUEUED, ShardStatus.RUNNING):
        return None
    job_status = session.scalar(select(Job.status).where(Job.id == shard.job_id))
    now = lease_clock(session)
    stale = now - timedelta(seconds=lease_seconds)
    if job_status in (JobStatus.CANCELLING, JobStatus.CANCELLED):
        heartbeat_at = shard.heartbeat_at
        alive = (
            shard.status is ShardStatus.RUNNING
            and shard.worker != worker
            and heartbeat_at is not None
            and heartbeat_at >= stale
        )
        if not alive:  # a live worker ends its own run (keeping its finished rows) instead
            end_shard(session, shard.id, ShardStatus.CANCELLED)
        return None
    claimed = run_shard(session, shard_id, worker, now=now, stale_before=stale)
    if not claimed:
        session.refresh(shard)
        if shard.status == ShardStatus.RUNNING:
            raise ShardBusy(f"shard {shard.index} of {shard.job_id} is running on {shard.worker}")
        return None
    start_job(session, shard.job_id)
    session.refresh(shard)
    return shard


def heartbeat(session: Session, owned: dict[int, int]) -> set[int]:
    """Refresh the heartbeat of the shards this worker runs ({shard id: attempt}); returns the
    ids it no longer owns (taken over after its lease ran out), which it must stop running."""
    lost = set()
    now = lease_clock(session)
    for shard_id, attempt in owned.items():
        if not update_shard(
            session,
            shard_id,
            Shard.attempts == attempt,
            Shard.status == ShardStatus.RUNNING,
            heartbeat_at=now,
        ):
            lost.add(shard_id)
    return lost


def release_shard(session: Session, shard_id: int, attempt: int) -> bool:
    """Hand a running shard back (warm shutdown) so its next delivery can claim it at once."""
    return requeue_shard(session, shard_id, attempt=attempt)


def requeue_stale_shards(
    session: Session, lease_seconds: float
) -> list[tuple[int, dict[str, Any]]]:
    """Put back running shards whose worker stopped heartbeating (killed, node lost).

    Returns (shard id, job spec) for each shard put back, for the caller to enqueue. Each shard is
    moved by one conditional UPDATE, so of several sweeping workers only one re-enqueues it.
    """
    stale = lease_clock(session) - timedelta(seconds=lease_seconds)
    found = session.execute(
        select(Shard.id, Job.spec)
        .join(Job)
        .where(
            Shard.status == ShardStatus.RUNNING,
            Shard.heartbeat_at < stale,
            Job.status.in_(TAKING_WORK),
            Job.local_run.is_(False),
        )
    ).all()
    moved = []
    for shard_id, spec in found:
        if requeue_shard(session, shard_id, heartbeat_before=stale):
            moved.append((shard_id, spec))
    return moved
