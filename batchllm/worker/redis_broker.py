"""The Redis broker, reached one way: the check that a broker URL is Redis, the connection,
and every key name read or written there, batchllm's own and those of kombu's Redis transport.
redis-py is imported only when a connection is opened."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

SCHEMES = ("redis://", "rediss://", "unix://")

# batchllm's keys: a live worker's mark on a shard task it holds (holding.py) and the models a
# worker process serves (registry.py). Both expire when their worker stops refreshing them.
HELD_PREFIX = "batchllm:held:"
WORKER_PREFIX = "batchllm:worker:"
# Every model a worker has announced, with when it last did (a sorted set, model -> epoch
# seconds): `serve` still accepts a model whose workers were scaled to zero a while ago. It never
# expires (one entry per model name ever served: small); readers apply their retention.
SERVED_MODELS_KEY = "batchllm:served-models"

# kombu's Redis transport: messages delivered and not acknowledged, the time each was delivered,
# and the separator of a queue's per-priority lists (QUEUE + separator + priority).
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"
PRIORITY_SEPARATOR = "\x06\x16"


def is_redis(broker_url: str) -> bool:
    """Whether batchllm can read and write this broker itself (only Redis brokers)."""
    return broker_url.startswith(SCHEMES)


def connect(broker_url: str, *, timeout: float = 2, connect_timeout: float = 2) -> redis.Redis:
    import redis

    return redis.Redis.from_url(
        broker_url, socket_timeout=timeout, socket_connect_timeout=connect_timeout
    )


def held_key(shard_id: int) -> str:
    return f"{HELD_PREFIX}{shard_id}"


def worker_key(node: str) -> str:
    return f"{WORKER_PREFIX}{node}"
