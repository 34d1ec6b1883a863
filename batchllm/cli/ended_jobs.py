"""Commands on an ended job: `batchllm retry` runs again what did not succeed, into the same
job; `batchllm export` writes its results in another format (OpenAI batch files for now)."""

from __future__ import annotations

from pathlib import Path

import click

from batchllm.cli import cli
from batchllm.cli.engine_flags import choice_option


@cli.command()
@click.argument("job_id")
@click.option(
    "--all-errors",
    is_flag=True,
    help="Retry every error row, also invalid requests and prompts too long for the context "
    "(by default only lines without an answer and the engine's failures).",
)
@click.option("--wait", "wait_", is_flag=True, help="Follow a fleet job's retry to its end.")
def retry(job_id: str, all_errors: bool, wait_: bool) -> None:
    """Run again, as a new attempt of the same job, the lines of an ended job (completed,
    failed, cancelled or expired) that did not succeed. The new rows replace the old ones: the
    output keeps one row per input line. A job `batchllm run` created is retried in this
    process; one `batchllm submit` created goes back to the fleet.

    \b
    Example:
      batchllm retry job_3f2a9c1e                 # lines never run, engine failures
      batchllm retry job_3f2a9c1e --all-errors    # every error row
    """
    from batchllm.cli.fleet import follow_job
    from batchllm.cli.render import echo_job, job_row
    from batchllm.client import Client

    def started(lines: int, missing: int) -> None:
        click.echo(f"retrying {lines:,} line(s) of {job_id} ({missing:,} never answered)", err=True)

    job = Client().retry(job_id, all_errors=all_errors, on_started=started)
    if not job.done:
        click.echo(f"{job.id}: attempt {len(job.attempts)} {job.status} on the fleet", err=True)
        if wait_:
            follow_job(job.id)
        return
    echo_job(job_row(job.id))
    if job.status != "completed":
        raise SystemExit(1)


@cli.command()
@click.argument("job_id")
@click.option(
    "--output",
    "-o",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    metavar="DIR",
    required=True,
    help="Directory for the files (created if missing).",
)
@choice_option(
    "--format",
    "fmt",
    choices=["openai"],
    default="openai",
    help="openai: output.jsonl and errors.jsonl as the OpenAI Batch API writes them.",
)
@click.option("--force", is_flag=True, help="Replace output.jsonl/errors.jsonl already in DIR.")
def export(job_id: str, out_dir: Path, fmt: str, force: bool) -> None:
    """Write a finished job's rows as OpenAI batch files: ok rows to output.jsonl, error rows
    to errors.jsonl, each in input line order (JOB_ID may be a unique prefix). The job must
    have ended (completed, cancelled or failed).

    \b
    Example:
      batchllm export job_3f2a -o results/
    """
    from batchllm.output.openai_files import export_openai
    from batchllm.settings import get_settings
    from batchllm.store import service
    from batchllm.store.db import session_scope

    settings = get_settings()
    with session_scope(settings) as session:
        job = service.get_job(session, job_id)
    try:
        counts = export_openai(job, out_dir, settings=settings, overwrite=force)
    except FileExistsError as exc:
        raise click.ClickException(f"{exc}; pass --force to replace it") from None
    click.echo(f"{counts.output_path}  {counts.output:,} lines")
    click.echo(f"{counts.errors_path}  {counts.errors:,} lines")
    if counts.not_run:
        click.echo(f"{counts.not_run:,} input lines never ran (job {job.status.value})", err=True)
