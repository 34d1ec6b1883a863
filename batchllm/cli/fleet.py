"""The fleet: `submit`, `worker`, `wait`, `cancel` (Celery workers over Redis)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

import click

from batchllm.cli import cli
from batchllm.cli.engine_flags import (
    choice_option,
    count_option,
    engine_flags_as_args,
    float_option,
    worker_engine_from_flags,
    worker_engine_options,
)
from batchllm.cli.options import (
    echo_webhook_secret,
    engine_kind_options,
    job_input,
    job_options,
    log_format_option,
    notify_option,
    require_requests,
    spec_from_flags,
)

if TYPE_CHECKING:  # pyarrow stays out of `batchllm --help`'s imports
    from batchllm.input.files.source import InputSource
    from batchllm.spec import EngineOptions


@cli.command()
@job_options
@count_option("--shard-size", help="Rows per shard [default: BATCHLLM_SHARD_SIZE, 10000].")
@click.option("--wait", "wait_", is_flag=True, help="Follow the job with a progress bar.")
@click.option(
    "--after",
    "after",
    multiple=True,
    metavar="JOB",
    help="Start the job only when JOB completed (repeatable): it is validated and stored now "
    "and waits; if JOB fails, is cancelled or expires, this job fails naming it.",
)
@choice_option(
    "--priority",
    choices=["high", "normal", "low"],
    default="normal",
    help="Workers take higher-priority shards first; a waiting job rises a level every "
    "BATCHLLM_PRIORITY_AGING_SECONDS.",
)
@notify_option
def submit(
    file: InputSource | None,
    from_job: str | None,
    from_status: str,
    strict: bool,
    shard_size: int | None,
    wait_: bool,
    after: tuple[str, ...],
    dry_run: bool,
    notify: str | None,
    **flags,
) -> None:
    """Validate FILE (JSONL, or a Parquet/CSV table with --prompt-column: a local path or an
    s3:// URI), queue it for the worker fleet and print the job id.

    \b
    Example:
      batchllm submit prompts.jsonl --model meta-llama/Llama-3.1-8B-Instruct --metadata team=search
      batchllm submit docs.parquet --prompt-column text --id-column doc_id --model ./model
      batchllm submit urgent.jsonl --model M --priority high --notify https://example.com/hook
      batchllm submit --from job_1a2b --prompt-template 'Summarize: {text}' --model M
      batchllm submit eval.jsonl --model M --after job_1a2b
    """
    flags["after"] = list(after)
    with job_input(file, from_job, from_status, flags) as source:
        _submit(source, strict, shard_size, wait_, dry_run, notify, flags)


def _submit(
    file: InputSource,
    strict: bool,
    shard_size: int | None,
    wait_: bool,
    dry_run: bool,
    notify: str | None,
    flags: dict,
) -> None:
    from batchllm.client import Client

    spec = spec_from_flags(flags, file)
    require_requests(file)
    if dry_run:
        from batchllm.cli.render import echo_estimate

        echo_estimate(Client().dry_run_spec(file, spec), spec.model)
        return
    job = Client().submit_spec(file, spec, shard_size=shard_size, strict=strict, notify=notify)
    click.echo(job.id)
    state = "queued" if job.status != "waiting" else f"waiting for {', '.join(spec.after)}"
    click.echo(
        f"{_counts(job.total, job.invalid or 0)} in {job.shards} shard(s), {state}", err=True
    )
    echo_webhook_secret(job.notify_secret, notify)
    if wait_:
        follow_job(job.id)


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
    follow_job(job_id, timeout)


def follow_job(job_ref: str, timeout: float | None = None) -> None:
    """Follow a job with a progress bar until it ends (`wait`, `retry --wait`, `submit
    --wait`); exit 1 unless it completed."""
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
    required=True,
    help="The model this worker serves; its engine is built at start-up.",
)
@worker_engine_options
@click.option(
    "--allow-rebuild",
    is_flag=True,
    help="Let a job this engine cannot run (LoRA, embeddings, a longer explicit context, "
    "another dtype...) rebuild it for that job; the next job gets the worker's own engine "
    "back. Off: such jobs wait for a worker that serves them.",
)
@engine_kind_options(
    "instant: SIMULATION ONLY, no vLLM and no generation; every request answers at once "
    "with filler text (jobs record the hardware 'none (instant engine)'). For measuring a "
    "fleet's own costs: `python -m benchmarks.fleet`.",
    "With --engine instant: each engine step takes this long and gives every running "
    "request one token, so a request takes max_tokens steps (0: answers at once). Gives a "
    "simulated job a duration set by the clock, e.g. to cancel it or kill its worker part-way.",
)
@click.option("--queues", "-Q", default=None, help="Extra comma-separated queue names.")
@float_option(
    "--max-idle",
    least=1,
    metavar="SECONDS",
    help="Stop (warm, exit 0) after this long without a task, counted from when the engine "
    "is ready: a worker Deployment scaled to zero, a Kubernetes Job or a spot instance can "
    "then end. With --concurrency N each process stops on its own, and the command exits "
    "when all have.",
)
@float_option(
    "--drain-seconds",
    default=20,
    envvar="BATCHLLM_DRAIN_SECONDS",
    show_envvar=True,
    metavar="SECONDS",
    help="On SIGTERM or Ctrl-C, let the rows already in the engine finish for up to this "
    "long (the drain), commit them, then hand the rest of the shard back and exit 0. A "
    "second signal cuts the drain short; 0 stops at once. The default fits Kubernetes' 30 s "
    "grace period with the engine's own shutdown.",
)
@count_option(
    "--concurrency",
    "-c",
    default=1,
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
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    envvar="BATCHLLM_METRICS_PORT",
    show_envvar=True,
    help="Serve Prometheus metrics at http://0.0.0.0:PORT/metrics. With --concurrency N, "
    "worker process i serves its own on PORT+i (scrape all N ports).",
)
@log_format_option(
    "json: one object per line (time, level, logger, message, job_id, shard_id) for log shippers."
)
def worker(
    model: str,
    allow_rebuild: bool,
    engine_kind: str,
    instant_step_seconds: float,
    queues: str | None,
    max_idle: float | None,
    drain_seconds: float,
    concurrency: int,
    name: str | None,
    loglevel: str,
    metrics_port: int | None,
    log_format: str,
    **engine_flags,
) -> None:
    """Start a Celery worker that runs shards through its own vLLM engine (broker:
    BATCHLLM_BROKER_URL).

    The engine is the operator's: built from MODEL and the engine flags before the worker
    takes its first task (it says "ready" only then), and kept for every job. Jobs adapt to
    it: rows longer than its context become error rows, and a job that needs what it does not
    serve (LoRA, embeddings, a longer explicit --max-model-len, another dtype) waits for a
    worker that does; `batchllm status JOB` says which.

    Each process uses Celery's solo pool: vLLM starts its engine in a child process, which
    prefork children are not allowed to have.

    \b
    Example:
      batchllm worker --model meta-llama/Llama-3.1-8B-Instruct --max-model-len 8192 \\
        --concurrency 8 --metrics-port 9400
    """
    from batchllm.process.stopping import stop_with_parent

    options = worker_engine_from_flags(engine_flags)
    stop_with_parent()
    ctx = click.get_current_context()
    verbose = ctx.find_root().params.get("verbose") or 0
    if concurrency == 1 and not verbose:
        # Before Celery and vLLM are imported, so their import-time warnings go to the file
        # too. With --concurrency N each worker process names its own file.
        _quiet_console(log_format)
    from batchllm.worker.celery_app import worker_queues

    names = worker_queues(
        model, task=options.task, enable_lora=options.enable_lora, allow_rebuild=allow_rebuild
    ) + [q for q in (queues or "").split(",") if q]
    _check_metrics_ports(metrics_port, concurrency)
    instant = engine_kind == "instant"
    if concurrency > 1:
        if not instant:  # instant workers hold no GPU and no engine process
            _check_concurrency(concurrency)
        child_args = _forwarded(model, allow_rebuild, queues, loglevel, log_format, ctx)
        child_args += _forwarded_run(instant, instant_step_seconds, max_idle, drain_seconds)
        _supervise(concurrency, child_args, name, metrics_port, verbose)
        return
    if metrics_port is not None:
        _serve_metrics(metrics_port)
    _run_worker(
        model,
        options,
        names,
        name,
        loglevel,
        allow_rebuild=allow_rebuild,
        instant=instant,
        instant_step_seconds=instant_step_seconds,
        json_logs=log_format == "json",
        max_idle=max_idle,
        drain_seconds=drain_seconds,
    )


def _check_metrics_ports(metrics_port: int | None, concurrency: int) -> None:
    if metrics_port is not None and metrics_port + concurrency - 1 > 65535:
        raise click.BadParameter(
            f"{metrics_port} + {concurrency - 1} is past 65535: each worker process serves its "
            "metrics on the next port",
            param_hint="'--metrics-port'",
        )


def _check_concurrency(concurrency: int) -> None:
    """Refuse more engine processes than this machine has GPUs (or CPU room) for."""
    from batchllm.engine.hardware import runs_on_cpu, visible_gpus
    from batchllm.engine.preflight import check_worker_concurrency

    on_cpu = runs_on_cpu()
    gpus = [] if on_cpu else visible_gpus()
    check_worker_concurrency(concurrency, is_cpu=on_cpu, gpus=gpus)


def _run_worker(
    model: str,
    options: EngineOptions,
    names: list[str],
    name: str | None,
    loglevel: str,
    *,
    allow_rebuild: bool,
    instant: bool,
    instant_step_seconds: float,
    json_logs: bool,
    max_idle: float | None,
    drain_seconds: float,
) -> None:
    """This process as one worker: build its engine, then take tasks from the queues `names`
    with Celery's solo pool until it stops."""
    from batchllm.errors import BatchLLMError
    from batchllm.process.stopping import cleanups_run_on_signals
    from batchllm.settings import get_settings
    from batchllm.worker.celery_app import create_app, run_worker
    from batchllm.worker.tasks import start_engine

    settings = get_settings()
    app = create_app(settings)
    node = name or f"batchllm-{os.getpid()}@{socket.gethostname()}"
    # Logged, not echoed: the console stays log lines (JSON ones under --log-format json).
    logging.getLogger(__name__).info(
        "%s: building the %s engine for %s",
        node,
        "INSTANT (simulation)" if instant else "vLLM",
        model,
    )
    try:
        # Celery's signal handlers exist only once it runs. Before, SIGTERM's default action
        # ended this process mid-build with no cleanup, and an EngineCore that had not finished
        # its handshake with it (so not yet watching it: process/parent_watch.py) waited for
        # vLLM's 5-minute handshake timeout under PID 1. Here SIGTERM and SIGHUP unwind the
        # build instead: vLLM's client shuts its engine processes down on the way out.
        with cleanups_run_on_signals():
            start_engine(  # logs "engine ready in"
                model,
                options,
                settings=settings,
                allow_rebuild=allow_rebuild,
                instant=instant,
                instant_step_seconds=instant_step_seconds,
                json_logs=json_logs,
                max_idle=max_idle,
                drain_seconds=drain_seconds,
            )
    except BatchLLMError as exc:
        raise click.ClickException(f"the worker's engine could not start: {exc}") from None
    code = run_worker(
        app,
        [
            "--pool=solo",
            "--concurrency=1",
            "-Q",
            ",".join(names),
            "-n",
            node,
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
        ],
    )
    if code:
        logging.getLogger(__name__).error(
            "%s: the Celery worker stopped with exit code %d (see the error above); exiting "
            "with it, so that a supervisor starts this worker again",
            node,
            code,
        )
        raise SystemExit(code)


def _forwarded(
    model: str,
    allow_rebuild: bool,
    queues: str | None,
    loglevel: str,
    log_format: str,
    ctx: click.Context,
) -> list[str]:
    """The arguments each child of --concurrency N gets: this worker's, engine flags included,
    as given on the command line (as arguments, not through the environment)."""
    args = ["--model", model, "--loglevel", loglevel, "--log-format", log_format]
    if allow_rebuild:
        args.append("--allow-rebuild")
    if queues:
        args += ["--queues", queues]
    return args + engine_flags_as_args(ctx)


def _forwarded_run(
    instant: bool, instant_step_seconds: float, max_idle: float | None, drain_seconds: float
) -> list[str]:
    """The arguments that say how each child of --concurrency N runs: its engine kind, idle
    limit and drain."""
    args = []
    if instant:
        args += ["--engine", "instant", "--instant-step-seconds", str(instant_step_seconds)]
    if max_idle is not None:
        args += ["--max-idle", str(max_idle)]
    # The supervisor passes each signal on: a second one cuts the children's drains short.
    return args + ["--drain-seconds", str(drain_seconds)]


def _serve_metrics(port: int) -> None:
    """This process's Prometheus registry on PORT, or a clear error when the port is taken."""
    from batchllm.execution.metrics import start_metrics_server

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
        from batchllm.process.log_format import use_json

        use_json()  # already for the line below; Celery's logging setup keeps the handlers
    # Logged, not echoed, so that --log-format json keeps the console one object per line.
    logging.getLogger(__name__).info("vLLM's output goes to %s (-v shows it here)", log)


def _supervise(
    count: int, child_args: list[str], name: str | None, metrics_port: int | None, verbose: int
) -> None:
    """Run `count` single-process workers, GPU i visible to process i, restarting any that
    dies, and forward SIGTERM/SIGINT to them. Each child has its own metrics registry, served
    on metrics_port + i."""
    from batchllm.process.supervisor import child_env, supervise

    commands = []
    for i in range(count):
        argv = [sys.executable, "-m", "batchllm", *["-v"] * verbose, "worker", *child_args]
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
    cancelled jobs, finalize jobs left finalizing, delete ended jobs past
    BATCHLLM_RETAIN_DAYS. Every worker already does this in the background; run it by hand
    when no worker is up, or to see what it would find."""
    import threading

    from batchllm.settings import get_settings
    from batchllm.worker.celery_app import sender_app
    from batchllm.worker.reconciler import reconcile_forever, reconcile_once
    from batchllm.worker.shard_tasks import send_shard_tasks

    settings = get_settings()
    app = sender_app(settings)

    def send(shard_id: int, queue: str) -> None:
        send_shard_tasks(app, [shard_id], queue, settings=settings)

    if loop:
        reconcile_forever(send, threading.Event(), settings)
        return
    done = reconcile_once(send, settings)
    click.echo(
        f"re-queued {len(done.requeued_stale)} shard(s) of dead workers, re-sent "
        f"{len(done.resent_lost)} lost task(s), expired {len(done.expired_jobs)} job(s), "
        f"cancelled {len(done.cancelled_jobs)} job(s), finalized {len(done.finalized_jobs)} "
        f"job(s), delivered {len(done.notified_jobs)} webhook(s), deleted "
        f"{len(done.deleted_jobs)} old job(s), released {len(done.released_jobs)} waiting "
        f"job(s), failed {len(done.failed_waiting_jobs)} whose parent did not complete"
    )
