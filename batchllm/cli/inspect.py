"""Looking at jobs: `status`, `jobs`, `results`; and `delete`."""

from __future__ import annotations

import json
import os
import sys

import click

from batchllm.cli import cli
from batchllm.cli.engine_flags import choice_option, count_option
from batchllm.store.states import JobStatus

_STATUSES = [status.value for status in JobStatus]


@cli.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the job as JSON.")
def status(job_id: str, as_json: bool) -> None:
    """Show a job: state, request counts, throughput, shards (JOB_ID may be a unique prefix)."""
    from batchllm.cli.render import echo_job, table
    from batchllm.settings import get_settings
    from batchllm.store import service
    from batchllm.store.db import session_scope
    from batchllm.store.job_view import job_view

    with session_scope(get_settings()) as session:
        job = service.get_job(session, job_id)
        data = job_view(job, shards=True)
        waiting = _waiting_for_a_worker(job)
        if waiting:
            data["waiting"] = waiting
        if as_json:
            click.echo(json.dumps(data, indent=2))
            return
        echo_job(job)
    if waiting:
        click.echo(f"waiting: {waiting}")
    if data["parents"]:
        click.echo(f"from       {', '.join(data['parents'])} (its rows are this job's input)")
    if data["after"]:
        click.echo(f"after      {', '.join(data['after'])} (it starts when they completed)")
    if data["children"]:
        click.echo(f"children   {', '.join(data['children'])} (jobs reading its rows or after it)")
    if len(data["shards"]) > 1 or any(s["attempts"] > 1 for s in data["shards"]):
        rows = [
            [
                str(s["index"]),
                s["status"],
                f"{s['ok'] + s['failed']:,}/{s['rows']:,}",
                str(s["attempts"]),
                s["worker"] or "-",
            ]
            for s in data["shards"]
        ]
        click.echo(table(["shard", "status", "done", "attempts", "worker"], rows))
    for shard in data["shards"]:
        if shard["failures"]:  # runs that failed as a whole (execution/shard_failures.py)
            click.echo(
                f"shard {shard['index']}: {shard['failures']} failed run(s); last: {shard['error']}"
            )
    if "webhook" in data:
        _echo_webhook(data["webhook"])


def _echo_webhook(webhook: dict) -> None:
    from batchllm.cli.render import table

    attempts = webhook["attempts"]
    state = "delivered" if webhook["delivered"] else ("pending" if not attempts else "retrying")
    click.echo(f"webhook    {webhook['url']}: {state}")
    if attempts:
        rows = [
            [
                str(a["attempt"]),
                a["event"],
                str(a["status_code"] or "-"),
                a["error"] or "ok",
                a["at"] or "-",
            ]
            for a in attempts
        ]
        click.echo(table(["attempt", "event", "status", "result", "at"], rows))


def _waiting_for_a_worker(job) -> str | None:
    """Why a fleet job that no worker has started yet waits, from the live workers' engine
    profiles (None when one can run it, or the broker cannot say)."""
    if job.local_run or job.status is not JobStatus.QUEUED:
        return None
    from batchllm.settings import get_settings
    from batchllm.spec import JobSpec
    from batchllm.worker.redis_broker import is_redis
    from batchllm.worker.registry import live_workers, waiting_reason

    broker_url = get_settings().broker_url
    if not is_redis(broker_url):  # only a Redis broker holds the workers' profiles
        return None
    try:
        workers = live_workers(broker_url)
    except Exception as exc:  # the broker is down: status still shows the job
        return f"unknown: the broker cannot be read ({exc})"
    return waiting_reason(JobSpec.model_validate(job.spec), workers)


@cli.command()
@choice_option("--status", "status_filter", choices=_STATUSES, help="Only jobs in this state.")
@count_option("--limit", default=20)
def jobs(status_filter: str | None, limit: int) -> None:
    """List recent jobs with their throughput."""
    from batchllm.cli.render import fmt, table
    from batchllm.settings import get_settings
    from batchllm.store import service
    from batchllm.store.db import session_scope

    with session_scope(get_settings()) as session:
        found = service.list_jobs(
            session, status=JobStatus(status_filter) if status_filter else None, limit=limit
        )
        rows = [
            [
                j.id,
                j.status.value,
                j.created_at.strftime("%Y-%m-%d %H:%M"),
                f"{j.request_completed + j.request_failed:,}/{j.request_total:,}",
                f"{j.request_failed:,}",
                fmt(j.output_tokens_per_s),
                fmt(j.wall_seconds),
                j.model[-30:],
            ]
            for j in found
        ]
    if not rows:
        click.echo("no jobs")
        return
    click.echo(
        table(["job", "status", "created", "done", "errors", "out tok/s", "wall s", "model"], rows)
    )


@cli.command()
@click.argument("job_id")
@count_option("--head", help="Print the first N rows (in line order) instead of the location.")
@click.option(
    "--partial",
    is_flag=True,
    help="Print the rows committed so far as JSON lines (one row per line), also while the "
    "job runs.",
)
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="As --partial, then keep printing rows as they are committed until the job ends.",
)
@click.option(
    "--columns",
    default=None,
    help="With --partial/--follow: only these comma-separated columns (e.g. custom_id,text).",
)
def results(
    job_id: str, head: int | None, partial: bool, follow: bool, columns: str | None
) -> None:
    """Print where a job's Parquet results are, show its first rows, or stream its rows as
    JSON lines. Rows committed so far are readable while the job still runs.

    \b
    Examples:
      batchllm results job_3f2a                      # the output directory
      batchllm results job_3f2a --head 5             # a table of the first rows
      batchllm results job_3f2a --partial > rows.jsonl
      batchllm results job_3f2a --follow --columns custom_id,text | jq .text
    """
    from batchllm.client import Client

    client = Client()
    if partial or follow:
        if head is not None:
            raise click.UsageError("--head shows a table; --partial/--follow print JSON lines")
        wanted = [c.strip() for c in columns.split(",") if c.strip()] if columns else None
        _print_json_lines(client, job_id, follow=follow, columns=wanted)
        return
    if columns is not None:
        raise click.UsageError("--columns goes with --partial or --follow")
    if head is None:
        click.echo(client.status(job_id).output_dir)
        return
    _print_head(client, job_id, head)


def _print_json_lines(client, job_id: str, *, follow: bool, columns: list[str] | None) -> None:
    out = sys.stdout
    try:
        for batch in client.iter_result_batches(job_id, follow=follow, columns=columns):
            out.write("".join(json.dumps(row, default=str) + "\n" for row in batch.to_pylist()))
            out.flush()  # a reader down the pipe sees each batch as it is committed
    except BrokenPipeError:
        # The reader stopped early (`| head`): not an error. Python would complain again
        # when it flushes stdout at exit, so point stdout at nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())


def _print_head(client, job_id: str, head: int) -> None:
    from batchllm.cli.render import table as render_table

    table = client.results(job_id).to_table().sort_by("line").slice(0, head)

    rows = []
    for row in table.to_pylist():
        shown = row["text"] if row["status"] == "ok" else row["error"]
        shown = (shown or "").replace("\n", " ")
        rows.append(
            [
                str(row["line"]),
                row["custom_id"][:24],
                row["status"],
                str(row["completion_tokens"] or 0),
                shown[:60],
            ]
        )
    click.echo(render_table(["line", "custom_id", "status", "tokens", "text / error"], rows))


@cli.command()
@click.argument("job_id")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking.")
def delete(job_id: str, yes: bool) -> None:
    """Delete an ended job for good: its rows in the database and its files in the job
    storage (input, output, adapters, Batch API result files). A queued or running job is
    refused: cancel it first.

    \b
    Examples:
      batchllm delete job_3f2a
      batchllm delete job_3f2a --yes
    """
    from batchllm.client import Client
    from batchllm.output.deletion import not_deletable

    client = Client()
    job = client.status(job_id)
    if not job.done:  # refused before asking
        raise not_deletable(job.id, job.status)
    if not yes:
        click.confirm(
            f"delete job {job.id} ({job.status}, {job.completed + job.failed:,} rows) and "
            f"its files in {job.output_dir.rsplit('/', 1)[0]}?",
            abort=True,
        )
    removed = client.delete(job.id)
    click.echo(f"{job.id}: deleted ({len(removed)} location(s) removed)")
