"""How jobs look on the terminal and in --json."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import click

from batchllm.store.models import Job

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


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def job_dict(job: Job, *, shards: bool = False) -> dict[str, Any]:
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
        "throughput": {name: getattr(job, name) for name in THROUGHPUT_FIELDS},
        "throughput_so_far": live_throughput(job),
        "max_model_len": job.max_model_len,
        "metadata": job.job_metadata,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "error": job.error,
    }
    if shards:
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
                "worker": s.worker,
                "error": s.error,
            }
            for s in job.shards
        ]
    return data


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


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def job_row(job_ref: str) -> Job:
    """The job's database row, which the renderers here show in full (the Client's Job holds
    what a program needs: state, counts, output, throughput)."""
    from batchllm.store import service
    from batchllm.store.db import session_scope

    with session_scope() as session:
        return service.get_job(session, job_ref)


def echo_job(job: Job) -> None:
    done = job.request_completed + job.request_failed
    click.echo(f"job        {job.id}")
    click.echo(f"status     {job.status.value}")
    click.echo(f"model      {job.model}")
    click.echo(
        f"requests   {done:,}/{job.request_total:,} done: {job.request_completed:,} ok, "
        f"{job.request_failed:,} error"
    )
    if job.structured_rows:
        click.echo(
            f"structured {job.structured_valid:,}/{job.structured_rows:,} constrained rows "
            "satisfy their constraint"
        )
    click.echo(f"output     {job.output_dir}")
    live = live_throughput(job)
    if live:
        click.echo(
            f"so far     {live['requests_per_s']:,.2f} req/s, "
            f"{live['output_tokens_per_s']:,.1f} output tok/s over "
            f"{live['elapsed_seconds']:,.0f} s"
        )
    if (job.spec or {}).get("engine", {}).get("task") == "embed":
        # Nothing is generated: an embedding job's pace is its inputs.
        click.echo(
            f"throughput {fmt(job.requests_per_s, 2)} req/s, "
            f"{fmt(job.total_tokens_per_s)} input tok/s"
        )
    else:
        click.echo(
            f"throughput {fmt(job.requests_per_s, 2)} req/s, "
            f"{fmt(job.output_tokens_per_s)} output tok/s, "
            f"{fmt(job.total_tokens_per_s)} total tok/s"
        )
    click.echo(
        f"tokens     {job.prompt_tokens:,} prompt, {job.completion_tokens:,} completion; "
        f"engine {fmt(job.engine_seconds)} s, wall {fmt(job.wall_seconds)} s"
    )
    if job.hardware:
        click.echo(f"hardware   {job.hardware}, vLLM {job.vllm_version}")
    if job.error:
        click.echo(f"error      {job.error}")


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
