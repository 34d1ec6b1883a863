"""The fleet: `submit`, `worker`, `wait`, `cancel` (Celery over Redis)."""

from __future__ import annotations

import click

from batchllm.cli import cli


@cli.command()
@click.argument("job_id")
def cancel(job_id: str) -> None:
    """Cancel a job: in-flight requests are aborted, rows already done are kept."""
    from batchllm.jobs import service
    from batchllm.jobs.db import session_scope

    with session_scope() as session:
        job = service.cancel_job(session, job_id)
        click.echo(f"{job.id}: {job.status.value}")
