"""Which shard tasks the broker holds: waiting in a queue, or delivered and not acknowledged.

The database says which shards are queued; only the broker knows whether their tasks still
exist (a Redis restart without persistence, or a task acknowledged after an error, loses them).
This reads kombu's Redis layout: each queue is a list of messages, and messages delivered but
not yet acknowledged (running tasks, countdown retries held by a worker) sit in the `unacked`
hash until they are.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from typing import cast

from batchllm.worker.holding import held_shard_ids
from batchllm.worker.redis_broker import UNACKED_INDEX_KEY, UNACKED_KEY, connect, is_redis

log = logging.getLogger(__name__)


class BrokerNotInspectable(Exception):
    """This broker's content cannot be read (not Redis)."""


def shard_ids_in_broker(
    broker_url: str, queues: set[str], task_name: str, unacked_grace: float | None = None
) -> set[int]:
    """Shard ids of every `task_name` message in these queues or delivered and unacknowledged.

    With `unacked_grace`, a message delivered longer ago than that counts only while a live
    worker marks its shard held (worker/holding.py: a worker building its engine has not
    claimed the shard yet); otherwise its worker died before claiming it, and kombu would only
    restore it after the visibility timeout (hours)."""
    if not is_redis(broker_url):
        raise BrokerNotInspectable(
            f"cannot inspect a non-Redis broker ({broker_url.split(':')[0]})"
        )
    client = connect(broker_url, timeout=10, connect_timeout=5)
    try:
        found: set[int] = set()
        for queue in queues:
            for raw in client.lrange(queue, 0, -1):
                found.update(_shard_ids(_decode(raw), task_name))
        delivered: dict[object, float] = {}
        if unacked_grace is not None:
            scored = client.zrange(UNACKED_INDEX_KEY, 0, -1, withscores=True)
            for member, when in cast("list[tuple[bytes, float]]", scored):
                delivered[member] = float(when)
        cutoff = time.time() - unacked_grace if unacked_grace is not None else None
        overdue: set[int] = set()
        for tag, raw in client.hgetall(UNACKED_KEY).items():
            entry = _decode(raw)
            if not (isinstance(entry, list) and entry):  # [message, exchange, routing key]
                continue
            ids = _shard_ids(entry[0], task_name)
            if cutoff is not None and delivered.get(tag, cutoff) < cutoff:
                overdue.update(ids)
            else:
                found.update(ids)
        return found | held_shard_ids(client, overdue - found)
    finally:
        client.close()


def _decode(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


def _shard_ids(message: object, task_name: str) -> list[int]:
    """The shard id a task message carries (Celery protocol 2: args in the base64 body)."""
    if not isinstance(message, dict):
        return []
    headers = message.get("headers") or {}
    if headers.get("task") != task_name:
        return []
    try:
        body = message["body"]
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return [int(args[0])]
    except (KeyError, IndexError, TypeError, ValueError):
        log.debug("unreadable task message in the broker: %.200r", message)
        return []
