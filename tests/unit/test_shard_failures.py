"""A shard whose run fails with an error no row explains (issue 33, finding 1): each failure is
counted and recorded on the shard, the shard waits a doubling backoff before it runs again and
fair share gives its turns to others meanwhile; after BATCHLLM_MAX_SHARD_FAILURES its rows
become error rows and its job ends with the results it has (SQLite, no engine)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.execution.shard_failures import retry_delay
from batchllm.store import service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.job_view import job_view
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus, utcnow
from batchllm.worker.delivery import process_shard
from batchllm.worker.fair_share import backoff_left, next_shard
from tests.support.fake_runs import (
    FakeEngine,
    FakeEngines,
    create_items_job,
    failing_sizing,
    one_line_shards,
    output_rows,
    past_backoff,
    retried_items_job,
    shard_row,
    small_commits,
)
from tests.support.inputs import source_of

__all__ = ["small_commits"]

AGING = 600.0
WINDOW = 300.0  # fair share's window of tokens served


def test_the_backoff_doubles_from_the_setting_up_to_ten_minutes(settings):
    settings.shard_retry_seconds = 10.0
    assert [retry_delay(n, settings) for n in (1, 2, 3, 4)] == [10.0, 20.0, 40.0, 80.0]
    assert retry_delay(30, settings) == 600.0


def test_a_failing_shard_is_counted_backed_off_and_ends_as_error_rows_after_the_bound(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    job_id, (first, second) = retried_items_job(settings, tmp_path, max_failures=3)
    # The second shard ran fine: the job keeps its results whatever the first one does.
    ShardRunner(FakeEngine(), worker="w1", settings=settings).run([second])
    calls: list[str] = []
    failing_sizing(monkeypatch, calls)
    engines = FakeEngines(FakeEngine())

    for failures in (1, 2):
        outcome = process_shard(first, worker="w1", engines=engines, settings=settings)
        assert outcome is Outcome.RETRYING
        shard = shard_row(settings, first)
        assert (shard.status, shard.failures) == (ShardStatus.QUEUED, failures)
        assert shard.error == "TypeError: TextEncodeInput must be Union[TextInputSequence, ...]"
        # Not run again before its backoff, which doubles.
        expected = 30.0 * 2 ** (failures - 1)
        assert expected - 5 < backoff_left(first, settings=settings) <= expected
        past_backoff(settings, first)
        assert backoff_left(first, settings=settings) == 0.0

    outcome = process_shard(first, worker="w1", engines=engines, settings=settings)
    assert outcome is Outcome.FAILED  # its last allowed run: no task is sent again
    assert len(calls) == 3
    shard = shard_row(settings, first)
    assert shard.status is ShardStatus.COMPLETED
    assert shard.failures == 3
    assert "failed 3 times (BATCHLLM_MAX_SHARD_FAILURES)" in shard.error
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert (job.status, job.request_completed, job.request_failed) == (
            JobStatus.COMPLETED,
            8,
            12,
        )
    with session_scope(settings) as session:
        (shown, _) = job_view(session.get(Job, job_id), shards=True)["shards"]
    assert (shown["failures"], shown["error"]) == (3, shard.error)  # what `status` shows
    rows = output_rows(settings, job_id)
    assert len(rows) == 20
    failed = [row for row in rows if row["status"] == "error"]
    assert [row["line"] for row in failed] == list(range(1, 13))
    assert {row["error_code"] for row in failed} == {"shard_failed"}
    assert all("TypeError" in row["error"] for row in failed)


def test_a_shard_that_ended_while_its_run_failed_is_not_counted_again(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    _, (shard_id,) = create_items_job(settings, tmp_path, 5, shard_size=12)
    with session_scope(settings) as session:
        state_machine.end_shard(session, shard_id, ShardStatus.FAILED, "ended elsewhere")

    def fail(*_args, **_kwargs):
        raise RuntimeError("too late")

    monkeypatch.setattr("batchllm.worker.delivery._process_shard", fail)
    assert (
        process_shard(shard_id, worker="w1", engines=FakeEngines(FakeEngine()), settings=settings)
        is Outcome.FAILED
    )
    shard = shard_row(settings, shard_id)
    assert (shard.failures, shard.error) == (0, "ended elsewhere")


def _turn(settings, shard_id: int) -> int:
    with session_scope(settings) as session:
        return next_shard(session, shard_id, aging_seconds=AGING, window_seconds=WINDOW)


def _fail(settings, shard_id: int, delay: float) -> None:
    with session_scope(settings) as session:
        state_machine.count_shard_failure(
            session, shard_id, "TypeError: boom", worker="w1", delay=lambda _n: delay
        )


@pytest.mark.parametrize("own_task", [True, False], ids=["its-own-task", "another-jobs-task"])
def test_fair_share_never_picks_a_shard_that_just_failed_ahead_of_others(
    settings, tmp_path, own_task
):
    # Tenant A's job never started (so it would be first), and its shard just failed.
    (poisoned,) = one_line_shards(settings, tmp_path, "a", 1)
    tenant_b = one_line_shards(settings, tmp_path, "b", 2)
    _fail(settings, poisoned, 60.0)
    task = poisoned if own_task else tenant_b[1]
    assert _turn(settings, task) in tenant_b


def test_a_failed_shard_past_its_backoff_counts_its_failure_as_its_jobs_latest_turn(
    settings, tmp_path
):
    (poisoned,) = one_line_shards(settings, tmp_path, "a", 1)
    tenant_b = one_line_shards(settings, tmp_path, "b", 2)
    _fail(settings, poisoned, 0.0)
    # Its backoff is over, but B never had a turn: B goes first, then A may run again.
    assert _turn(settings, poisoned) == tenant_b[0]
    with session_scope(settings) as session:
        for shard_id in tenant_b:
            state_machine.end_shard(session, shard_id, ShardStatus.COMPLETED)
    assert _turn(settings, poisoned) == poisoned


def test_a_failed_shard_alone_in_its_queue_keeps_its_task_until_its_backoff_ends(
    settings, tmp_path
):
    (poisoned,) = one_line_shards(settings, tmp_path, "a", 1)
    _fail(settings, poisoned, 60.0)
    assert _turn(settings, poisoned) == poisoned
    assert 55 < backoff_left(poisoned, settings=settings) <= 60


class SentTasks:
    """Stands in for the Celery app's send_task: records each task it would publish."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, name: str, args=None, kwargs=None, **options) -> None:
        self.calls.append({"args": tuple(args or ()), **options})


def _deliver(shard_id: int) -> str:
    """run_shard on a delivery of `shard_id`'s task from its queue, as a worker runs it."""
    from batchllm.worker.tasks import run_shard

    run_shard.push_request(
        id="task-1",
        args=[shard_id],
        kwargs={},
        retries=0,
        hostname="celery@w1",
        delivery_info={"routing_key": "q", "exchange": "", "priority": 0},
        called_directly=False,
        is_eager=False,
    )
    try:
        return run_shard.run(shard_id)
    finally:
        run_shard.pop_request()


def test_the_task_of_a_failed_shard_comes_back_after_its_backoff_not_at_once(
    settings, tmp_path, monkeypatch
):
    from batchllm.worker.tasks import run_shard

    settings.shard_retry_seconds = 40.0  # the task reads the same (cached) settings
    sent = SentTasks()
    monkeypatch.setattr(run_shard.app, "send_task", sent)
    (shard_id,) = one_line_shards(settings, tmp_path, "a", 1)
    calls: list[str] = []
    failing_sizing(monkeypatch, calls)

    assert _deliver(shard_id) == "retrying"
    (resent,) = sent.calls
    assert resent["args"] == (shard_id,) and resent["queue"] == "q"
    assert 35 < resent["countdown"] <= 40

    # Delivered early (e.g. the reconciler sent it): it waits out the backoff, unrun.
    assert _deliver(shard_id) == "waiting"
    assert len(calls) == 1
    assert 35 < sent.calls[-1]["countdown"] <= 40
    assert shard_row(settings, shard_id).failures == 1


def test_an_error_mid_shard_keeps_its_committed_rows_and_counts_one_failure(
    small_commits, tmp_path, caplog
):
    settings = small_commits  # commits every 5 rows
    job_id, (shard_id, _) = retried_items_job(settings, tmp_path)

    def bug_at(step: int) -> None:
        if step == 4:
            raise RuntimeError("a bug in the feed")

    engines = FakeEngines(FakeEngine(on_step=bug_at))
    outcome = process_shard(shard_id, worker="w1", engines=engines, settings=settings)

    assert outcome is Outcome.RETRYING  # not failed at once: retried after its backoff
    assert "could not record its end" not in caplog.text  # the runner handed it back itself
    shard = shard_row(settings, shard_id)
    assert (shard.status, shard.failures) == (ShardStatus.QUEUED, 1)
    assert shard.error == "RuntimeError: a bug in the feed"
    kept = len(output_rows(settings, job_id))
    assert 0 < kept < 12  # what finished before the error, committed
    assert 25 < backoff_left(shard_id, settings=settings) <= 30

    # Its next run resumes after the committed rows and completes the shard.
    past_backoff(settings, shard_id)
    assert (
        process_shard(shard_id, worker="w1", engines=FakeEngines(FakeEngine()), settings=settings)
        is Outcome.COMPLETED
    )
    rows = [row for row in output_rows(settings, job_id) if row["line"] <= 12]
    assert sorted(row["line"] for row in rows) == list(range(1, 13))
    assert {row["status"] for row in rows} == {"ok"}
