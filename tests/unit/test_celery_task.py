"""The Celery task `run_shard` without a broker: what it sends back to the broker for each
outcome of process_shard, and how it retries when the database is unreachable.

The task runs in-process with a pushed request, as a worker would run a delivery from the
queue in its routing key; the app's send_task records what would go to the broker.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from celery.exceptions import Retry
from sqlalchemy.exc import InterfaceError, OperationalError

from batchllm.execution.runner import Outcome
from batchllm.worker import tasks
from batchllm.worker.celery_app import TASK_RUN_SHARD
from batchllm.worker.tasks import run_shard

QUEUE = "batchllm.models_fake"
HOSTNAME = "celery@gpu-node-3"
SHARD_ID = 42


class SentTasks:
    """Stands in for the app's send_task: records each task it would publish."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, name: str, args=None, kwargs=None, **options) -> None:
        self.calls.append((name, {"args": tuple(args or ()), **options}))


@pytest.fixture
def sent(monkeypatch) -> SentTasks:
    recorder = SentTasks()
    monkeypatch.setattr(run_shard.app, "send_task", recorder)
    return recorder


@pytest.fixture
def processed() -> list[tuple[int, dict]]:
    """The calls the task made to process_shard (see fake_process_shard)."""
    return []


def fake_process_shard(
    monkeypatch, calls: list, *, outcome: Outcome | None = None, error: Exception | None = None
) -> None:
    def process_shard(shard_id, **kwargs):
        calls.append((shard_id, kwargs))
        if error is not None:
            raise error
        return outcome

    monkeypatch.setattr("batchllm.worker.tasks.process_shard", process_shard)


@contextmanager
def delivered(*, retries: int = 0, routing_key: str | None = QUEUE):
    """The request of a delivery taken from `routing_key`'s queue, as a worker sets it."""
    run_shard.push_request(
        id="task-1",
        args=[SHARD_ID],
        kwargs={},
        retries=retries,
        hostname=HOSTNAME,
        delivery_info={"routing_key": routing_key, "exchange": "", "priority": 0},
        called_directly=False,
        is_eager=False,
    )
    try:
        yield
    finally:
        run_shard.pop_request()


@pytest.mark.parametrize("outcome", [Outcome.INTERRUPTED, Outcome.ENGINE_DIED])
def test_a_shard_handed_back_is_sent_again_at_once_to_the_queue_it_came_from(
    outcome, sent, processed, monkeypatch
):
    fake_process_shard(monkeypatch, processed, outcome=outcome)

    with delivered():
        result = run_shard.run(SHARD_ID)

    assert result == outcome.value
    assert sent.calls == [(TASK_RUN_SHARD, {"args": (SHARD_ID,), "queue": QUEUE})]
    ((shard_id, kwargs),) = processed
    assert shard_id == SHARD_ID
    assert kwargs["worker"] == HOSTNAME
    assert kwargs["engines"] is tasks._engines


# A shard busy on another worker is looked at again in thirty seconds; one this worker's
# engine cannot run goes back on its own queue, where a worker that serves the job takes it,
# and this one looks again in fifteen.
@pytest.mark.parametrize(
    ("outcome", "countdown"), [(Outcome.BUSY, 30), (Outcome.WAITING, 15)], ids=["busy", "waiting"]
)
def test_a_shard_not_run_here_is_sent_again_after_a_countdown(
    sent, processed, monkeypatch, outcome, countdown
):
    fake_process_shard(monkeypatch, processed, outcome=outcome)

    with delivered():
        result = run_shard.run(SHARD_ID)

    assert result == outcome.value
    assert sent.calls == [
        (TASK_RUN_SHARD, {"args": (SHARD_ID,), "queue": QUEUE, "countdown": countdown})
    ]


@pytest.mark.parametrize(
    "outcome", [Outcome.COMPLETED, Outcome.SKIPPED, Outcome.CANCELLED, Outcome.LOST, Outcome.FAILED]
)
def test_a_shard_that_ended_or_belongs_to_another_worker_sends_no_task(
    outcome, sent, processed, monkeypatch
):
    fake_process_shard(monkeypatch, processed, outcome=outcome)

    with delivered():
        result = run_shard.run(SHARD_ID)

    assert result == outcome.value
    assert sent.calls == []
    assert [shard_id for shard_id, _ in processed] == [SHARD_ID]


def test_the_worker_name_falls_back_to_worker_when_the_request_has_no_hostname(
    sent, processed, monkeypatch
):
    fake_process_shard(monkeypatch, processed, outcome=Outcome.COMPLETED)
    run_shard.push_request(id="task-1", args=[SHARD_ID], kwargs={}, delivery_info=None)
    try:
        run_shard.run(SHARD_ID)
    finally:
        run_shard.pop_request()

    assert processed[0][1]["worker"] == "worker"
    assert sent.calls == []


def database_down() -> OperationalError:
    return OperationalError("SELECT 1", {}, Exception("server closed the connection\ndetail"))


def test_an_unreachable_database_retries_the_shard_in_five_seconds_on_the_same_queue(
    sent, processed, monkeypatch
):
    fake_process_shard(monkeypatch, processed, error=database_down())

    with delivered(retries=0), pytest.raises(Retry) as raised:
        run_shard.run(SHARD_ID)

    assert raised.value.when == 5
    assert isinstance(raised.value.exc, OperationalError)
    # The retry is a new message in the broker before this delivery is acknowledged.
    ((name, message),) = sent.calls
    assert name == TASK_RUN_SHARD
    assert message["args"] == (SHARD_ID,)
    assert message["queue"] == QUEUE
    assert message["countdown"] == 5
    assert message["retries"] == 1


@pytest.mark.parametrize(("retries", "countdown"), [(1, 10), (2, 20), (3, 40), (4, 60), (50, 60)])
def test_database_retries_back_off_doubling_up_to_a_minute_and_never_give_up(
    retries, countdown, sent, processed, monkeypatch
):
    fake_process_shard(monkeypatch, processed, error=database_down())

    with delivered(retries=retries), pytest.raises(Retry) as raised:
        run_shard.run(SHARD_ID)

    assert raised.value.when == countdown
    ((_, message),) = sent.calls
    assert (message["args"], message["queue"], message["countdown"]) == (
        (SHARD_ID,),
        QUEUE,
        countdown,
    )
    assert message["retries"] == retries + 1


def test_a_dropped_database_connection_retries_like_an_unreachable_database(
    sent, processed, monkeypatch
):
    error = InterfaceError("SELECT 1", {}, Exception("connection already closed"))
    fake_process_shard(monkeypatch, processed, error=error)

    with delivered(), pytest.raises(Retry) as raised:
        run_shard.run(SHARD_ID)

    assert raised.value.when == 5
    assert [m["countdown"] for _, m in sent.calls] == [5]


def test_an_error_that_is_not_the_database_propagates_without_a_retry(sent, processed, monkeypatch):
    fake_process_shard(monkeypatch, processed, error=ValueError("a bug"))

    with delivered(), pytest.raises(ValueError, match="a bug"):
        run_shard.run(SHARD_ID)

    assert sent.calls == []
