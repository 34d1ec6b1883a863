"""Celery tasks: thin wrappers that hand a shard id to process_shard."""

from __future__ import annotations

import logging
import threading

from celery import shared_task
from celery.signals import worker_shutdown, worker_shutting_down

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
