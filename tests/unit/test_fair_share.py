"""Priorities and fair share: which queued shard a shard task's turn goes to (SQLite)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from batchllm.jobs.create import create_job
from batchllm.store import service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Batch, Job, Shard, ShardStatus, utcnow
from batchllm.worker.celery_app import TASK_RUN_SHARD
from batchllm.worker.fair_share import effective_level, next_shard, take_turn
from batchllm.worker.shard_tasks import send_shard_tasks
from tests.support.fake_runs import make_spec, write_items

AGING = 600.0


def _job(settings, tmp_path, name: str, shards: int, *, priority: str = "normal") -> list[int]:
    spec = make_spec().model_copy(update={"priority": priority})
    created = create_job(
        write_items(tmp_path / f"{name}.jsonl", shards), spec, shard_size=1, settings=settings
    )
    with session_scope(settings) as session:
        return [s.id for s in session.get(Job, created.job.id).shards]


def _start(settings, shard_id: int, *, ago: float = 0.0) -> None:
    now = utcnow() - timedelta(seconds=ago)
    with session_scope(settings) as session:
        state_machine.run_shard(session, shard_id, "w1", now=now, stale_before=now)


def _turn(settings, shard_id: int) -> int:
    with session_scope(settings) as session:
        return next_shard(session, shard_id, aging_seconds=AGING)


def _job_of(settings, shard_id: int) -> str:
    with session_scope(settings) as session:
        return session.get(Shard, shard_id).job_id


def test_a_high_priority_job_takes_the_turn_of_a_low_one_submitted_first(settings, tmp_path):
    low = _job(settings, tmp_path, "low", 5, priority="low")
    high = _job(settings, tmp_path, "high", 2, priority="high")
    _start(settings, low[0])
    assert _turn(settings, low[1]) == high[0]
    _start(settings, high[0])
    assert _turn(settings, low[2]) == high[1]
    _start(settings, high[1])
    # Nothing of higher priority waits: the low job's own shard runs.
    assert _turn(settings, low[2]) == low[2]


def test_one_job_of_a_job_with_a_hundred_shards_waits_one_shard_at_most(settings, tmp_path):
    big = _job(settings, tmp_path, "big", 100)
    small = _job(settings, tmp_path, "small", 1)
    _start(settings, big[0])
    # The small job's tenant never had a turn: it comes before the big job's second shard.
    assert _turn(settings, big[1]) == small[0]


def test_tenants_take_turns_whatever_their_number_of_batches(settings, tmp_path):
    tenant_a = [_job(settings, tmp_path, f"a{i}", 1)[0] for i in range(5)]
    tenant_b = _job(settings, tmp_path, "b", 1)[0]
    with session_scope(settings) as session:
        for shard_id in [*tenant_a, tenant_b]:
            owner = "key_b" if shard_id == tenant_b else "key_a"
            session.add(
                Batch(
                    job_id=session.get(Shard, shard_id).job_id,
                    owner=owner,
                    endpoint="/v1/completions",
                    completion_window="24h",
                    input_file_id="file-x",
                )
            )
    _start(settings, tenant_a[0])
    # Tenant A's four other batches were queued first; tenant B's one still goes next.
    assert _turn(settings, tenant_a[1]) == tenant_b


def test_a_low_job_that_waited_two_aging_periods_goes_before_a_fresh_high_one(settings, tmp_path):
    low = _job(settings, tmp_path, "low", 3, priority="low")
    high = _job(settings, tmp_path, "high", 3, priority="high")
    with session_scope(settings) as session:
        session.execute(
            update(Job)
            .where(Job.id == _job_of(settings, low[0]))
            .values(created_at=utcnow() - timedelta(seconds=2 * AGING + 1))
        )
    _start(settings, high[0], ago=5)
    # Both count as high now; the low job's tenant had no turn yet.
    assert _turn(settings, high[1]) == low[0]
    assert effective_level("low", 2 * AGING + 1, AGING) == 0
    assert effective_level("low", AGING, AGING) == 1
    assert effective_level("high", 0, AGING) == 0


def test_a_task_that_gives_its_turn_away_queues_its_own_shard_again(settings, tmp_path):
    low = _job(settings, tmp_path, "low", 2, priority="low")
    high = _job(settings, tmp_path, "high", 1, priority="high")
    app = _RecordingApp()

    def requeue(own: int) -> None:
        send_shard_tasks(app, [own], "q", settings=settings)

    assert take_turn(low[0], settings=settings, requeue=requeue) == high[0]
    assert app.sent == [(TASK_RUN_SHARD, (low[0],), "q")]
    with session_scope(settings) as session:
        assert session.get(Shard, low[0]).status is ShardStatus.QUEUED
        assert session.get(Shard, low[0]).dispatched_at is not None


class _RecordingApp:
    """The Celery app's send_task, recorded instead of sent to a broker."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple, str]] = []

    def send_task(self, name, args=(), queue=None, **options):
        self.sent.append((name, tuple(args), queue))


def test_a_running_or_done_shards_task_keeps_its_own_shard(settings, tmp_path):
    low = _job(settings, tmp_path, "low", 2, priority="low")
    _job(settings, tmp_path, "high", 1, priority="high")
    _start(settings, low[0])
    assert _turn(settings, low[0]) == low[0]
