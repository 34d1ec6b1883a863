"""`batchllm retry`: run again what did not succeed, into the same job."""

from __future__ import annotations

import click

from batchllm.cli import cli


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
    from batchllm.cli.fleet import _follow
    from batchllm.cli.render import echo_job, job_row
    from batchllm.client import Client

    def started(lines: int, missing: int) -> None:
        click.echo(f"retrying {lines:,} line(s) of {job_id} ({missing:,} never answered)", err=True)

    job = Client().retry(job_id, all_errors=all_errors, on_started=started)
    if not job.done:
        click.echo(f"{job.id}: attempt {len(job.attempts)} {job.status} on the fleet", err=True)
        if wait_:
            _follow(job.id)
        return
    echo_job(job_row(job.id))
    if job.status != "completed":
        raise SystemExit(1)
