"""A stop's drain (execution/stop_request.py, ShardRunner._begin_stop): after a stop request the
runner feeds nothing more, lets the rows in flight finish for up to `drain_seconds`, commits
them, aborts the rest and hands the shard back; a second request cuts the drain short. Each
case then resumes the shard on a fresh runner and checks every line has exactly one row."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.execution.stop_request import StopRequest
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus
from tests.support.fake_runs import (
    FakeEngine,
    create_items_job,
    make_spec,
    output_rows,
    small_commits,
)

MODEL = make_spec().model
ROWS = 40


def drain_rows(outcome: str) -> float:
    labels = {"model": MODEL, "outcome": outcome}
    return REGISTRY.get_sample_value("batchllm_drain_rows_total", labels) or 0.0


def committed(settings, job_id: str) -> int:
    with session_scope(settings) as session:
        return session.get(Job, job_id).request_completed


def resume_and_check_exactly_once(settings, job_id: str, shard_id: int, already: int) -> None:
    with session_scope(settings) as session:
        assert session.get(Shard, shard_id).status is ShardStatus.QUEUED  # handed back
    second = FakeEngine()
    assert ShardRunner(second, worker="w2", settings=settings).run([shard_id]) == {
        shard_id: Outcome.COMPLETED
    }
    assert len(second.prompts_added) == ROWS - already  # nothing committed runs again
    assert sorted(r["line"] for r in output_rows(settings, job_id)) == list(range(1, ROWS + 1))
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED and job.request_completed == ROWS


def paced(monkeypatch) -> None:
    """Check for the stop after every step, and feed 4 rows a batch: with the runner's window
    of 16 (4 x the fake's 4 seqs), 16 rows are in flight whenever the runner stops."""
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", 0.0)
    monkeypatch.setattr("batchllm.execution.runner._PREPARE_BATCH", 4)


class StopAt:
    """An on_step that asks for a stop after step `at`; once stopping, each step takes
    `step_seconds` (a real engine's pace, which is what a drain deadline is measured against)
    and `again_at` (if set) sends the second request that cuts the drain short."""

    def __init__(self, stop: StopRequest, at: int, step_seconds: float = 0.0, again_at=None):
        self.stop, self.at, self.step_seconds, self.again_at = stop, at, step_seconds, again_at

    def __call__(self, step: int) -> None:
        if step == self.at or step == self.again_at:
            self.stop.request()
        elif step > self.at:
            time.sleep(self.step_seconds)


def test_a_drain_lets_every_row_in_flight_finish_and_commits_them(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    paced(monkeypatch)
    job_id, (shard_id,) = create_items_job(settings, tmp_path, ROWS, shard_size=ROWS)
    stop = StopRequest(drain_seconds=60.0)
    # 4 rows at a time, 4 steps each, a window of 16: at step 6 the first 4 rows are done
    # (steps 1-4) and 16 are in flight.
    engine = FakeEngine(steps=4, on_step=StopAt(stop, at=6))
    saved_before, aborted_before = drain_rows("saved"), drain_rows("aborted")

    outcome = ShardRunner(engine, worker="w1", settings=settings, stop=stop).run([shard_id])

    assert outcome == {shard_id: Outcome.INTERRUPTED}
    assert engine.aborted == []  # the drain finished them all: nothing was thrown away
    assert len(engine.prompts_added) == 4 + 16  # and nothing was fed after the stop
    assert committed(settings, job_id) == 20
    assert drain_rows("saved") - saved_before == 16
    assert drain_rows("aborted") - aborted_before == 0
    resume_and_check_exactly_once(settings, job_id, shard_id, already=20)


def test_the_drain_deadline_aborts_the_rows_still_running_and_hands_them_back(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    paced(monkeypatch)
    job_id, (shard_id,) = create_items_job(settings, tmp_path, ROWS, shard_size=ROWS)
    stop = StopRequest(drain_seconds=1.5)
    # 40 steps a row: the second four (steps 41-80) are two steps from done at step 78; the
    # 12 behind them would need 40 steps more (4 s at 0.1 s a step), past the deadline.
    engine = FakeEngine(steps=40, on_step=StopAt(stop, at=78, step_seconds=0.1))
    saved_before, aborted_before = drain_rows("saved"), drain_rows("aborted")
    started = time.monotonic()

    outcome = ShardRunner(engine, worker="w1", settings=settings, stop=stop).run([shard_id])

    assert time.monotonic() - started < 30  # the deadline held the drain to its 1.5 s
    assert outcome == {shard_id: Outcome.INTERRUPTED}
    assert len(engine.aborted) == 12 and not engine.has_unfinished()
    assert committed(settings, job_id) == 4 + 4
    assert drain_rows("saved") - saved_before == 4
    assert drain_rows("aborted") - aborted_before == 12
    seconds = REGISTRY.get_sample_value("batchllm_last_drain_seconds", {"model": MODEL})
    assert seconds is not None and seconds >= 1.5
    resume_and_check_exactly_once(settings, job_id, shard_id, already=8)


def test_a_second_request_cuts_the_drain_short(small_commits, tmp_path, monkeypatch):
    settings = small_commits
    paced(monkeypatch)
    job_id, (shard_id,) = create_items_job(settings, tmp_path, ROWS, shard_size=ROWS)
    stop = StopRequest(drain_seconds=600.0)
    # Stopped at step 6 with rows 5-8 two steps from done; the second request comes at step 7,
    # before any of the 16 in flight finished: all are aborted, long before 600 s.
    engine = FakeEngine(steps=4, on_step=StopAt(stop, at=6, again_at=7))
    aborted_before = drain_rows("aborted")
    started = time.monotonic()

    outcome = ShardRunner(engine, worker="w1", settings=settings, stop=stop).run([shard_id])

    assert time.monotonic() - started < 60
    assert outcome == {shard_id: Outcome.INTERRUPTED}
    assert stop.cut_short.is_set()
    assert len(engine.aborted) == 16
    assert committed(settings, job_id) == 4
    assert drain_rows("aborted") - aborted_before == 16
    resume_and_check_exactly_once(settings, job_id, shard_id, already=4)


def test_no_drain_seconds_stops_at_once_as_before(small_commits, tmp_path, monkeypatch):
    settings = small_commits
    paced(monkeypatch)
    job_id, (shard_id,) = create_items_job(settings, tmp_path, ROWS, shard_size=ROWS)
    stop = StopRequest(drain_seconds=0.0)
    engine = FakeEngine(steps=4, on_step=StopAt(stop, at=6))
    saved_before = drain_rows("saved")

    outcome = ShardRunner(engine, worker="w1", settings=settings, stop=stop).run([shard_id])

    assert outcome == {shard_id: Outcome.INTERRUPTED}
    assert len(engine.aborted) == 16
    assert committed(settings, job_id) == 4
    assert drain_rows("saved") == saved_before  # no drain, nothing counted as one
    resume_and_check_exactly_once(settings, job_id, shard_id, already=4)


def test_stop_request_first_asks_then_cuts_short():
    stop = StopRequest(drain_seconds=5.0)
    assert not stop.requested.is_set() and not stop.cut_short.is_set()
    stop.request()
    assert stop.requested.is_set() and not stop.cut_short.is_set()
    stop.request()
    assert stop.cut_short.is_set()
