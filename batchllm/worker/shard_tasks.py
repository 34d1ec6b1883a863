"""Sending shard tasks: the one way a `run_shard` task leaves batchllm (a submit, a retry, the
reconciler, a worker handing a shard back, waiting or giving its turn away). Each send is
recorded on its shards as dispatched, so the reconciler gives the task its grace before it
counts it lost and sends another."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from celery import Celery
from sqlalchemy.exc import SQLAlchemyError

from batchllm.settings import Settings
from batchllm.store import recovery
from batchllm.store.db import session_scope
from batchllm.worker.celery_app import TASK_RUN_SHARD

log = logging.getLogger(__name__)


def send_shard_tasks(
    app: Celery,
    shard_ids: Iterable[int],
    queue: str | None,
    *,
    settings: Settings,
    countdown: float | None = None,
    connection: Any = None,
) -> None:
    """One task per shard on `queue` (None: the app's default), after `countdown` seconds
    when given, on `connection` when the caller holds one open for many; then the shards are
    marked dispatched."""
    shard_ids = list(shard_ids)
    options: dict[str, Any] = {}
    if countdown is not None:
        options["countdown"] = countdown
    if connection is not None:
        options["connection"] = connection
    for shard_id in shard_ids:
        app.send_task(TASK_RUN_SHARD, args=(shard_id,), queue=queue, **options)
    try:
        with session_scope(settings) as session:
            recovery.mark_dispatched(session, shard_ids)
    except SQLAlchemyError as exc:
        # The tasks are out; an older mark only lets the reconciler send another sooner, and
        # a second delivery of a shard that runs is answered "busy".
        log.warning("shards %s sent, not marked dispatched: %s", shard_ids, exc)
