"""Which models the fleet serves: each worker process writes its models to a Redis key that
lives a few reconcile periods, so `GET /v1/models` lists exactly the models some live worker
serves (a dead worker drops out when its key expires)."""

from __future__ import annotations

import json
import logging
import os
import socket

from batchllm.worker.redis_broker import WORKER_PREFIX, connect, is_redis, worker_key

log = logging.getLogger(__name__)

# The `worker` command tells its Celery process which models it serves through this variable.
MODELS_ENV = "BATCHLLM_WORKER_MODELS"


def worker_models() -> list[str]:
    raw = os.environ.get(MODELS_ENV)
    return list(json.loads(raw)) if raw else []


def register(broker_url: str, node: str, models: list[str], ttl_seconds: int) -> None:
    """Announce `node` serving `models` for `ttl_seconds` (call again before it runs out)."""
    if not models or not is_redis(broker_url):
        return
    client = connect(broker_url)
    try:
        value = json.dumps({"models": models, "host": socket.gethostname()})
        client.set(worker_key(node), value, ex=ttl_seconds)
    finally:
        client.close()


def served_models(broker_url: str) -> dict[str, int]:
    """Model -> number of live worker processes serving it ({} for a non-Redis broker)."""
    if not is_redis(broker_url):
        return {}
    client = connect(broker_url)
    served: dict[str, int] = {}
    try:
        for key in client.scan_iter(match=WORKER_PREFIX + "*", count=500):
            raw = client.get(key)
            if raw is None:
                continue
            for model in json.loads(raw).get("models", []):
                served[model] = served.get(model, 0) + 1
    finally:
        client.close()
    return served
