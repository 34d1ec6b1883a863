"""Celery tasks: thin wrappers that hand a shard id to process_shard.

The task and the worker's signal handlers are this process's entry points: each reads the
environment's settings once and hands them down; nothing below them reads the environment.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from celery import shared_task
from celery.signals import (
    after_setup_logger,
    task_postrun,
    task_prerun,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from batchllm.engine.protocol import EngineSource
from batchllm.execution.engines import EngineCache, WorkerEngine
from batchllm.execution.instant import InstantWorkerEngine
from batchllm.execution.runner import Outcome
from batchllm.process import log_format
from batchllm.process.stopping import DEFAULT_DRAIN_SECONDS, StopRequest, StopSignals
from batchllm.settings import Settings, get_settings
from batchllm.spec import EngineOptions
from batchllm.store.db import get_engine
from batchllm.worker import registry
from batchllm.worker.celery_app import TASK_RUN_SHARD
from batchllm.worker.delivery import (
    DATABASE_ERRORS,
    database_retry_seconds,
    process_shard,
    send_again_after,
)
from batchllm.worker.fair_share import backoff_left, take_turn
from batchllm.worker.holding import holding
from batchllm.worker.idle import IdleWatch
from batchllm.worker.reconciler import reconcile_forever
from batchllm.worker.shard_tasks import send_shard_tasks

log = logging.getLogger(__name__)

# The worker's engine: `batchllm worker` builds its own with start_engine before Celery takes
# a task. (A Celery worker started otherwise, e.g. by `celery -A`, builds one per job's
# settings, as `batchllm run` does: an EngineCache made by its first task.)
_engines: EngineSource | None = None
# What start_engine was told, for the signal handlers Celery calls later in this process.
_served_models: list[str] = []  # announced to `batchllm serve` (GET /v1/models)
_json_logs_wanted = False
_idle: IdleWatch | None = None  # `worker --max-idle`
# SIGTERM/SIGINT: drain, then hand back (process/stopping.py); start_engine sets the drain.
_stop = StopRequest(DEFAULT_DRAIN_SECONDS)
_stop_signals = StopSignals(_stop)


@after_setup_logger.connect
def _json_logs(logger=None, **_kwargs) -> None:
    """`worker --log-format json`: Celery has set up its handlers; make them write JSON."""
    if _json_logs_wanted:
        log_format.use_json(logger)


def start_engine(
    model: str,
    options: EngineOptions,
    *,
    settings: Settings,
    allow_rebuild: bool,
    instant: bool = False,
    instant_step_seconds: float = 0.0,
    json_logs: bool = False,
    max_idle: float | None = None,
    drain_seconds: float = DEFAULT_DRAIN_SECONDS,
) -> WorkerEngine | InstantWorkerEngine:
    """Build this worker process's engine under `settings`; the worker says ready (and takes
    tasks) after, announcing `model`. `instant`: the simulation engine (execution/instant.py),
    never vLLM, paced by `instant_step_seconds` (execution/stand_in_engines.py's InstantEngine),
    with the settings' cost per token served (BATCHLLM_INSTANT_TOKEN_SECONDS).
    `json_logs`: Celery's log handlers write JSON (`--log-format json`). `max_idle`: stop
    (warm, exit 0) after that many seconds without a task (worker/idle.py). `drain_seconds`: on
    SIGTERM, how long the rows in flight may go on finishing (0: stop at once)."""
    global _engines, _json_logs_wanted, _idle
    _served_models[:] = [model]
    _json_logs_wanted = json_logs
    _idle = IdleWatch(max_idle) if max_idle else None
    _stop.drain_seconds = drain_seconds
    _open_database(settings)
    engine: WorkerEngine | InstantWorkerEngine
    if instant:
        engine = InstantWorkerEngine(
            model,
            options,
            step_seconds=instant_step_seconds,
            token_seconds=settings.instant_token_seconds,
        )
    else:
        engine = WorkerEngine(model, options, settings=settings, allow_rebuild=allow_rebuild)
    _engines = engine
    engine.start()
    return engine


def _open_database(settings: Settings) -> None:
    """Open the database's pool and check its schema while the worker starts: its first task
    paid for it otherwise, inside a job's time (importing psycopg and alembic and reading the
    migration scripts: ~0.5 s of CPU a worker here, issue 37's profile). A database that is
    down or behind is only logged: the tasks wait for it, as they do when it goes down later."""
    try:
        get_engine(settings)
    except Exception as exc:
        first_line = (str(exc).splitlines() or [""])[0]
        log.warning("the database is not usable yet (%s); tasks wait for it", first_line)


def _engines_under(settings: Settings) -> EngineSource:
    """The worker's engine; without one from start_engine, an EngineCache made now."""
    global _engines
    if _engines is None:
        _engines = EngineCache(settings)
    return _engines


def _engine_profile() -> dict | None:
    profile = getattr(_engines, "profile", None)
    return profile.as_dict() if profile is not None else None


@worker_ready.connect
def _watch_idleness(sender=None, **_kwargs) -> None:
    if _idle is None:
        return
    _idle.reset()
    # SIGTERM to this process: Celery's warm shutdown, as a scale-down would send it.
    _idle.watch(_stop.requested, lambda: os.kill(os.getpid(), signal.SIGTERM))


@task_prerun.connect
def _task_started(**_kwargs) -> None:
    if _idle is not None:
        _idle.started()


@task_postrun.connect
def _task_ended(**_kwargs) -> None:
    if _idle is not None:
        _idle.ended()


@worker_shutting_down.connect
def _on_shutdown(**_kwargs) -> None:
    """SIGTERM or SIGINT (Celery's warm shutdown): the running shard drains, checkpoints and
    hands the rest back. Celery sends this again on each SIGTERM: the second cuts the drain
    short. A second SIGINT would be Celery's cold shutdown instead; it cuts the drain short too
    (process/stopping.py)."""
    _stop_signals.received()


@worker_ready.connect
def _start_reconciler(sender=None, **_kwargs) -> None:
    """Move stuck states on within about a lease, not after Redis's visibility timeout (hours,
    so that long shards are never redelivered while they run)."""
    settings = get_settings()

    def send(shard_id: int, queue: str) -> None:
        send_shard_tasks(run_shard.app, [shard_id], queue, settings=settings)

    threading.Thread(
        target=reconcile_forever,
        args=(send, _stop.requested, settings),
        name="batchllm-reconciler",
        daemon=True,
    ).start()


@worker_ready.connect
def _start_registration(sender=None, **_kwargs) -> None:
    """Announce this worker's models (GET /v1/models of `batchllm serve` lists them)."""
    models = list(_served_models)
    if not models:
        return
    node = getattr(sender, "hostname", None) or "worker"
    threading.Thread(
        target=_register_forever,
        args=(node, models, get_settings()),
        name="batchllm-registry",
        daemon=True,
    ).start()


def _register_forever(node: str, models: list[str], settings: Settings) -> None:
    period = min(settings.reconcile_seconds, 30.0)
    while True:
        try:
            registry.register(
                settings.broker_url,
                node,
                models,
                ttl_seconds=int(3 * period) + 1,
                engine=_engine_profile(),
            )
        except Exception as exc:  # the broker is down: the reconciler says so too
            log.debug("could not register this worker's models: %s", exc)
        if _stop.requested.wait(period):
            return


@worker_shutdown.connect
def _close_engine(**_kwargs) -> None:
    """Stop the EngineCore process before the interpreter exits: multiprocessing's exit handler
    joins it, and vLLM's own finalizer would only run after that, so the worker never exits."""
    if _engines is not None:
        _engines.close()


@shared_task(
    name=TASK_RUN_SHARD, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None
)
def run_shard(self, shard_id: int) -> str:
    queue = (self.request.delivery_info or {}).get("routing_key")
    node = self.request.hostname or "worker"
    settings = get_settings()
    delivered = shard_id  # the shard whose task this is
    try:
        # Priorities and fair share: this task may be another queued shard's turn.
        shard_id = take_turn(
            shard_id,
            settings=settings,
            requeue=lambda own: send_shard_tasks(self.app, [own], queue, settings=settings),
            worker=node,
        )
        waiting = backoff_left(shard_id, settings=settings)
        if waiting > 0:
            # A shard that failed runs again only after its backoff; its task waits that long
            # (fair share gave no other shard of the queue this turn).
            send_shard_tasks(self.app, [shard_id], queue, settings=settings, countdown=waiting)
            return Outcome.WAITING.value
        # Held while the engine builds, before the claim: the reconciler leaves this task be.
        with holding(settings.broker_url, shard_id, node, settings.lease_seconds):
            outcome = process_shard(
                shard_id,
                worker=node,
                engines=_engines_under(settings),
                stop=_stop,
                settings=settings,
            )
    except DATABASE_ERRORS as exc:
        # Acknowledging this delivery would lose the shard's task; send it again with backoff.
        # (If the broker is down too, the reconciler re-sends it once both are back.)
        delay = database_retry_seconds(self.request.retries)
        log.warning(
            "shard %s: database unreachable (%s); trying again in %d s",
            shard_id,
            str(exc).splitlines()[0],
            delay,
        )
        raise self.retry(exc=exc, countdown=delay, queue=queue) from None
    countdown = send_again_after(outcome, shard_id, delivered=delivered, settings=settings)
    if countdown is not None:
        send_shard_tasks(
            self.app, [shard_id], queue, settings=settings, countdown=countdown or None
        )
        if outcome in (Outcome.INTERRUPTED, Outcome.ENGINE_DIED):
            log.warning("shard %s handed back to %s (%s)", shard_id, queue, outcome.value)
    return outcome.value
