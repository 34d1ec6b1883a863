"""Priorities and fair share: which queued shard a shard task's turn goes to (SQLite)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from batchllm.store import service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Batch, Job, Shard, ShardStatus, utcnow
from batchllm.worker.celery_app import TASK_RUN_SHARD
from batchllm.worker.fair_share import effective_level, next_shard, take_turn
from batchllm.worker.shard_tasks import send_shard_tasks
from tests.support.fake_runs import make_spec, one_line_shards, update_shard, write_items
from tests.support.inputs import source_of

AGING = 600.0
WINDOW = 300.0  # fair share's window of tokens served


def _start(settings, shard_id: int, *, ago: float = 0.0) -> None:
    now = utcnow() - timedelta(seconds=ago)
    with session_scope(settings) as session:
        state_machine.run_shard(session, shard_id, "w1", now=now, stale_before=now)


def _turn(settings, shard_id: int) -> int:
    with session_scope(settings) as session:
        return next_shard(session, shard_id, aging_seconds=AGING, window_seconds=WINDOW)


def _job_of(settings, shard_id: int) -> str:
    with session_scope(settings) as session:
        return session.get(Shard, shard_id).job_id


def test_a_high_priority_job_takes_the_turn_of_a_low_one_submitted_first(settings, tmp_path):
    low = one_line_shards(settings, tmp_path, "low", 5, priority="low")
    high = one_line_shards(settings, tmp_path, "high", 2, priority="high")
    _start(settings, low[0])
    assert _turn(settings, low[1]) == high[0]
    _start(settings, high[0])
    assert _turn(settings, low[2]) == high[1]
    _start(settings, high[1])
    # Nothing of higher priority waits: the low job's own shard runs.
    assert _turn(settings, low[2]) == low[2]


def test_one_job_of_a_job_with_a_hundred_shards_waits_one_shard_at_most(settings, tmp_path):
    big = one_line_shards(settings, tmp_path, "big", 100)
    small = one_line_shards(settings, tmp_path, "small", 1)
    _start(settings, big[0])
    # The small job's tenant never had a turn: it comes before the big job's second shard.
    assert _turn(settings, big[1]) == small[0]


def test_tenants_take_turns_whatever_their_number_of_batches(settings, tmp_path):
    tenant_a = [one_line_shards(settings, tmp_path, f"a{i}", 1)[0] for i in range(5)]
    tenant_b = one_line_shards(settings, tmp_path, "b", 1)[0]
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
    low = one_line_shards(settings, tmp_path, "low", 3, priority="low")
    high = one_line_shards(settings, tmp_path, "high", 3, priority="high")
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
    low = one_line_shards(settings, tmp_path, "low", 2, priority="low")
    high = one_line_shards(settings, tmp_path, "high", 1, priority="high")
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
    low = one_line_shards(settings, tmp_path, "low", 2, priority="low")
    one_line_shards(settings, tmp_path, "high", 1, priority="high")
    _start(settings, low[0])
    assert _turn(settings, low[0]) == low[0]


# -- affinity: which of a job's shards a worker takes (worker/affinity.py) --------------------


def _take(settings, shard_id: int, worker: str) -> int:
    """The shard a task of `shard_id` runs on `worker`, started there (as its claim would)."""
    with session_scope(settings) as session:
        chosen = next_shard(
            session, shard_id, aging_seconds=AGING, window_seconds=WINDOW, worker=worker
        )
    now = utcnow()
    with session_scope(settings) as session:
        state_machine.run_shard(session, chosen, worker, now=now, stale_before=now)
    return chosen


def _finish(settings, shard_id: int) -> None:
    update_shard(settings, shard_id, status=ShardStatus.COMPLETED, finished_at=utcnow())


def test_two_workers_split_a_placed_job_into_two_stretches_and_each_runs_its_own_in_order(
    settings, tmp_path
):
    shards = one_line_shards(settings, tmp_path, "placed", 10)
    index = {shard_id: i for i, shard_id in enumerate(shards)}
    ran: dict[str, list[int]] = {"w1": [], "w2": []}
    # Both free at once, each handed the task of the first queued shard: w1 runs it, w2 the
    # middle of what is left, not the next one (w1 will run into it).
    ran["w1"].append(index[_take(settings, shards[0], "w1")])
    ran["w2"].append(index[_take(settings, shards[1], "w2")])
    assert ran == {"w1": [0], "w2": [5]}
    # Then each runs on from its own last shard, whatever task it is handed.
    while len(ran["w1"]) + len(ran["w2"]) < 10:
        for worker in ("w1", "w2"):
            _finish(settings, shards[ran[worker][-1]])
            with session_scope(settings) as session:
                queued = [
                    s.id for s in session.query(Shard).filter(Shard.status == ShardStatus.QUEUED)
                ]
            if queued:
                ran[worker].append(index[_take(settings, queued[-1], worker)])
    assert ran == {"w1": [0, 1, 2, 3, 4], "w2": [5, 6, 7, 8, 9]}


def test_affinity_never_leaves_a_free_worker_idle_while_a_shard_of_the_job_waits(
    settings, tmp_path
):
    shards = one_line_shards(settings, tmp_path, "placed", 3)
    assert _take(settings, shards[0], "w1") == shards[0]
    assert _take(settings, shards[1], "w2") == shards[2]  # the middle of 1-2
    # w2 ended 2 before w1 ended 0: w2's neighbour (3) does not exist, so it takes 1, the
    # shard w1 was heading into, rather than wait.
    _finish(settings, shards[2])
    assert _take(settings, shards[1], "w2") == shards[1]


def test_a_worker_new_to_a_job_takes_a_stretch_nobody_is_heading_into_before_splitting_one(
    settings, tmp_path
):
    shards = one_line_shards(settings, tmp_path, "placed", 8)
    assert _take(settings, shards[0], "w1") == shards[0]
    assert _take(settings, shards[1], "w2") == shards[4]  # the middle of 1-7
    _finish(settings, shards[4])
    # w2 left: shard 0 (running on w1) and 4 (ended) leave two stretches, 1-3, which w1 runs
    # into, and 5-7, which nobody does: a worker new to the job starts at 5.
    assert _take(settings, shards[1], "w3") == shards[5]
