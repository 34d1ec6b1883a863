"""The reconciler: makes every non-final state move, whatever happened to broker or database.

Every worker runs it in a thread (`batchllm reconcile` by hand). One pass re-queues running
shards whose worker stopped heartbeating for a lease, re-sends tasks the broker lost (Redis
restarted without persistence, a task acknowledged after a database error), ends cancelling jobs
with no live worker, finalizes jobs left `finalizing`, sends owed webhook events, deletes ended
jobs past BATCHLLM_RETAIN_DAYS, and releases waiting jobs (`submit --after`) whose parents all
completed (or fails them, naming the parent that did not). Each move is a conditional UPDATE,
so reconcilers on many workers never do it twice; a task sent twice is harmless (the second
delivery finds the shard running or done and steps aside).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from batchllm.errors import JobNotFound
from batchllm.execution.finalize import finalize_job
from batchllm.execution.webhooks import deliver_due
from batchllm.output.deletion import delete_job
from batchllm.settings import Settings
from batchllm.store import dependencies, leases, recovery
from batchllm.store.db import session_scope
from batchllm.store.models import utcnow
from batchllm.worker.broker_tasks import BrokerNotInspectable, shard_ids_in_broker
from batchllm.worker.celery_app import TASK_RUN_SHARD, queue_for_stored_spec

log = logging.getLogger(__name__)

SendShard = Callable[[int, str], None]  # (shard id, queue)


@dataclass
class Pass:
    """What one reconciler pass did."""

    requeued_stale: list[int] = field(default_factory=list)
    resent_lost: list[int] = field(default_factory=list)
    cancelled_jobs: list[str] = field(default_factory=list)
    finalized_jobs: list[str] = field(default_factory=list)
    expired_jobs: list[str] = field(default_factory=list)
    notified_jobs: list[str] = field(default_factory=list)
    deleted_jobs: list[str] = field(default_factory=list)
    released_jobs: list[str] = field(default_factory=list)
    failed_waiting_jobs: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.released_jobs
            or self.failed_waiting_jobs
            or self.requeued_stale
            or self.resent_lost
            or self.cancelled_jobs
            or self.finalized_jobs
            or self.expired_jobs
            or self.notified_jobs
            or self.deleted_jobs
        )


def reconcile_once(send: SendShard, settings: Settings) -> Pass:
    done = Pass()
    with session_scope(settings) as session:
        stale = leases.requeue_stale_shards(session, settings.lease_seconds)
        # Queued again and dispatched in one step: the lost-task check below (or another
        # reconciler) must not take the moment between the two for a lost task.
        recovery.mark_dispatched(session, [shard_id for shard_id, _ in stale])
    for shard_id, spec in stale:
        log.warning(
            "shard %s lost its worker (no heartbeat for %.0f s): queued again",
            shard_id,
            settings.lease_seconds,
        )
        send(shard_id, queue_for_stored_spec(spec))
        done.requeued_stale.append(shard_id)

    done.resent_lost = _resend_lost_tasks(send, settings)
    _move_waiting_jobs(send, settings, done)

    with session_scope(settings) as session:
        done.expired_jobs = recovery.expire_overdue_jobs(session)
    for job_id in done.expired_jobs:
        log.warning("job %s: its completion window passed; stopping it (expired)", job_id)

    with session_scope(settings) as session:
        done.cancelled_jobs = recovery.end_stale_shards_of_cancelled_jobs(
            session, settings.lease_seconds
        ) + recovery.end_cancelling_jobs_without_shards(session)
    for job_id in done.cancelled_jobs:
        log.warning(
            "job %s ended (cancelled, or expired): its remaining shards had no live worker",
            job_id,
        )

    with session_scope(settings) as session:
        finalizing = recovery.finalizing_jobs(session)
    for job_id in finalizing:
        # hardware/version: the job row has them from its first engine step.
        if finalize_job(job_id, settings=settings, hardware=None, vllm_version=None):
            log.warning("job %s was left finalizing: finalized it", job_id)
            done.finalized_jobs.append(job_id)
    done.notified_jobs = deliver_due(settings)

    done.deleted_jobs = _delete_retired_jobs(settings)
    return done


# Jobs deleted per pass at most: a first pass over a long history must not hold the
# reconciler (and the other moves) for long; the next passes take the rest.
_DELETIONS_PER_PASS = 100


def _delete_retired_jobs(settings: Settings) -> list[str]:
    if settings.retain_days is None:
        return []
    cutoff = utcnow() - timedelta(days=settings.retain_days)
    with session_scope(settings) as session:
        retired = recovery.jobs_ended_before(session, cutoff, _DELETIONS_PER_PASS)
    deleted = []
    for job_id in retired:
        try:
            gone = delete_job(settings, job_id)
        except JobNotFound:  # another worker's reconciler deleted it first
            continue
        except OSError as exc:  # the storage refused: the job stays, the next pass retries
            log.warning("job %s: retention could not delete its files (%s)", job_id, exc)
            continue
        log.warning(
            "job %s (%s) deleted: it ended more than BATCHLLM_RETAIN_DAYS=%g days ago",
            gone.id,
            gone.status,
            settings.retain_days,
        )
        deleted.append(gone.id)
    return deleted


def _move_waiting_jobs(send: SendShard, settings: Settings, done: Pass) -> None:
    with session_scope(settings) as session:
        moved = dependencies.move_waiting_jobs(session)
    for shard_id, spec in moved.shards:
        send(shard_id, queue_for_stored_spec(spec))
    for job_id in moved.released:
        log.warning("job %s: the jobs it runs after completed; its shards are queued", job_id)
    for job_id in moved.failed:
        log.warning("job %s failed: a job it runs after did not complete", job_id)
    done.released_jobs, done.failed_waiting_jobs = moved.released, moved.failed


def _resend_lost_tasks(send: SendShard, settings: Settings) -> list[int]:
    # A task is given a lease's time to reach the broker and be picked up before it counts
    # as lost; re-sending one that is merely slow would only add a duplicate delivery.
    grace = settings.lease_seconds
    with session_scope(settings) as session:
        candidates = recovery.queued_shards_to_check(session, grace)
    if not candidates:
        return []
    queues = {queue_for_stored_spec(spec) for _, spec in candidates}
    try:
        # A task delivered a lease ago whose shard is still unclaimed and that no live worker
        # marks held (worker/holding.py) belongs to a worker that died with it.
        present = shard_ids_in_broker(
            settings.broker_url, queues, TASK_RUN_SHARD, unacked_grace=grace
        )
    except BrokerNotInspectable as exc:
        log.debug("%s: lost queued tasks are not re-sent", exc)
        return []
    resent = []
    for shard_id, spec in candidates:
        if shard_id in present:
            continue
        with session_scope(settings) as session:
            claimed = recovery.claim_redispatch(session, shard_id, grace)
        if claimed:
            log.warning(
                "shard %s is queued but the broker has no task for it: sent again", shard_id
            )
            send(shard_id, queue_for_stored_spec(spec))
            resent.append(shard_id)
    return resent


def reconcile_forever(send: SendShard, stop: threading.Event, settings: Settings) -> None:
    """Reconcile every `reconcile_seconds` until `stop` is set; survives any outage."""
    failing = False
    while not stop.wait(settings.reconcile_seconds):
        try:
            reconcile_once(send, settings)
            if failing:
                log.warning("reconciler: database and broker reachable again")
            failing = False
        except Exception as exc:  # a database or broker outage: say so, keep trying
            log.warning(
                "reconciler: pass failed (%s: %s); retrying in %.0f s",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
                settings.reconcile_seconds,
            )
            failing = True
