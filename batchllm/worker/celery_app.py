"""The Celery application: Redis broker, one queue per model, settings for long GPU tasks.

Tasks carry only a shard id; all state lives in the database, so a task is idempotent and a
redelivered one resumes from the shard's checkpoints.
"""

from __future__ import annotations

import re

from celery import Celery

from batchllm.settings import Settings, get_settings

TASK_RUN_SHARD = "batchllm.run_shard"


def queue_for_model(model: str) -> str:
    """Shards are routed by model, so a worker never receives a shard it cannot serve and a
    job for a model that no worker serves waits without blocking anything else."""
    return "batchllm." + re.sub(r"[^A-Za-z0-9_.-]+", "_", model.strip("/"))[-180:]


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("batchllm", broker=settings.broker_url, include=["batchllm.worker.tasks"])
    app.conf.update(
        # A shard is acknowledged only after it ran; a worker that dies leaves it in the broker.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # One shard at a time per worker process: a prefetched shard would wait behind a long one.
        worker_prefetch_multiplier=1,
        # Redis redelivers an unacknowledged task after this; it must exceed the longest shard.
        # (A redelivery while the first worker still runs is refused by the shard's heartbeat.)
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        # A broker restart must never end a worker: reconnect for as long as it takes (Celery
        # logs each attempt). The default gives up after 100 attempts and the worker exits.
        broker_connection_max_retries=None,
        worker_hijack_root_logger=False,
        task_default_queue="batchllm.default",
    )
    return app
