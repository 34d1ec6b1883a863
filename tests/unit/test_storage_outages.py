"""A storage that is away for a while (an S3 endpoint answering 503 or SLOW_DOWN, a full disk)
is not a shard's fault: the shard goes back without using up BATCHLLM_MAX_SHARD_FAILURES, and a
shard that gives up while its storage is away waits for it instead of ending with lines that
have no row (found by the chaos run's 20-second S3 outage: benchmarks/chaos.py --faults
s3-errors --s3-seconds 20). SQLite, no engine."""

from __future__ import annotations

import errno
from datetime import timedelta

from sqlalchemy import update

from batchllm.execution.runner import Outcome
from batchllm.execution.shard_state import ShardState
from batchllm.storage import storage_unavailable
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus, utcnow
from batchllm.worker.delivery import process_shard
from tests.support.fake_runs import (
    FakeEngine,
    FakeEngines,
    failing_sizing,
    output_rows,
    past_backoff,
    retried_items_job,
    shard_row,
    small_commits,
)

__all__ = ["small_commits"]

S3_503 = OSError(
    "When initiating multiple part upload for key 'jobs/j/output/part-s00000-a001-00000.parquet'"
    " in bucket 'b': AWS Error UNKNOWN (HTTP status 503) during CreateMultipartUpload operation"
)


class _Outage:
    """ShardState.commit fails as the storage would while `away`."""

    def __init__(self, monkeypatch, error: OSError) -> None:
        self.away, self.error, self.refused = True, error, 0
        real = ShardState.commit

        def commit(state, settings):
            if self.away:
                self.refused += 1
                raise OSError(*self.error.args)  # a new one each time, as the storage's
            return real(state, settings)

        monkeypatch.setattr(ShardState, "commit", commit)


def test_the_errors_of_a_storage_that_is_away_are_told_from_the_ones_that_recur():
    assert storage_unavailable(S3_503)
    assert storage_unavailable(OSError("AWS Error SLOW_DOWN during CreateMultipartUpload"))
    assert storage_unavailable(
        OSError("AWS Error NETWORK_CONNECTION during HeadObject: curlCode: 7")
    )
    assert storage_unavailable(OSError(errno.ENOSPC, "No space left on device"))
    assert storage_unavailable(ConnectionResetError())
    try:
        try:
            raise S3_503
        except OSError as inner:
            raise RuntimeError("the commit failed") from inner
    except RuntimeError as wrapped:
        assert storage_unavailable(wrapped)
    assert not storage_unavailable(OSError("AWS Error ACCESS_DENIED (HTTP status 403)"))
    assert not storage_unavailable(FileNotFoundError(errno.ENOENT, "no such file"))
    assert not storage_unavailable(TypeError("a bug"))


def test_a_storage_outage_puts_the_shard_back_without_counting_it_and_loses_no_line(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    job_id, (first, second) = retried_items_job(settings, tmp_path, max_failures=2)
    outage = _Outage(monkeypatch, S3_503)
    engines = FakeEngines(FakeEngine())
    # Five failed runs, more than the shard's bound of two: none of them counted.
    for _ in range(5):
        outcome = process_shard(first, worker="w1", engines=engines, settings=settings)
        assert outcome is Outcome.RETRYING
        shard = shard_row(settings, first)
        assert (shard.status, shard.failures) == (ShardStatus.QUEUED, 0)
        assert "HTTP status 503" in (shard.error or "")
        assert shard.retry_at is not None and shard.retry_at > utcnow()
        past_backoff(settings, first)
    assert outage.refused >= 5  # each run's commit, and its last try as the run fails
    outage.away = False  # the storage is back
    for shard_id in (first, second):
        outcome = process_shard(shard_id, worker="w1", engines=engines, settings=settings)
        assert outcome is Outcome.COMPLETED
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert (job.status, job.request_completed, job.request_failed) == (
            JobStatus.COMPLETED,
            20,
            0,
        )
    rows = output_rows(settings, job_id)
    assert [row["line"] for row in rows] == list(range(1, 21))
    assert {row["status"] for row in rows} == {"ok"}


def test_a_shard_giving_up_while_its_storage_is_away_waits_and_then_writes_a_row_per_line(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    job_id, (first, second) = retried_items_job(settings, tmp_path, max_failures=1)
    failing_sizing(monkeypatch)
    outage = _Outage(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    engines = FakeEngines(FakeEngine())
    # Its one allowed failure is used up: it gives up, but its error rows cannot be written.
    outcome = process_shard(first, worker="w1", engines=engines, settings=settings)
    assert outcome is Outcome.RETRYING  # not ended: a task comes back after the backoff
    shard = shard_row(settings, first)
    assert (shard.status, shard.failures) == (ShardStatus.QUEUED, 1)
    assert "No space left on device" in (shard.error or "")
    assert outage.refused >= 1
    with session_scope(settings) as session:
        assert session.get(Job, job_id).status is not JobStatus.FAILED
    outage.away = False
    past_backoff(settings, first)
    outcome = process_shard(first, worker="w1", engines=engines, settings=settings)
    assert outcome is Outcome.FAILED  # gave up for good: its rows are error rows now
    assert shard_row(settings, first).status is ShardStatus.COMPLETED
    monkeypatch.undo()
    outcome = process_shard(second, worker="w1", engines=engines, settings=settings)
    assert outcome is Outcome.COMPLETED
    rows = output_rows(settings, job_id)
    assert [row["line"] for row in rows] == list(range(1, 21))  # a row for every line
    assert {row["error_code"] for row in rows[:12]} == {"shard_failed"}
    assert {row["status"] for row in rows[12:]} == {"ok"}
    with session_scope(settings) as session:
        assert session.get(Job, job_id).status is JobStatus.COMPLETED
