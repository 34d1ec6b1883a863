"""A stop's drain (process/stopping.py, ShardRunner._begin_stop): after a stop request the
runner feeds nothing more, aborts the rows not yet started (past the engine's first
max_num_seqs: the fake engine, like vLLM, schedules first come, first served), lets the
generating ones finish for up to `drain_seconds`, commits them, aborts the rest and hands the
shard back; a second request cuts the drain short. Each
case then resumes the shard on a fresh runner and checks every line has exactly one row."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.process.stopping import StopRequest
from batchllm.settings import Settings
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


def resume_and_check_exactly_once(
    settings, job_id: str, shard_id: int, already: int, rows: int = ROWS
) -> None:
    with session_scope(settings) as session:
        assert session.get(Shard, shard_id).status is ShardStatus.QUEUED  # handed back
    second = FakeEngine()
    assert ShardRunner(second, worker="w2", settings=settings).run([shard_id]) == {
        shard_id: Outcome.COMPLETED
    }
    assert len(second.prompts_added) == rows - already  # nothing committed runs again
    assert sorted(r["line"] for r in output_rows(settings, job_id)) == list(range(1, rows + 1))
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED and job.request_completed == rows


def paced(monkeypatch) -> None:
    """Check for the stop after every step, and feed 4 rows a batch: with the runner's window
    of 16 (4 x the fake's 4 seqs), 16 rows are in flight whenever the runner stops."""
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", 0.0)
    monkeypatch.setattr("batchllm.execution.runner._PREPARE_BATCH", 4)


@pytest.fixture
def paced_job(small_commits, tmp_path, monkeypatch) -> tuple[Settings, str, int]:
    """A job of ROWS items in one shard, for a runner paced as paced() says: its settings,
    its id and its shard's."""
    paced(monkeypatch)
    job_id, (shard_id,) = create_items_job(small_commits, tmp_path, ROWS, shard_size=ROWS)
    return small_commits, job_id, shard_id


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


def test_a_drain_lets_every_row_in_flight_finish_and_commits_them(paced_job):
    settings, job_id, shard_id = paced_job
    stop = StopRequest(drain_seconds=60.0)
    # 4 rows at a time, 4 steps each, a window of 16: at step 6 the first 4 rows are done
    # (steps 1-4), rows 5-8 are generating (two steps to go) and rows 9-20 wait their turn.
    engine = FakeEngine(steps=4, on_step=StopAt(stop, at=6))
    before = {o: drain_rows(o) for o in ("saved", "aborted", "unstarted")}

    outcome = ShardRunner(engine, worker="w1", settings=settings, stop=stop).run([shard_id])

    assert outcome == {shard_id: Outcome.INTERRUPTED}
    assert len(engine.prompts_added) == 4 + 16  # nothing was fed after the stop
    assert len(engine.aborted) == 12  # only the rows that had not started
    assert committed(settings, job_id) == 4 + 4  # the generating ones finished in the drain
    assert {o: drain_rows(o) - before[o] for o in before} == {
        "saved": 4,
        "aborted": 0,
        "unstarted": 12,
    }
    resume_and_check_exactly_once(settings, job_id, shard_id, already=8)


def test_the_drain_deadline_aborts_the_rows_still_running_and_hands_them_back(paced_job):
    settings, job_id, shard_id = paced_job
    stop = StopRequest(drain_seconds=1.5)
    # 40 steps a row: at step 50 rows 5-8 (steps 41-80) need 30 more steps, 3 s at 0.1 s a
    # step: past the 1.5 s deadline.
    engine = FakeEngine(steps=40, on_step=StopAt(stop, at=50, step_seconds=0.1))
    before = {o: drain_rows(o) for o in ("saved", "aborted", "unstarted")}
    started = time.monotonic()

    outcome = ShardRunner(engine, worker="w1", settings=settings, stop=stop).run([shard_id])

    assert time.monotonic() - started < 30  # the deadline held the drain to its 1.5 s
    assert outcome == {shard_id: Outcome.INTERRUPTED}
    assert len(engine.aborted) == 16 and not engine.has_unfinished()
    assert committed(settings, job_id) == 4
    assert {o: drain_rows(o) - before[o] for o in before} == {
        "saved": 0,
        "aborted": 4,
        "unstarted": 12,
    }
    seconds = REGISTRY.get_sample_value("batchllm_last_drain_seconds", {"model": MODEL})
    assert seconds is not None and seconds >= 1.5
    resume_and_check_exactly_once(settings, job_id, shard_id, already=4)


def test_a_second_request_cuts_the_drain_short(paced_job):
    settings, job_id, shard_id = paced_job
    stop = StopRequest(drain_seconds=600.0)
    # Stopped at step 6 with rows 5-8 two steps from done; the second request comes at step 7,
    # before they finished: they are aborted too, long before 600 s.
    engine = FakeEngine(steps=4, on_step=StopAt(stop, at=6, again_at=7))
    aborted_before = drain_rows("aborted")
    started = time.monotonic()

    outcome = ShardRunner(engine, worker="w1", settings=settings, stop=stop).run([shard_id])

    assert time.monotonic() - started < 60
    assert outcome == {shard_id: Outcome.INTERRUPTED}
    assert stop.cut_short.is_set()
    assert len(engine.aborted) == 16
    assert committed(settings, job_id) == 4
    assert drain_rows("aborted") - aborted_before == 4
    resume_and_check_exactly_once(settings, job_id, shard_id, already=4)


def test_no_drain_seconds_stops_at_once_as_before(paced_job):
    settings, job_id, shard_id = paced_job
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


def test_a_second_request_during_the_drains_commit_loses_nothing(
    small_commits, tmp_path, monkeypatch
):
    """The signal handler only sets an event: a second SIGTERM that lands while the drain's
    rows are being committed lets the commit end, then the shard goes back as usual."""
    settings = small_commits
    paced(monkeypatch)
    job_id, (shard_id,) = create_items_job(settings, tmp_path, ROWS, shard_size=ROWS)
    stop = StopRequest(drain_seconds=60.0)
    engine = FakeEngine(steps=4, on_step=StopAt(stop, at=6))
    commit = ShardRunner._commit
    commits_during_stop = []

    def commit_with_a_second_request(runner, state):
        if runner._stopping:
            commits_during_stop.append(state.shard_id)
            stop.request()
        return commit(runner, state)

    monkeypatch.setattr(ShardRunner, "_commit", commit_with_a_second_request)

    outcome = ShardRunner(engine, worker="w1", settings=settings, stop=stop).run([shard_id])

    assert commits_during_stop and stop.cut_short.is_set()
    assert outcome == {shard_id: Outcome.INTERRUPTED}
    assert committed(settings, job_id) == 8  # the drained rows made it
    monkeypatch.setattr(ShardRunner, "_commit", commit)
    resume_and_check_exactly_once(settings, job_id, shard_id, already=8)


def test_a_shard_fed_whole_is_handed_back_not_completed_when_its_unstarted_rows_went_back(
    small_commits, tmp_path, monkeypatch
):
    """12 rows fit the window: the shard is fed whole before the stop. Its 8 unstarted rows go
    back at the drain's start; the 4 generating ones finishing must not end the shard as
    completed (8 rows would be lost): it is handed back with the rest to do."""
    settings = small_commits
    paced(monkeypatch)
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 12, shard_size=12)
    stop = StopRequest(drain_seconds=60.0)
    engine = FakeEngine(steps=4, on_step=StopAt(stop, at=2))

    outcome = ShardRunner(engine, worker="w1", settings=settings, stop=stop).run([shard_id])

    assert outcome == {shard_id: Outcome.INTERRUPTED}
    assert len(engine.aborted) == 8
    assert committed(settings, job_id) == 4
    resume_and_check_exactly_once(settings, job_id, shard_id, already=4, rows=12)


def test_a_signal_echoed_within_a_second_is_the_same_stop_a_later_one_cuts_short(monkeypatch):
    from batchllm.process import stopping

    clock = [100.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: clock[0])
    stop = StopRequest(drain_seconds=20.0)
    signals = stopping.StopSignals(stop)
    # The first signal takes over SIGINT (for a second Ctrl-C): give pytest's handler back.
    monkeypatch.setattr(stopping.signal, "signal", lambda *args: None)

    signals.received()
    clock[0] += 0.3  # the terminal's Ctrl-C to the group, forwarded by a supervisor too
    signals.received()
    assert stop.requested.is_set() and not stop.cut_short.is_set()

    clock[0] += stopping.ECHO_SECONDS
    signals.received()
    assert stop.cut_short.is_set()
