"""Which shard tasks the real Redis broker holds, as the reconciler reads them: messages waiting
in a queue and messages delivered but not acknowledged (kombu's `unacked` hash)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from batchllm.settings import Settings
from batchllm.worker.broker_tasks import BrokerNotInspectable, shard_ids_in_broker
from batchllm.worker.celery_app import TASK_RUN_SHARD, create_app
from batchllm.worker.holding import holding
from tests.support.services import redis_database

FIRST, SECOND = "batchllm.test-first", "batchllm.test-second"


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def broker() -> Iterator[tuple[redis.Redis, str, Celery]]:
    """An empty database of the local Redis (skipped, or failed under CI, without one); the
    Celery app sends to it. Flushed afterwards."""
    with redis_database(uuid.uuid4().hex[:12]) as (client, url):
        app = create_app(Settings(broker_url=url))
        try:
            yield client, url, app
        finally:
            app.close()


def test_shard_ids_are_read_from_the_queues_asked_about_and_only_for_the_run_shard_task(broker):
    client, url, app = broker
    app.send_task(TASK_RUN_SHARD, args=(7,), queue=FIRST)
    app.send_task(TASK_RUN_SHARD, args=(9,), queue=SECOND)
    app.send_task("some.other_task", args=(8,), queue=FIRST)
    assert client.llen(FIRST) == 2 and client.llen(SECOND) == 1

    assert shard_ids_in_broker(url, {FIRST}, TASK_RUN_SHARD) == {7}
    assert shard_ids_in_broker(url, {SECOND}, TASK_RUN_SHARD) == {9}
    assert shard_ids_in_broker(url, {FIRST, SECOND}, TASK_RUN_SHARD) == {7, 9}
    assert shard_ids_in_broker(url, {"batchllm.nobody-sends-here"}, TASK_RUN_SHARD) == set()


def test_a_task_delivered_and_not_acknowledged_is_found_in_the_unacked_hash(broker):
    client, url, app = broker
    app.send_task(TASK_RUN_SHARD, args=(7,), queue=FIRST)

    with app.connection_for_read() as conn:
        consumer = conn.SimpleQueue(FIRST, no_ack=False)
        try:
            message = consumer.get(timeout=5)
            assert message.headers["task"] == TASK_RUN_SHARD
            assert message.payload[0] == [7]  # Celery protocol 2: (args, kwargs, embed)
            # Delivered, not acknowledged: out of its queue, into kombu's unacked hash.
            assert client.llen(FIRST) == 0
            assert client.hlen("unacked") == 1

            assert shard_ids_in_broker(url, {FIRST}, TASK_RUN_SHARD) == {7}
            assert shard_ids_in_broker(url, set(), TASK_RUN_SHARD) == {7}
            # Held longer than the grace (its consumer died before claiming the shard): it no
            # longer counts, so the reconciler sends the shard's task again.
            assert shard_ids_in_broker(url, set(), TASK_RUN_SHARD, unacked_grace=3600) == {7}
            (tag,) = client.hkeys("unacked")
            client.zadd("unacked_index", {tag: time.time() - 7200})
            assert shard_ids_in_broker(url, set(), TASK_RUN_SHARD, unacked_grace=3600) == set()
            assert shard_ids_in_broker(url, set(), TASK_RUN_SHARD) == {7}
            # ...unless a live worker marks it held (building its engine before the claim).
            with holding(url, 7, "w1@test", lease_seconds=30):
                assert wait_for(lambda: client.get("batchllm:held:7") == b"w1@test")
                assert shard_ids_in_broker(url, set(), TASK_RUN_SHARD, unacked_grace=3600) == {7}
            assert client.get("batchllm:held:7") is None  # released when the task ends
            assert shard_ids_in_broker(url, set(), TASK_RUN_SHARD, unacked_grace=3600) == set()
        finally:
            consumer.close()


def test_an_unacked_entry_written_as_kombu_writes_it_is_found_in_any_queue(broker):
    client, url, app = broker
    app.send_task(TASK_RUN_SHARD, args=(9,), queue=SECOND)
    raw = client.rpop(SECOND)
    client.hset("unacked", "a-delivery-tag", json.dumps([json.loads(raw), SECOND, SECOND]))
    client.hset("unacked", "not-a-task", b"\xff not json")

    assert shard_ids_in_broker(url, {FIRST}, TASK_RUN_SHARD) == {9}


def test_a_broker_other_than_redis_cannot_be_inspected():
    with pytest.raises(BrokerNotInspectable, match="non-Redis broker"):
        shard_ids_in_broker("amqp://guest@localhost//", {FIRST}, TASK_RUN_SHARD)
