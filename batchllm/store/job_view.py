"""One job as a dict: the view `batchllm status --json` prints, from which the Client's Job and
the output manifest take their figures, each in the shape its readers already know (client.Job,
execution/finalize.manifest_of). The Batch API's batch object is OpenAI's shape (api/objects.py)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from batchllm.store.models import Job, JobParent

THROUGHPUT_FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "engine_seconds",
    "wall_seconds",
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "hardware",
    "vllm_version",
)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _links(job: Job, kind: str) -> list[str]:
    return [link.parent_id for link in job.parent_links if link.kind == kind]


def children_of(job: Job) -> list[str]:
    """The jobs that read this one's rows (`--from`) or run after it (`--after`), oldest
    first; the job is in a session."""
    from sqlalchemy import select
    from sqlalchemy.orm import object_session

    session = object_session(job)
    if session is None:
        return []
    query = (
        select(JobParent.child_id)
        .join(Job, Job.id == JobParent.child_id)
        .where(JobParent.parent_id == job.id)
        .order_by(Job.created_at)
    )
    return list(session.scalars(query))


def job_view(job: Job, *, shards: bool = False) -> dict[str, Any]:
    """The job's state, counts, throughput and times (with `shards`, each shard's too, its
    webhook's attempts, its parents and children: the job must be in a session then)."""
    data: dict[str, Any] = {
        "id": job.id,
        "status": job.status.value,
        "model": job.model,
        "input_file": job.input_file,
        "output_dir": job.output_dir,
        "request_counts": {
            "total": job.request_total,
            "completed": job.request_completed,
            "failed": job.request_failed,
        },
        "structured": {"rows": job.structured_rows, "valid": job.structured_valid},
        "progress": (job.request_completed + job.request_failed) / job.request_total
        if job.request_total
        else 0.0,
        "throughput": {
            **{name: getattr(job, name) for name in THROUGHPUT_FIELDS},
            "cached_tokens": job.cached_tokens or 0,
            "prefix_cache_hit_rate": prefix_cache_hit_rate(job),
        },
        "throughput_so_far": live_throughput(job),
        "usage": usage(job),
        "max_model_len": job.max_model_len,
        "metadata": job.job_metadata,
        "priority": (job.spec or {}).get("priority", "normal"),
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "error": job.error,
        "attempts": attempts_of(job),
        "parents": _links(job, "from") if shards else None,
        "after": _links(job, "after") if shards else None,
    }
    if shards:
        data["children"] = children_of(job)
        data["shards"] = [
            {
                "index": s.index,
                "status": s.status.value,
                "rows": s.rows,
                "ok": s.rows_ok,
                "failed": s.rows_failed,
                "completion_tokens": s.completion_tokens,
                "engine_seconds": s.engine_seconds,
                "attempts": s.attempts,
                "failures": s.failures,
                "worker": s.worker,
                "error": s.error,
            }
            for s in job.shards
        ]
        if job.notify_url:
            data["webhook"] = webhook_view(job)
    return data


def prefix_cache_hit_rate(job: Job) -> float | None:
    """The share of the job's prompt tokens vLLM served from its prefix cache (None before a
    prompt token was counted): what ordering rows by shared prefix earns."""
    if not job.prompt_tokens:
        return None
    return min((job.cached_tokens or 0) / job.prompt_tokens, 1.0)


def usage(job: Job) -> dict[str, Any]:
    """The job's tokens in OpenAI's Batch.usage shape (the Batch API object carries it too)."""
    return {
        "input_tokens": job.prompt_tokens,
        # vLLM's prefix-cache hits (RequestOutput.num_cached_tokens) over every run of a row:
        # a retried row's earlier hits stay counted, as billed usage would.
        "input_tokens_details": {"cached_tokens": job.cached_tokens or 0},
        "output_tokens": job.completion_tokens,
        # The output of a reasoning model is counted as completion tokens, not split out.
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }


def webhook_view(job: Job) -> dict[str, Any]:
    """Where the job's end is announced and every attempt so far (never the secret)."""
    attempts = job.webhook_attempts
    return {
        "url": job.notify_url,
        "delivered": any(a.delivered for a in attempts),
        "attempts": [
            {
                "attempt": a.attempt,
                "event": a.event,
                "status_code": a.status_code,
                "error": a.error,
                "delivered": a.delivered,
                "at": _iso(a.created_at),
            }
            for a in attempts
        ],
    }


def attempts_of(job: Job) -> list[dict[str, Any]]:
    """The job's runs: its first, then each `batchllm retry`, with how many lines each ran;
    the current (last) one in the job's own state until it ends."""
    if not job.attempts:
        return [
            {
                "attempt": 1,
                "lines": job.request_total,
                "all_errors": False,
                "status": job.status.value,
                "started_at": _iso(job.started_at),
                "finished_at": _iso(job.finished_at),
                "wall_seconds": job.wall_seconds,
            }
        ]
    runs = [dict(run) for run in job.attempts]
    if runs[-1]["status"] is None or not job.status.is_final:
        runs[-1]["status"] = job.status.value
    return runs


def live_throughput(job: Job) -> dict[str, float] | None:
    """Rates of a running job from its checkpoints so far (final rates are in `throughput`)."""
    if job.status.is_final or job.started_at is None:
        return None
    now = datetime.now(timezone.utc)
    elapsed = max((now - job.started_at).total_seconds(), 1e-9)
    done = job.request_completed + job.request_failed
    return {
        "elapsed_seconds": elapsed,
        "requests_per_s": done / elapsed,
        "output_tokens_per_s": job.completion_tokens / elapsed,
    }
