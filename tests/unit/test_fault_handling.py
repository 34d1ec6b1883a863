"""Engine faults on the deterministic fake engine: an engine that dies or drops requests hands
its shards back with the finished rows kept, a later run finishes every line exactly once, and a
request that ended without its answer becomes an error row, never an ok one."""

from __future__ import annotations

import collections
import dataclasses
import os
import posixpath
import signal

import pytest

from batchllm.errors import EngineDied, JobInterrupted
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.jobs.local import run_job
from batchllm.output.parts import MANIFEST_NAME, SUCCESS_NAME
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus
from batchllm.worker.delivery import process_shard
from tests.support.fake_runs import (
    FakeEngine,
    FakeEngines,
    create_items_job,
    item_of,
    make_spec,
    output_rows,
    small_commits,
    write_items,
)
from tests.support.file_jobs import run_file
from tests.support.inputs import source_of

RESULT_REASONS = ("stop", "length")


class FaultyEngine(FakeEngine):
    """The fake engine with faults: `reasons` ends the request of an item (`item-N`) with that
    finish reason; at step `abort_at` the last request finishing is reported "abort" (vLLM
    dropping it on its own); from step `die_at` on (or once `dead` is set), every call raises
    EngineDied."""

    def __init__(
        self,
        *,
        reasons: dict[str, str] | None = None,
        abort_at: int | None = None,
        die_at: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.reasons = reasons or {}
        self.abort_at = abort_at
        self.die_at = die_at
        self.dead = False
        self.item_of_request: dict[str, str] = {}
        self.dropped: list[str] = []  # items whose request this engine reported as "abort"
        self.shut_down = False

    def add(self, request_id, token_ids, params, adapter=None) -> None:
        self._check_alive()
        super().add(request_id, token_ids, params, adapter)
        self.item_of_request[request_id] = item_of(self.prompts_added[-1])

    def step(self):
        if self.die_at is not None and self.step_count + 1 >= self.die_at:
            self.step_count += 1
            self.dead = True
        self._check_alive()
        done = []
        for finished in super().step():
            reason = self.reasons.get(self.item_of_request[finished.request_id])
            done.append(dataclasses.replace(finished, finish_reason=reason) if reason else finished)
        if self.step_count == self.abort_at and done:
            done[-1] = dataclasses.replace(done[-1], finish_reason="abort")
            self.dropped.append(self.item_of_request[done[-1].request_id])
        return done

    def abort(self, request_ids) -> None:
        self._check_alive()
        super().abort(request_ids)

    def shutdown(self) -> None:
        self.shut_down = True

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineDied("the fake engine process died")


class BuildingEngines:
    """Stands in for EngineCache: `get` hands out the next of these engines when it holds
    none, and `close` shuts its engine down and drops it, like the real cache."""

    def __init__(self, *engines: FakeEngine) -> None:
        self._next = list(engines)
        self.engine: FakeEngine | None = None
        self.built: list[FakeEngine] = []

    def get(self, spec, max_model_len: int) -> FakeEngine:
        if self.engine is None:
            self.engine = self._next.pop(0)
            self.engine.max_model_len = max_model_len
            self.built.append(self.engine)
        return self.engine

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()


def shard_rows(settings, job_id: str) -> list[tuple[ShardStatus, int, int, str | None]]:
    with session_scope(settings) as session:
        return [
            (s.status, s.rows_ok, s.rows_failed, s.error) for s in session.get(Job, job_id).shards
        ]


def assert_every_line_once(settings, job_id: str, lines: int) -> list[dict]:
    rows = output_rows(settings, job_id)
    assert collections.Counter(r["line"] for r in rows) == collections.Counter(range(1, lines + 1))
    return rows


# -- vLLM drops a request on its own ------------------------------------------------------------


def test_a_request_the_engine_aborted_on_its_own_hands_the_shard_back_with_finished_rows_kept(
    small_commits, tmp_path
):
    settings = small_commits
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 40, shard_size=40)
    engine = FaultyEngine(abort_at=6)  # 4 requests finish every 2 steps

    with pytest.raises(EngineDied, match="aborted request"):
        ShardRunner(engine, worker="w1", settings=settings).run([shard_id])

    (dropped,) = engine.dropped
    kept = output_rows(settings, job_id)
    # Steps 2 and 4 finished 8 rows, step 6 three more before the dropped one.
    assert len(kept) == 11
    assert dropped not in {r["custom_id"] for r in kept}
    assert len({r["line"] for r in kept}) == 11
    assert all(r["status"] == "ok" and r["finish_reason"] in RESULT_REASONS for r in kept)
    assert not engine.has_unfinished()  # the runner aborted what it still had in flight
    assert shard_rows(settings, job_id) == [(ShardStatus.QUEUED, 11, 0, None)]
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert (job.status, job.error) == (JobStatus.IN_PROGRESS, None)
        assert (job.request_completed, job.request_failed) == (11, 0)

    again = FakeEngine()
    assert ShardRunner(again, worker="w2", settings=settings).run([shard_id]) == {
        shard_id: Outcome.COMPLETED
    }

    rows = assert_every_line_once(settings, job_id, 40)
    assert len(again.prompts_added) == 40 - 11
    assert dropped in {item_of(p) for p in again.prompts_added}
    assert all(r["status"] == "ok" for r in rows)
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED
        assert (job.request_completed, job.request_failed) == (40, 0)
        assert session.get(Shard, shard_id).attempts == 2


# -- the engine process dies --------------------------------------------------------------------


def test_an_engine_that_dies_mid_run_hands_every_active_shard_back_and_a_rerun_finishes_once(
    small_commits, tmp_path
):
    settings = small_commits
    job_id, shard_ids = create_items_job(settings, tmp_path, 40, shard_size=12)
    assert len(shard_ids) == 4
    engine = FaultyEngine(die_at=10)

    with pytest.raises(EngineDied):
        ShardRunner(engine, worker="w1", settings=settings).run(shard_ids)

    # All 40 requests were fed at once; steps 2-8 finished shard 0's 12 rows and 4 of shard 1.
    kept = output_rows(settings, job_id)
    assert len(kept) == 16
    assert len({r["line"] for r in kept}) == len(kept)
    assert all(r["status"] == "ok" for r in kept)
    assert shard_rows(settings, job_id) == [
        (ShardStatus.COMPLETED, 12, 0, None),
        (ShardStatus.QUEUED, 4, 0, None),
        (ShardStatus.QUEUED, 0, 0, None),
        (ShardStatus.QUEUED, 0, 0, None),
    ]
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert (job.status, job.error) == (JobStatus.IN_PROGRESS, None)
        assert (job.request_completed, job.request_failed, job.shards_done) == (16, 0, 1)

    again = FakeEngine()
    outcomes = ShardRunner(again, worker="w2", settings=settings).run(shard_ids)

    assert outcomes == {
        shard_ids[0]: Outcome.SKIPPED,
        **{shard_id: Outcome.COMPLETED for shard_id in shard_ids[1:]},
    }
    assert_every_line_once(settings, job_id, 40)
    assert len(again.prompts_added) == 40 - 16
    assert [s for s, *_ in shard_rows(settings, job_id)] == [ShardStatus.COMPLETED] * 4
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED
        assert (job.request_completed, job.request_failed) == (40, 0)


def test_process_shard_drops_a_dead_engine_so_the_next_task_builds_a_new_one(
    small_commits, tmp_path
):
    settings = small_commits
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 30, shard_size=30)
    dying, fresh = FaultyEngine(die_at=5), FaultyEngine()
    engines = BuildingEngines(dying, fresh)

    outcome = process_shard(shard_id, worker="w1", engines=engines, settings=settings)

    assert outcome is Outcome.ENGINE_DIED
    assert engines.engine is None
    assert dying.shut_down
    kept = output_rows(settings, job_id)
    assert len(kept) == 8  # steps 2 and 4
    assert shard_rows(settings, job_id) == [(ShardStatus.QUEUED, 8, 0, None)]

    assert (
        process_shard(shard_id, worker="w1", engines=engines, settings=settings)
        is Outcome.COMPLETED
    )

    assert engines.built == [dying, fresh]
    assert engines.engine is fresh and not fresh.shut_down
    assert len(fresh.prompts_added) == 30 - 8
    assert_every_line_once(settings, job_id, 30)
    with session_scope(settings) as session:
        assert session.get(Job, job_id).status is JobStatus.COMPLETED


def test_an_engine_that_dies_while_requests_are_added_hands_the_shard_back_without_error_rows(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 40, shard_size=40)
    monkeypatch.setattr("batchllm.execution.runner._PREPARE_BATCH", 4)  # feed as rows finish
    engine = FaultyEngine()
    # Dies during its 4th step: the runner next tops the window up, and `add` raises.
    engine.on_step = lambda n: setattr(engine, "dead", n >= 4)

    with pytest.raises(EngineDied):
        ShardRunner(engine, worker="w1", settings=settings).run([shard_id])

    kept = output_rows(settings, job_id)
    assert len(kept) == 8  # steps 2 and 4
    assert all(r["status"] == "ok" for r in kept)
    assert shard_rows(settings, job_id) == [(ShardStatus.QUEUED, 8, 0, None)]

    assert ShardRunner(FakeEngine(), worker="w2", settings=settings).run([shard_id]) == {
        shard_id: Outcome.COMPLETED
    }
    rows = assert_every_line_once(settings, job_id, 40)
    assert all(r["status"] == "ok" for r in rows)


def test_a_shard_whose_engine_dies_on_its_last_allowed_run_fails_instead_of_looping(
    small_commits, tmp_path
):
    settings = small_commits
    settings.max_shard_attempts = 2
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 40, shard_size=40)

    with pytest.raises(EngineDied):
        ShardRunner(FaultyEngine(die_at=5), worker="w1", settings=settings).run([shard_id])
    assert shard_rows(settings, job_id) == [(ShardStatus.QUEUED, 8, 0, None)]
    with pytest.raises(EngineDied):
        ShardRunner(FaultyEngine(die_at=5), worker="w2", settings=settings).run([shard_id])

    ((status, ok, failed, error),) = shard_rows(settings, job_id)
    assert (status, ok, failed) == (ShardStatus.FAILED, 16, 0)
    assert "the engine died on run 2 of this shard" in error
    rows = output_rows(settings, job_id)
    assert len({r["line"] for r in rows}) == len(rows) == 16
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.FAILED
        assert "the engine died on run 2" in job.error


# -- a request that ended without its answer ----------------------------------------------------


def test_a_request_that_ended_with_another_finish_reason_becomes_an_error_row_and_the_job_completes(
    small_commits, tmp_path
):
    settings = small_commits
    source = write_items(tmp_path / "in.jsonl", 20)
    engine = FaultyEngine(reasons={"item-5": "error", "item-9": "timeout"})

    job = run_job(
        source_of(source, settings), make_spec(), settings=settings, engines=FakeEngines(engine)
    )

    assert job.status is JobStatus.COMPLETED
    assert (job.request_completed, job.request_failed) == (18, 2)
    rows = assert_every_line_once(settings, job.id, 20)
    by_id = {r["custom_id"]: r for r in rows}
    for item, reason in (("item-5", "error"), ("item-9", "timeout")):
        row = by_id[item]
        assert (row["status"], row["text"], row["finish_reason"]) == ("error", None, None)
        assert row["error"] == f"vLLM ended the request with finish reason {reason!r}"
        assert row["prompt_tokens"] > 0
        assert row["completion_tokens"] is None
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 18
    assert all(r["finish_reason"] in RESULT_REASONS and r["error"] is None for r in ok)
    assert job.completion_tokens == sum(r["completion_tokens"] for r in ok)
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job.id)
    assert storage.exists(posixpath.join(out_dir, SUCCESS_NAME))
    assert storage.exists(posixpath.join(out_dir, MANIFEST_NAME))


# -- Ctrl-C in `batchllm run` -------------------------------------------------------------------


def interrupt_at(*steps: int):
    """An on_step callback that sends this process a SIGINT (a Ctrl-C) at these steps."""

    def on_step(step: int) -> None:
        if step in steps:
            os.kill(os.getpid(), signal.SIGINT)

    return on_step


def assert_interrupted_job(settings, engine: FakeEngine) -> list[dict]:
    """The job ended failed "interrupted" with only whole answers, no line twice, no _SUCCESS;
    returns its rows."""
    with session_scope(settings) as session:
        (job,) = service.list_jobs(session, limit=5)
        assert (job.status, job.error) == (JobStatus.FAILED, "interrupted")
        committed = job.request_completed + job.request_failed
        shard_statuses = {s.status for s in job.shards}
        job_id = job.id
    rows = output_rows(settings, job_id)
    assert 0 < len(rows) == committed < 40
    assert len({r["line"] for r in rows}) == len(rows)
    assert all(r["status"] == "ok" and r["finish_reason"] in RESULT_REASONS for r in rows)
    assert shard_statuses <= {ShardStatus.QUEUED, ShardStatus.COMPLETED}
    assert not engine.has_unfinished()
    storage = Storage.of(settings)
    assert not storage.exists(posixpath.join(storage.output_dir(job_id), SUCCESS_NAME))
    return rows


def test_a_first_ctrl_c_stops_the_run_in_order_and_fails_the_job_with_its_committed_rows(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", 0.0)
    source = write_items(tmp_path / "in.jsonl", 40)
    engine = FakeEngine(on_step=interrupt_at(7))
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(JobInterrupted, match="interrupted"):
            run_file(source, make_spec(), settings, engines=FakeEngines(engine))
        assert signal.getsignal(signal.SIGINT) is previous
    finally:
        signal.signal(signal.SIGINT, previous)

    rows = assert_interrupted_job(settings, engine)
    assert engine.step_count == 7  # no engine step after the interrupt was seen
    assert len(rows) == 12  # steps 2, 4 and 6
    assert engine.aborted


def test_a_second_ctrl_c_stops_at_once_and_still_keeps_the_committed_rows(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    # The run never reaches its control check: only the second Ctrl-C can stop it.
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", 3600.0)
    source = write_items(tmp_path / "in.jsonl", 40)
    engine = FakeEngine(on_step=interrupt_at(5, 7))
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(JobInterrupted):
            run_file(source, make_spec(), settings, engines=FakeEngines(engine))
        assert signal.getsignal(signal.SIGINT) is previous
    finally:
        signal.signal(signal.SIGINT, previous)

    rows = assert_interrupted_job(settings, engine)
    assert engine.step_count == 7
    assert len(rows) == 12  # steps 2, 4 and 6: the buffered ones are committed on the way out


def test_a_ctrl_c_during_the_last_step_never_reports_a_completed_job_as_failed(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", 3600.0)
    source = write_items(tmp_path / "in.jsonl", 40)
    engine = FakeEngine(on_step=interrupt_at(20))  # 40 rows, 4 every 2 steps: 20 is the last
    previous = signal.getsignal(signal.SIGINT)
    try:
        try:
            run_file(source, make_spec(), settings, engines=FakeEngines(engine))
            reported = "completed"
        except JobInterrupted:
            reported = "failed"
    finally:
        signal.signal(signal.SIGINT, previous)

    with session_scope(settings) as session:
        (job,) = service.list_jobs(session, limit=5)
        assert reported == job.status.value
