"""How jobs look on the terminal and in --json."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from batchllm.store.job_view import attempts_of, live_throughput
from batchllm.store.models import Job

if TYPE_CHECKING:
    from batchllm.jobs.estimate import Estimate


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def job_row(job_ref: str) -> Job:
    """The job's database row, which the renderers here show in full (the Client's Job holds
    what a program needs: state, counts, output, throughput)."""
    from batchllm.settings import get_settings
    from batchllm.store import service
    from batchllm.store.db import session_scope

    with session_scope(get_settings()) as session:
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
    if (job.spec or {}).get("engine", {}).get("task") in ("embed", "classify"):
        # Nothing is generated: a pooling job's pace is its inputs.
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
    cached = ""
    if job.prompt_tokens and job.cached_tokens:
        cached = f" ({job.cached_tokens / job.prompt_tokens:.0%} from the prefix cache)"
    click.echo(
        f"tokens     {job.prompt_tokens:,} prompt{cached}, {job.completion_tokens:,} "
        f"completion; engine {fmt(job.engine_seconds)} s, wall {fmt(job.wall_seconds)} s"
    )
    if job.hardware:
        click.echo(f"hardware   {job.hardware}, vLLM {job.vllm_version}")
    if job.attempts:  # retried: each run and the lines it ran
        for run in attempts_of(job):
            which = "all error rows" if run["all_errors"] else "lines"
            click.echo(
                f"attempt {run['attempt']:<2} {run['lines']:,} {which}, {run['status']}, "
                f"wall {fmt(run['wall_seconds'])} s"
            )
    if job.error:
        click.echo(f"error      {job.error}")


def echo_estimate(estimate: Estimate, model: str) -> None:
    """A --dry-run's figures; nothing was created."""
    refused = estimate.invalid + estimate.too_long
    click.echo(f"requests       {estimate.requests:,}", nl=not refused)
    if refused:
        click.echo(
            f" ({estimate.invalid:,} invalid, {estimate.too_long:,} over the model's context: "
            "they would become error rows)"
        )
    click.echo(f"prompt tokens  {estimate.prompt_tokens:,} (counted with the model's tokenizer)")
    click.echo(
        f"output tokens  at most {estimate.max_output_tokens:,} (every request's max_tokens; "
        "most stop earlier)"
    )
    seconds, history = estimate.max_wall_seconds, estimate.history
    if seconds is None or history is None:
        click.echo(
            f"time           unknown: no completed job of {model} on {estimate.hardware} to go by"
        )
    else:
        click.echo(
            f"time           at most {_duration(seconds)} at {history.tokens_per_s:,.0f} tok/s, "
            f"the throughput of {history.jobs} earlier job(s) of this model on "
            f"{estimate.hardware}"
        )
    click.echo("dry run: no job was created and no engine started", err=True)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
