"""The fleet: `submit`, `worker`, `wait`, `cancel` (Celery workers over Redis)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import click

from batchllm.cli import cli
from batchllm.cli.options import input_file, job_options, require_requests, spec_from_flags


@cli.command()
@input_file
@job_options
@click.option(
    "--shard-size",
    type=click.IntRange(min=1),
    default=None,
    help="Rows per shard [default: BATCHLLM_SHARD_SIZE, 10000].",
)
@click.option("--wait", "wait_", is_flag=True, help="Follow the job with a progress bar.")
def submit(file: str | Path, strict: bool, shard_size: int | None, wait_: bool, **flags) -> None:
    """Validate FILE (JSONL: a local path or an s3:// URI), queue it for the worker fleet and
    print the job id.

    \b
    Example:
      batchllm submit prompts.jsonl --model meta-llama/Llama-3.1-8B-Instruct --metadata team=search
    """
    from batchllm.client import Client

    spec = spec_from_flags(flags, file)
    require_requests(file)
    job = Client().submit_spec(file, spec, shard_size=shard_size, strict=strict)
    click.echo(job.id)
    click.echo(f"{_counts(job.total, job.invalid or 0)} in {job.shards} shard(s), queued", err=True)
    if wait_:
        _follow(job.id)


def _counts(total: int, invalid: int) -> str:
    if not invalid:
        return f"{total:,} requests"
    return (
        f"{total:,} requests: {total - invalid:,} valid, {invalid:,} invalid "
        "(they become error rows)"
    )


@cli.command()
@click.argument("job_id")
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds.")
def wait(job_id: str, timeout: float | None) -> None:
    """Follow a job until it ends; exit 0 if it completed, 1 otherwise."""
    _follow(job_id, timeout)


def _follow(job_ref: str, timeout: float | None = None) -> None:
    from batchllm.cli.progress import Progress
    from batchllm.cli.render import echo_job, job_row
    from batchllm.client import Client, Job

    progress: list[Progress] = []

    def show(job: Job) -> None:
        if not progress:
            progress.append(Progress(job.total))
        progress[0].set(job.completed + job.failed, job.throughput["completion_tokens"])

    try:
        ended = Client().wait(job_ref, timeout=timeout, poll=1.0, on_poll=show)
    except TimeoutError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if progress:
            progress[0].close()
    echo_job(job_row(ended.id))
    if ended.status != "completed":
        raise SystemExit(1)


@cli.command()
@click.argument("job_id")
def cancel(job_id: str) -> None:
    """Cancel a job: in-flight requests are aborted within seconds, finished rows are kept."""
    from batchllm.client import Client

    job = Client().cancel(job_id)
    click.echo(f"{job.id}: {job.status}")


@cli.command()
@click.option(
    "--model",
    "-m",
    "models",
    multiple=True,
    help="Serve this model (repeatable): consume its queue.",
)
@click.option("--queues", "-Q", default=None, help="Extra comma-separated queue names.")
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes, one engine each (one per GPU: process i sees GPU i).",
)
@click.option(
    "--name",
    "-n",
    default=None,
    help="Worker name, unique in the fleet [default: batchllm-PID@host].",
)
@click.option("--loglevel", "-l", default="INFO", show_default=True)
@click.option(
    "--max-lora-rank",
    type=click.IntRange(min=1),
    default=None,
    help="Build LoRA engines for at least this adapter rank, so jobs with adapters of "
    "different ranks share one warm engine (adapters come with each job; no restart).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    envvar="BATCHLLM_METRICS_PORT",
    show_envvar=True,
    help="Serve Prometheus metrics at http://0.0.0.0:PORT/metrics. With --concurrency N, "
    "worker process i serves its own on PORT+i (scrape all N ports).",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    envvar="BATCHLLM_LOG_FORMAT",  # so --concurrency's child processes inherit the choice
    help="json: one object per line (time, level, logger, message, job_id, shard_id) for "
    "log shippers.",
)
def worker(
    models: tuple[str, ...],
    queues: str | None,
    concurrency: int,
    name: str | None,
    loglevel: str,
    max_lora_rank: int | None,
    metrics_port: int | None,
    log_format: str,
) -> None:
    """Start a Celery worker that runs shards through vLLM (broker: BATCHLLM_BROKER_URL).

    Each process uses Celery's solo pool: vLLM starts its engine in a child process, which
    prefork children are not allowed to have. The engine stays warm across shards and jobs.

    \b
    Example:
      batchllm worker --model meta-llama/Llama-3.1-8B-Instruct --concurrency 8 --metrics-port 9400
    """
    if not models and not (queues or "").strip(","):
        raise click.UsageError("give --model (or --queues) so the worker knows what to serve")
    from batchllm.worker.stopping import stop_with_parent

    stop_with_parent()
    verbose = click.get_current_context().find_root().params.get("verbose") or 0
    os.environ["BATCHLLM_LOG_FORMAT"] = log_format  # the Celery process and children read it
    if concurrency == 1 and not verbose:
        # Before Celery and vLLM are imported, so their import-time warnings go to the file
        # too. With --concurrency N each worker process names its own file.
        _quiet_console(log_format)
    from batchllm.worker.celery_app import queue_for_model

    names = [queue_for_model(m) for m in models] + [q for q in (queues or "").split(",") if q]
    # The models this worker announces to `batchllm serve` (GET /v1/models); children inherit.
    os.environ["BATCHLLM_WORKER_MODELS"] = json.dumps(list(models))
    if max_lora_rank is not None:  # read by this process's settings and its children's
        os.environ["BATCHLLM_MIN_LORA_RANK"] = str(max_lora_rank)
    if metrics_port is not None and metrics_port + concurrency - 1 > 65535:
        raise click.BadParameter(
            f"{metrics_port} + {concurrency - 1} is past 65535: each worker process serves its "
            "metrics on the next port",
            param_hint="'--metrics-port'",
        )
    if concurrency > 1:
        from batchllm.engine.hardware import runs_on_cpu, visible_gpus
        from batchllm.engine.preflight import check_worker_concurrency

        on_cpu = runs_on_cpu()
        gpus = [] if on_cpu else visible_gpus()
        check_worker_concurrency(concurrency, is_cpu=on_cpu, gpus=gpus)
        _supervise(concurrency, models, queues, name, loglevel, metrics_port, verbose)
        return
    if metrics_port is not None:
        _serve_metrics(metrics_port)
    from batchllm.worker.celery_app import create_app

    app = create_app()
    node = name or f"batchllm-{os.getpid()}@{socket.gethostname()}"
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            "--concurrency=1",
            "-Q",
            ",".join(names),
            "-n",
            node,
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
        ]
    )


def _serve_metrics(port: int) -> None:
    """This process's Prometheus registry on PORT, or a clear error when the port is taken."""
    from batchllm.worker.metrics import start_metrics_server

    try:
        start_metrics_server(port)
    except OSError as exc:
        raise click.BadParameter(
            f"cannot serve metrics on port {port}: {exc.strerror or exc}",
            param_hint="'--metrics-port'",
        ) from None
    click.echo(f"Prometheus metrics on http://0.0.0.0:{port}/metrics", err=True)


def _quiet_console(log_format: str) -> None:
    """The console keeps batchllm's and Celery's lines; vLLM's output, its engine processes'
    output and the interpreter's warnings go to $BATCHLLM_HOME/logs/worker-<time>-<pid>.log."""
    import logging

    from batchllm.cli.console import quiet, worker_lines
    from batchllm.settings import get_settings

    log = quiet(
        get_settings().home / "logs",
        "worker",
        shows=worker_lines,
        console_format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if log is None:
        return
    if log_format == "json":
        from batchllm.worker.log_format import use_json

        use_json()  # already for the line below; Celery's logging setup keeps the handlers
    # Logged, not echoed, so that --log-format json keeps the console one object per line.
    logging.getLogger(__name__).info("vLLM's output goes to %s (-v shows it here)", log)


def _supervise(
    count: int, models, queues, name, loglevel, metrics_port: int | None, verbose: int
) -> None:
    """Run `count` single-process workers, GPU i visible to process i, restarting any that
    dies, and forward SIGTERM/SIGINT to them. Each child has its own metrics registry, served
    on metrics_port + i."""
    from batchllm.worker.supervisor import child_env, supervise

    commands = []
    for i in range(count):
        argv = [sys.executable, "-m", "batchllm", *["-v"] * verbose, "worker"]
        argv += ["--loglevel", loglevel]
        for model in models:
            argv += ["--model", model]
        if queues:
            argv += ["--queues", queues]
        # Names must be unique on the host: a worker may reclaim a shard it ran itself.
        argv += ["--name", f"{name or f'batchllm-{os.getpid()}'}-{i}@{socket.gethostname()}"]
        if metrics_port is not None:  # a restarted child serves on its slot's port again
            argv += ["--metrics-port", str(metrics_port + i)]
        commands.append((argv, child_env(i)))
    code = supervise(commands)
    if code:
        raise SystemExit(code)


@cli.command()
@click.option("--loop", is_flag=True, help="Keep reconciling every BATCHLLM_RECONCILE_SECONDS.")
def reconcile(loop: bool) -> None:
    """Move stuck jobs on: re-send lost shard tasks, re-queue shards of dead workers, end
    cancelled jobs, finalize jobs left finalizing. Every worker already does this in the
    background; run it by hand when no worker is up, or to see what it would find."""
    import threading

    from batchllm.worker.celery_app import TASK_RUN_SHARD, create_app
    from batchllm.worker.reconciler import reconcile_forever, reconcile_once

    app = create_app()

    def send(shard_id: int, queue: str) -> None:
        app.send_task(TASK_RUN_SHARD, args=(shard_id,), queue=queue)

    if loop:
        reconcile_forever(send, threading.Event())
        return
    done = reconcile_once(send)
    click.echo(
        f"re-queued {len(done.requeued_stale)} shard(s) of dead workers, re-sent "
        f"{len(done.resent_lost)} lost task(s), expired {len(done.expired_jobs)} job(s), "
        f"cancelled {len(done.cancelled_jobs)} job(s), finalized {len(done.finalized_jobs)} "
        "job(s)"
    )
