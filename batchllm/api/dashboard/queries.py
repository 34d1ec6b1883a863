"""What the dashboard's pages show, read from the database, the output parts and the worker
registry: plain dicts and lists the templates lay out."""

from __future__ import annotations

import itertools
import math
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchllm.api import batches, enqueued
from batchllm.api.dashboard.session import Viewer
from batchllm.execution.profile import EngineProfile
from batchllm.output import stream
from batchllm.settings import Settings
from batchllm.store.job_view import live_throughput
from batchllm.store.models import Batch, Checkpoint, Job, Shard, job_id_of
from batchllm.store.states import JobStatus, ShardStatus

PAGE_SIZE = 20
# The jobs page counts its jobs only so far (in steps of COUNT_STEP, past the page shown):
# counting every job of a long history on each refresh cost 74 ms on PostgreSQL and 0.2 s on
# SQLite at 100,000 batches. Pages past MAX_PAGE are the last's (the SQL's LIMIT stays an int64).
COUNT_STEP = 1000
MAX_PAGE = 10**12
PREVIEW_ROWS = 5
EXAMPLES_PER_REASON = 3
MAX_POINTS = 60  # the chart's points: enough to see a shape, few enough to read


def visible_jobs(viewer: Viewer) -> Any:
    """A SELECT of the jobs the viewer may see: an admin (or a local --no-auth server) every
    job, a key only its own batches."""
    query = select(Job)
    if not viewer.admin:
        query = query.join(Batch, Batch.job_id == Job.id).where(Batch.owner == viewer.owner)
    return query


def visible_job(session: Session, viewer: Viewer, job_id: str) -> Job | None:
    """The job by its id or its batch's (`batch_...`, as the Batch API shows it), or None alike
    when it does not exist and when the viewer may not see it."""
    return session.scalar(visible_jobs(viewer).where(Job.id == job_id_of(job_id)))


def job_page(
    session: Session, viewer: Viewer, *, status: str | None, model: str | None, page: int
) -> dict[str, Any]:
    """A page of the viewer's jobs, newest first, with the models to filter by. What it reads
    does not grow with the viewer's history (the page refreshes every two seconds): the jobs
    are counted only so far (`more`: there are more than `total`, which is then a lower
    bound), the models are read one index step each, and a key's page is read along its
    batches' (owner, created_at) index, in GET /v1/batches' order."""
    query = visible_jobs(viewer)
    models = sorted(model_names(session, viewer))
    if status:
        query = query.where(Job.status == JobStatus(status))
    if model:  # a batch's model is its job's, beside its owner in an index
        query = query.where(Job.model == model if viewer.admin else Batch.model == model)
    page = min(max(1, page), MAX_PAGE)
    # Counted to COUNT_STEP rows past the page at least, so that the next pages are known.
    reach = COUNT_STEP * (1 + page * PAGE_SIZE // COUNT_STEP)
    counted = session.scalar(
        select(func.count()).select_from(
            query.with_only_columns(Job.id).order_by(None).limit(reach + 1).subquery()
        )
    )
    more = (counted or 0) > reach
    total = min(counted or 0, reach)
    pages = max(1, math.ceil(total / PAGE_SIZE))
    page = min(page, pages)
    newest_first = (
        (Job.created_at.desc(), Job.id.desc())
        if viewer.admin
        else (Batch.created_at.desc(), Batch.job_id.desc())
    )
    rows = session.scalars(
        query.order_by(*newest_first).offset((page - 1) * PAGE_SIZE).limit(PAGE_SIZE)
    ).all()
    jobs = [job_summary(job) for job in rows]
    return {
        "jobs": jobs,
        "models": models,
        "page": page,
        "pages": pages,
        "total": total,
        "more": more,
        "running": any(not j["final"] for j in jobs),
    }


def model_names(session: Session, viewer: Viewer) -> list[str]:
    """The distinct models of the jobs the viewer may see, read one index step each (a loose
    index scan: the least model, then the least one greater, ...; jobs (model, created_at) for
    an admin, batches (owner, model, created_at) for a key), not from every job it ever ran."""
    column = Job.model if viewer.admin else Batch.model
    scope = [] if viewer.admin else [Batch.owner == viewer.owner]
    found = select(func.min(column).label("model")).where(*scope).cte("models", recursive=True)
    following = select(func.min(column)).where(*scope, column > found.c.model).scalar_subquery()
    found = found.union_all(select(following).where(found.c.model.is_not(None)))
    return list(session.scalars(select(found.c.model).where(found.c.model.is_not(None))))


def key_quota(session: Session, viewer: Viewer, settings: Settings) -> dict[str, Any]:
    """The viewer's key against its per-key quotas, counted as POST /v1/batches counts them:
    its request lines enqueued (BATCHLLM_API_MAX_ENQUEUED_ROWS), its enqueued prompt tokens
    per model (BATCHLLM_API_MAX_ENQUEUED_TOKENS or the key's own limit) and its unfinished
    batches (BATCHLLM_API_MAX_ACTIVE_BATCHES). An admin's are its own key's, whatever it is
    shown."""
    return {
        "enqueued_rows": enqueued.enqueued_rows(session, viewer.owner),
        "enqueued_tokens": enqueued.enqueued_tokens_by_model(session, viewer.owner),
        "enqueued_tokens_limit": enqueued.token_limit(session, viewer.owner, settings),
        "enqueued_rows_limit": settings.api_max_enqueued_rows,
        "active_batches": batches.active_batches(session, viewer.owner),
        "active_batches_limit": settings.api_max_active_batches,
    }


def job_summary(job: Job) -> dict[str, Any]:
    """One job's line: state, counts, rates (final or so far), times."""
    done = job.request_completed + job.request_failed
    total = job.request_total
    final = job.status.is_final
    rows_per_s, tokens_per_s = job.requests_per_s, job.output_tokens_per_s
    live = live_throughput(job)
    if live is not None:
        rows_per_s, tokens_per_s = live["requests_per_s"], live["output_tokens_per_s"]
    duration = eta = None
    if job.started_at is not None:
        end = job.finished_at or datetime.now(timezone.utc)
        duration = (end - job.started_at).total_seconds()
    if not final and rows_per_s and total > done:
        eta = (total - done) / rows_per_s
    return {
        "id": job.id,
        "status": job.status.value,
        "final": final,
        "model": job.model,
        "total": total,
        "ok": job.request_completed,
        "failed": job.request_failed,
        "done": done,
        "ok_pct": 100.0 * job.request_completed / total if total else 0.0,
        "failed_pct": 100.0 * job.request_failed / total if total else 0.0,
        "rows_per_s": rows_per_s,
        "tokens_per_s": tokens_per_s,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "duration": duration,
        "eta": eta,
    }


def series(session: Session, job: Job) -> list[dict[str, float]]:
    """Rows/s and output tok/s over the job's run, from its checkpoints' commit times. Each
    point is the average rate since the point before, and points are at least `width` apart:
    fixed buckets about as wide as the commit period would alternate full and empty, and the
    rate between two workers' commits a moment apart would spike. Each point: seconds since
    the start, rows/s and tok/s."""
    commits = session.execute(
        select(Checkpoint.created_at, Checkpoint.rows, Checkpoint.completion_tokens)
        .join(Shard)
        .where(Shard.job_id == job.id)
        .order_by(Checkpoint.created_at)
    ).all()
    if not commits:
        return []
    start = min(job.started_at or commits[0][0], commits[0][0])
    span = (commits[-1][0] - start).total_seconds()
    width = max(2.0, span / MAX_POINTS)
    anchors = [(0.0, 0, 0)]  # (seconds, rows so far, tokens so far)
    rows = tokens = 0
    for at, n, completion in commits:
        rows, tokens = rows + n, tokens + completion
        seconds = (at - start).total_seconds()
        if seconds - anchors[-1][0] >= width:
            anchors.append((seconds, rows, tokens))
    if anchors[-1][1] != rows:  # the last commits, too close to the last point for their own
        if span - anchors[-1][0] < width / 2 and len(anchors) > 1:
            anchors.pop()
        anchors.append((span, rows, tokens))
    return [
        {
            "t": round(t, 2),
            "rows_per_s": round((r - r0) / max(t - t0, 1e-3), 3),
            "tokens_per_s": round((k - k0) / max(t - t0, 1e-3), 2),
        }
        for (t0, r0, k0), (t, r, k) in itertools.pairwise(anchors)
    ]


def shards_of(job: Job, now: datetime) -> list[dict[str, Any]]:
    return [
        {
            "index": s.index,
            "status": s.status.value,
            "worker": s.worker,
            "attempts": s.attempts,
            "rows": s.rows,
            "done": s.rows_ok + s.rows_failed,
            "failed": s.rows_failed,
            "pct": 100.0 * (s.rows_ok + s.rows_failed) / s.rows if s.rows else 0.0,
            "heartbeat_age": (now - s.heartbeat_at).total_seconds()
            if s.heartbeat_at and s.status is ShardStatus.RUNNING
            else None,
            "error": s.error,
        }
        for s in job.shards
    ]


def output_glance(
    settings: Settings, job: Job
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first committed rows, and the error rows grouped by reason (code) with a few
    example lines each. Only the error columns are read for the errors, and only when the
    job has error rows."""
    rows: list[dict[str, Any]] = []
    columns = ["line", "custom_id", "status", "text", "finish_reason", "completion_tokens"]
    # The first parts in name order hold the first shard's first rows; a part may be small
    # (a commit every few seconds), so read parts until there are enough.
    for batch in stream.iter_committed_batches(settings, job.id, columns=columns):
        rows.extend(batch.to_pylist())
        if len(rows) >= PREVIEW_ROWS:
            break
    preview = sorted(rows, key=lambda r: r["line"])[:PREVIEW_ROWS]
    reasons: dict[str, dict[str, Any]] = {}
    if job.request_failed:
        wanted = ["line", "custom_id", "status", "error", "error_code"]
        for batch in stream.iter_committed_batches(settings, job.id, columns=wanted):
            for row in batch.to_pylist():
                if row["status"] == "ok":
                    continue
                code = row["error_code"] or "error"
                group = reasons.setdefault(code, {"code": code, "count": 0, "examples": []})
                group["count"] += 1
                if len(group["examples"]) < EXAMPLES_PER_REASON:
                    group["examples"].append(row)
    grouped = sorted(reasons.values(), key=lambda g: -g["count"])
    return preview, grouped


def worker_rows(
    registered: list[dict[str, Any]],
    shards: list[dict[str, Any]],
    *,
    now: float,
    lease_seconds: float,
) -> list[dict[str, Any]]:
    """One row per worker: those registered (live keys in the broker) and those a running
    shard names. A worker is silent when its running shard's heartbeat is older than the lease
    (the fleet's own rule for a dead worker), or when it holds a running shard and is no longer
    registered. `shards`: {worker, job_id, index, done, started_at, heartbeat_at} of running
    shards, times in epoch seconds."""
    by_node: dict[str, dict[str, Any]] = {}
    for worker in registered:
        node = str(worker.get("node"))
        by_node[node] = {
            "node": node,
            "host": worker.get("host"),
            "models": worker.get("models") or [],
            "engine": worker.get("engine"),
            "registered": True,
            "seen_at": worker.get("seen_at"),
            "shards": [],
        }
    for shard in shards:
        node = shard["worker"]
        row = by_node.setdefault(
            node,
            {
                "node": node,
                "host": None,
                "models": [shard.get("model")],
                "engine": None,
                "registered": False,
                "seen_at": None,
                "shards": [],
            },
        )
        row["shards"].append(shard)
    rows = []
    for row in by_node.values():
        beats = [s["heartbeat_at"] for s in row["shards"] if s["heartbeat_at"]]
        if row["seen_at"]:
            beats.append(row["seen_at"])
        last = max(beats) if beats else None
        stale = [
            s
            for s in row["shards"]
            if s["heartbeat_at"] is None or now - s["heartbeat_at"] > lease_seconds
        ]
        silent = bool(stale) or (bool(row["shards"]) and not row["registered"])
        rate = sum(
            s["done"] / max(now - s["started_at"], 1e-3) for s in row["shards"] if s["started_at"]
        )
        engine = row["engine"]
        rows.append(
            {
                **row,
                # A worker without a profile builds an engine for each job's settings.
                "engine_text": EngineProfile.from_dict(engine).describe() if engine else "per job",
                "last_beat": last,
                "last_beat_age": now - last if last else None,
                "silent": silent,
                "rows_per_s": rate if row["shards"] else None,
            }
        )
    return sorted(rows, key=lambda r: (r["silent"], r["node"]))


def node_name(node: str | None) -> str | None:
    """A worker's Celery node name (NAME@HOST) without its host, as a key that is not an
    admin sees it."""
    return None if node is None else node.partition("@")[0] or "worker"


def without_hosts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workers page's rows as a key that is not an admin sees them: no hosts. Their
    models are those /v1/models lists to every key."""
    return [{**row, "node": node_name(row["node"]), "host": None} for row in rows]


def running_shards(session: Session) -> list[dict[str, Any]]:
    """Every running shard with its worker, for the workers page."""
    found = session.execute(
        select(Shard, Job.model)
        .join(Job)
        .where(Shard.status == ShardStatus.RUNNING, Shard.worker.is_not(None))
    ).all()
    return [
        {
            "worker": shard.worker,
            "job_id": shard.job_id,
            "index": shard.index,
            "model": model,
            "done": shard.rows_ok + shard.rows_failed,
            "rows": shard.rows,
            "attempts": shard.attempts,
            "started_at": shard.started_at.timestamp() if shard.started_at else None,
            "heartbeat_at": shard.heartbeat_at.timestamp() if shard.heartbeat_at else None,
        }
        for shard, model in found
    ]
