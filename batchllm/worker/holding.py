"""A live worker's mark on a shard task it holds but has not claimed yet.

Between taking a task and claiming its shard a worker may spend a minute or more building its
engine; the shard is still `queued` in the database then and its task sits in kombu's unacked
hash. The reconciler must tell that worker apart from one that died holding the task (kombu
restores such a task only after the visibility timeout, hours). The holder keeps a Redis key
alive for as long as it holds the task; the key expires a lease after its worker dies.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterable, Iterator

from batchllm.worker.redis_broker import connect, held_key, is_redis

log = logging.getLogger(__name__)


@contextlib.contextmanager
def holding(broker_url: str, shard_id: int, node: str, lease_seconds: float) -> Iterator[None]:
    """Mark `shard_id` held by `node` while the block runs (a no-op for a non-Redis broker)."""
    if not is_redis(broker_url):
        yield
        return
    done = threading.Event()
    ttl = max(1, math.ceil(lease_seconds))
    thread = threading.Thread(
        target=_refresh,
        args=(broker_url, held_key(shard_id), node, ttl, done),
        name=f"batchllm-hold-{shard_id}",
        daemon=True,
    )
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


def _refresh(broker_url: str, key: str, node: str, ttl: int, done: threading.Event) -> None:
    import redis

    client = connect(broker_url)
    try:
        while True:
            try:
                client.set(key, node, ex=ttl)
            except redis.RedisError as exc:  # the broker is down: the worker goes on
                log.debug("could not mark %s held: %s", key, exc)
            if done.wait(ttl / 3):
                break
        with contextlib.suppress(redis.RedisError):
            client.delete(key)
    finally:
        client.close()


def held_shard_ids(client: object, shard_ids: Iterable[int]) -> set[int]:
    """Which of these shards a live worker holds (`client` is a redis.Redis)."""
    ids = list(shard_ids)
    if not ids:
        return set()
    values = client.mget([held_key(i) for i in ids])  # type: ignore[attr-defined]
    return {i for i, value in zip(ids, values, strict=True) if value is not None}
