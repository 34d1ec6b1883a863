"""Which models the fleet serves: each worker process writes its models to a Redis key that
lives a few reconcile periods (a dead worker drops out when its key expires), and stamps them in
a sorted set that remembers when each model was last served, so `serve` still knows a model
whose workers were scaled to zero (api/served.py)."""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any

from batchllm.execution.profile import EngineProfile, unmet_requirements
from batchllm.spec import JobSpec
from batchllm.worker.redis_broker import (
    SERVED_MODELS_KEY,
    WORKER_PREFIX,
    connect,
    is_redis,
    worker_key,
)

log = logging.getLogger(__name__)


def register(
    broker_url: str,
    node: str,
    models: list[str],
    ttl_seconds: int,
    *,
    engine: dict[str, Any] | None = None,
) -> None:
    """Announce `node` serving `models` for `ttl_seconds` (call again before it runs out),
    with its engine profile (execution/profile.py EngineProfile.as_dict()) when it has one."""
    if not models or not is_redis(broker_url):
        return
    client = connect(broker_url)
    now = time.time()
    try:
        value = json.dumps(
            {
                "models": models,
                "host": socket.gethostname(),
                "node": node,
                "engine": engine,
                # When it last said it lives (the dashboard's "last heartbeat").
                "seen_at": now,
            }
        )
        pipe = client.pipeline()
        pipe.set(worker_key(node), value, ex=ttl_seconds)
        pipe.zadd(SERVED_MODELS_KEY, dict.fromkeys(models, now))
        pipe.execute()
    finally:
        client.close()


def live_workers(broker_url: str) -> list[dict[str, Any]]:
    """Every live worker process: {node, host, models, engine, seen_at (epoch seconds)} ([]
    for a non-Redis broker)."""
    if not is_redis(broker_url):
        return []
    client = connect(broker_url)
    workers = []
    try:
        for key in client.scan_iter(match=WORKER_PREFIX + "*", count=500):
            raw = client.get(key)
            if raw is not None:
                workers.append(json.loads(raw))
    finally:
        client.close()
    return sorted(workers, key=lambda w: str(w.get("node")))


def waiting_reason(spec: JobSpec, workers: list[dict[str, Any]]) -> str | None:
    """Why a queued job of `spec` has no worker to run it, or None when a live worker can."""
    serving = [w for w in workers if spec.model in w.get("models", [])]
    if not serving:
        return f"no live worker serves model {spec.model}"
    unmet = []
    for worker in serving:
        engine = worker.get("engine")
        if engine is None:  # a worker that builds an engine per job can run it
            return None
        missing = unmet_requirements(spec, EngineProfile.from_dict(engine))
        if not missing:
            return None
        unmet.append(f"{worker.get('node')}: needs {'; '.join(missing)}")
    return f"none of the {len(serving)} live worker(s) of {spec.model} can run it (" + (
        ", ".join(unmet) + ")"
    )


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


def recently_served(broker_url: str, within_seconds: float) -> dict[str, float]:
    """Model -> when a worker last announced it (epoch seconds), for the models announced in
    the last `within_seconds`: live workers' and those of workers gone since ({} for a
    non-Redis broker)."""
    if not is_redis(broker_url) or within_seconds <= 0:
        return {}
    client = connect(broker_url)
    try:
        since = time.time() - within_seconds
        found: list[tuple[bytes, float]] = client.zrangebyscore(  # type: ignore[assignment]
            SERVED_MODELS_KEY, since, "+inf", withscores=True
        )
    finally:
        client.close()
    return {model.decode(): float(seen) for model, seen in found}
