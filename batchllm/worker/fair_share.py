"""Which queued shard a worker runs next: priorities and a fair share between tenants.

A shard task is a turn on its queue (model and engine kind); the database decides whose shard
gets it, the first queued one in this order: (1) the job's effective priority (high, normal,
low, rising a level per `priority_aging_seconds` waited, so low work always progresses); (2) its
tenant's share (a tenant: a `serve` API key; each CLI or Client job its own): the tenant served
the fewest tokens (prompt + output, committed within the last `fair_share_window_seconds`, over
its key's weight, `batchllm keys limits --weight`) goes first, so a tenant whose prompts are 20x
longer gets its share of the engine, not its share of turns: a weighted fair queue over tokens
served, as deficit round robin is; on a tie (no tokens yet, say), the tenant whose latest shard
started longest ago, or never, so one tenant's 100 batches delay another's one by at most one
shard; (3) the job's own turn among its tenant's jobs, then the older job, then the shard
worker/affinity.py picks for the worker (the lowest index when the worker is not known).

Tokens are counted from the committed checkpoints (every part file records its rows' prompt
and completion tokens): what a shard still running has served counts once its parts commit.
The window bounds a tenant's credit: one new to the queue takes every turn only until it has
been served what the others were within the window, and a tenant idle for a window starts
even. A failed run serves no tokens, so a failing shard's tenant is not held back by its
failure once its backoff has passed (its failure still orders it among tenants on a tie); the
backoff and BATCHLLM_MAX_SHARD_FAILURES bound how often it runs.

A shard in failure backoff (execution/shard_failures.py) takes no turn, and its failure counts
as its job's latest turn. The task whose shard lost its turn is queued again (every queued
shard keeps a task); the winner's task later finds its shard taken, steps aside.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.orm import Session

from batchllm.settings import Settings
from batchllm.spec import PRIORITIES
from batchllm.store import recovery
from batchllm.store.db import session_scope
from batchllm.store.models import ApiKey, Batch, Checkpoint, Job, Shard, ShardStatus, utcnow
from batchllm.worker.affinity import placed_shard
from batchllm.worker.celery_app import queue_for_stored_spec

log = logging.getLogger(__name__)

_NEVER = datetime.min.replace(tzinfo=timezone.utc)
_IN_CHUNK = 500  # shard ids per IN list: well under SQLite's and PostgreSQL's bound on them


@dataclass(frozen=True)
class Waiting:
    """An unfinished job of the queue, as the order above reads it."""

    job_id: str
    tenant: str
    priority: str
    created_at: datetime
    last_started: datetime | None
    has_queued: bool = True
    # The tenant's tokens served within the window over its weight (the same for each of its
    # jobs): the fewer, the sooner its turn.
    tenant_served: float = 0.0


def effective_level(priority: str, waited_seconds: float, aging_seconds: float) -> int:
    """0 for high ... 2 for low, less one per aging period waited, never below 0."""
    return max(0, PRIORITIES.index(priority) - int(waited_seconds // aging_seconds))


def order(waiting: list[Waiting], *, now: datetime, aging_seconds: float) -> list[str]:
    """The ids of the jobs with queued shards in the order their shards get turns (the
    others count only for their tenant's latest start)."""
    tenant_last: dict[str, datetime] = {}
    for job in waiting:
        last = job.last_started or _NEVER
        tenant_last[job.tenant] = max(tenant_last.get(job.tenant, _NEVER), last)

    def key(job: Waiting) -> tuple:
        waited = (now - job.created_at).total_seconds()
        return (
            effective_level(job.priority, waited, aging_seconds),
            job.tenant_served,
            tenant_last[job.tenant],
            job.last_started or _NEVER,
            job.created_at,
            job.job_id,
        )

    return [job.job_id for job in sorted(waiting, key=key) if job.has_queued]


def _ready(now: datetime) -> ColumnElement[bool]:
    """A queued shard that may run now: never failed, or its backoff has passed."""
    return and_(
        Shard.status == ShardStatus.QUEUED, or_(Shard.retry_at.is_(None), Shard.retry_at <= now)
    )


def next_shard(
    session: Session,
    shard_id: int,
    *,
    aging_seconds: float,
    window_seconds: float,
    worker: str | None = None,
) -> int:
    """The shard to run for a task of `shard_id`: itself unless it is queued and another
    queued shard of its queue comes first in the order above, or it is backing off after a
    failure while another can run. Within the job whose turn it is, the shard `worker` takes
    is worker/affinity.py's choice."""
    shard = session.get(Shard, shard_id)
    if shard is None or shard.status is not ShardStatus.QUEUED:
        return shard_id  # running elsewhere, done, gone: the task's usual path handles it
    now = utcnow()
    queue = queue_for_stored_spec(shard.job.spec)
    waiting = _unfinished_jobs(session, shard.job.model, queue, now)
    served = tenants_served(
        session, shard.job.model, {job.tenant for job in waiting}, now=now, window=window_seconds
    )
    waiting = [replace(job, tenant_served=served.get(job.tenant, 0.0)) for job in waiting]
    turns = order(waiting, now=now, aging_seconds=aging_seconds)
    if not turns:
        return shard_id
    first = turns[0]
    if worker is None:  # who asks is not known: no affinity, the task's own shard if it may
        if first == shard.job_id and (shard.retry_at is None or shard.retry_at <= now):
            return shard_id
        chosen = session.scalar(
            select(Shard.id)
            .where(Shard.job_id == first, _ready(now))
            .order_by(Shard.index)
            .limit(1)
        )
    else:
        chosen = placed_shard(session, first, _ready(now), worker=worker)
    return chosen if chosen is not None else shard_id


def _unfinished_jobs(session: Session, model: str, queue: str, now: datetime) -> list[Waiting]:
    has_queued = select(Shard.id).where(Shard.job_id == Job.id, _ready(now)).exists()
    rows = session.execute(
        select(Job.id, Job.spec, Job.created_at, Batch.owner, has_queued.label("has_queued"))
        .outerjoin(Batch, Batch.job_id == Job.id)
        .where(
            Job.model == model,
            Job.status.in_(recovery.TAKING_WORK),
            Job.local_run.is_(False),
        )
    ).all()
    jobs = [row for row in rows if queue_for_stored_spec(row.spec) == queue]
    if not jobs:
        return []
    # A failed run counts as a turn taken when it can run again: until then, the latest.
    last_started = {
        job_id: max(filter(None, (_aware(started), _aware(retry))), default=None)
        for job_id, started, retry in session.execute(
            select(Shard.job_id, func.max(Shard.started_at), func.max(Shard.retry_at))
            .where(Shard.job_id.in_([row.id for row in jobs]))
            .group_by(Shard.job_id)
        ).all()
    }
    return [
        Waiting(
            job_id=row.id,
            tenant=row.owner or row.id,
            priority=row.spec.get("priority", "normal"),
            created_at=row.created_at,
            last_started=last_started.get(row.id),
            has_queued=bool(row.has_queued),
        )
        for row in jobs
    ]


def tenants_served(
    session: Session, model: str, tenants: set[str], *, now: datetime, window: float
) -> dict[str, float]:
    """Each of `tenants`' tokens of `model` served (prompt + output, committed) within the
    last `window` seconds, over its key's weight (1 for a tenant with no key row: a CLI job,
    --no-auth's "local"). Recently ended jobs count too: a tenant of many small jobs is
    counted across them.

    In two steps, so that it reads the window and never a history: the window's checkpoints
    by their created_at index, summed per shard; then those shards' jobs by key. Joined in one
    query, SQLite's planner started from the model's jobs (every one it ever ran) instead."""
    if not tenants:
        return {}
    # Summed here, not by a GROUP BY shard_id, which SQLite's planner served by walking every
    # checkpoint in shard_id order rather than the window's range of created_at.
    per_shard: dict[int, int] = {}
    for shard_id, tokens_served in session.execute(
        select(Checkpoint.shard_id, Checkpoint.prompt_tokens + Checkpoint.completion_tokens).where(
            Checkpoint.created_at >= now - timedelta(seconds=window)
        )
    ):
        per_shard[shard_id] = per_shard.get(shard_id, 0) + int(tokens_served or 0)
    tokens: dict[str, int] = {}
    shard_ids = list(per_shard)
    for start in range(0, len(shard_ids), _IN_CHUNK):
        rows = session.execute(
            select(Shard.id, func.coalesce(Batch.owner, Job.id))
            .join(Job, Job.id == Shard.job_id)
            .outerjoin(Batch, Batch.job_id == Job.id)
            .where(
                Shard.id.in_(shard_ids[start : start + _IN_CHUNK]),
                Job.model == model,
                Job.local_run.is_(False),
            )
        ).all()
        for shard_id, tenant in rows:
            if tenant in tenants:
                tokens[tenant] = tokens.get(tenant, 0) + per_shard[shard_id]
    weights = dict(
        session.execute(
            select(ApiKey.id, ApiKey.share_weight).where(ApiKey.id.in_(list(tokens)))
        ).all()
    )
    return {name: total / (weights.get(name) or 1.0) for name, total in tokens.items()}


def _aware(value: datetime | None) -> datetime | None:
    # max() of a timestamp column comes back without its column type's zone on SQLite.
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


def take_turn(
    shard_id: int,
    *,
    settings: Settings,
    requeue: Callable[[int], None],
    worker: str | None = None,
) -> int:
    """The shard this task runs on `worker`; when it is another one, the task's own shard is
    sent again (before the other runs, so a crash never leaves it without a task)."""
    with session_scope(settings) as session:
        chosen = next_shard(
            session,
            shard_id,
            aging_seconds=settings.priority_aging_seconds,
            window_seconds=settings.fair_share_window_seconds,
            worker=worker,
        )
    if chosen != shard_id:
        requeue(shard_id)  # worker/shard_tasks.py: sent and marked dispatched
        log.info(
            "shard %s takes the turn of shard %s (priority, fair share of tokens, affinity)",
            chosen,
            shard_id,
        )
    return chosen


def backoff_left(shard_id: int, *, settings: Settings) -> float:
    """Seconds until a queued shard that failed may run again (0: it may run now)."""
    with session_scope(settings) as session:
        retry_at = _aware(
            session.scalar(
                select(Shard.retry_at).where(
                    Shard.id == shard_id, Shard.status == ShardStatus.QUEUED
                )
            )
        )
    return max(0.0, (retry_at - utcnow()).total_seconds()) if retry_at is not None else 0.0
