"""Celery tasks: thin wrappers that hand a shard id to process_shard."""

from __future__ import annotations

import logging
import threading

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from batchllm.jobs import service
from batchllm.jobs.db import session_scope
from batchllm.settings import get_settings
from batchllm.worker.celery_app import queue_for_model
from batchllm.worker.engines import EngineCache
from batchllm.worker.runner import Outcome
from batchllm.worker.shard_task import process_shard

log = logging.getLogger(__name__)

# One warm engine per worker process, kept across shards and jobs with equal engine settings.
_engines = EngineCache()
_stop = threading.Event()
_RETRY_BUSY_SECONDS = 30


@worker_shutting_down.connect
def _on_shutdown(**_kwargs) -> None:
    """SIGTERM (warm shutdown): the running shard checkpoints and hands the rest back."""
    _stop.set()


@worker_ready.connect
def _start_sweeper(sender=None, **_kwargs) -> None:
    """Put back the shards of dead workers within a lease, not after Redis's visibility timeout
    (hours, so that long shards are never redelivered while they run)."""
    threading.Thread(target=_sweep_forever, name="batchllm-sweeper", daemon=True).start()


def _sweep_forever() -> None:
    settings = get_settings()
    interval = max(settings.lease_seconds / 2, 1.0)
    while not _stop.wait(interval):
        try:
            with session_scope(settings) as session:
                stale = service.requeue_stale_shards(session, settings.lease_seconds)
            for shard_id, model in stale:
                log.warning("shard %s lost its worker: queued again", shard_id)
                run_shard.apply_async((shard_id,), queue=queue_for_model(model))
        except Exception:  # the sweeper must outlive a database or broker hiccup
            log.exception("sweeping stale shards failed; retrying in %.0f s", interval)


@worker_shutdown.connect
def _close_engine(**_kwargs) -> None:
    """Stop the EngineCore process before the interpreter exits: multiprocessing's exit handler
    joins it, and vLLM's own finalizer would only run after that, so the worker never exits."""
    _engines.close()


@shared_task(name="batchllm.run_shard", bind=True, acks_late=True, reject_on_worker_lost=True,
             max_retries=None)
def run_shard(self, shard_id: int) -> str:
    outcome = process_shard(shard_id, worker=self.request.hostname or "worker",
                            engines=_engines, should_stop=_stop.is_set)
    queue = (self.request.delivery_info or {}).get("routing_key")
    if outcome is Outcome.INTERRUPTED:
        # Re-queue before this delivery is acknowledged, so the rest of the shard is never lost.
        self.app.send_task(self.name, args=(shard_id,), queue=queue)
        log.warning("shard %s handed back to %s", shard_id, queue)
    elif outcome is Outcome.BUSY:
        # A duplicate delivery while another worker holds the shard: look again later, so the
        # shard still has a task if that worker dies.
        self.app.send_task(self.name, args=(shard_id,), queue=queue,
                           countdown=_RETRY_BUSY_SECONDS)
    return outcome.value
