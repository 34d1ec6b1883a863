"""process_shard's branches that need no engine: a job left finalizing, a cancelling job, a
shard or job that has already gone; on SQLite, with an engine source that must not be used."""

from __future__ import annotations

import json
import posixpath
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.output import commit
from batchllm.output.parts import MANIFEST_NAME, SUCCESS_NAME
from batchllm.storage import Storage
from batchllm.store import leases, service
from batchllm.store.db import session_scope
from batchllm.store.models import Checkpoint, Job, JobStatus, Shard, ShardStatus, utcnow
from batchllm.worker.delivery import (
    RETRY_BUSY_SECONDS,
    RETRY_WAITING_SECONDS,
    database_retry_seconds,
    process_shard,
    send_again_after,
)
from tests.support.fake_runs import (
    FakeEngine,
    age_heartbeat,
    create_items_job,
    job_and_shards,
    job_left_finalizing,
    make_spec,
    output_rows,
    small_commits,
    write_items,
)


class NoEngines:
    """An EngineSource with no engine up, which fails the test if one is asked for."""

    engine = None

    def __init__(self) -> None:
        self.closed = 0

    def get(self, spec, max_model_len):
        pytest.fail("process_shard asked for an engine where none is needed")

    def close(self) -> None:
        self.closed += 1


def test_a_shard_of_a_job_left_finalizing_completes_the_job_without_an_engine(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    job_id, shard_ids = job_left_finalizing(
        settings, tmp_path, monkeypatch, hardware="4x L40S 48GB", vllm_version="0.42.1"
    )
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job_id)
    # A part file no checkpoint records (its worker died before the commit) is not output.
    orphan = posixpath.join(out_dir, "part-s00001-a9-00077.parquet")
    storage.write_bytes(orphan, b"never committed")
    engines = NoEngines()

    outcome = process_shard(shard_ids[1], worker="w2", engines=engines, settings=settings)

    assert outcome is Outcome.SKIPPED
    assert engines.closed == 0
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED
        assert (job.hardware, job.vllm_version) == ("4x L40S 48GB", "0.42.1")
        assert (job.request_completed, job.request_failed) == (20, 0)
        assert job.finished_at is not None
        assert job.requests_per_s > 0
    assert storage.exists(posixpath.join(out_dir, SUCCESS_NAME))
    assert not storage.exists(orphan)
    manifest = json.loads(storage.read_bytes(posixpath.join(out_dir, MANIFEST_NAME)))
    assert (manifest["job_id"], manifest["status"]) == (job_id, "completed")
    assert (manifest["hardware"], manifest["vllm_version"]) == ("4x L40S 48GB", "0.42.1")
    assert manifest["rows"] == {"total": 20, "ok": 20, "error": 0}
    assert sorted(r["line"] for r in output_rows(settings, job_id)) == list(range(1, 21))


def test_a_job_finalized_by_the_first_delivery_is_skipped_by_the_next(small_commits, tmp_path):
    settings = small_commits
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 5, shard_size=10)
    with session_scope(settings) as session:
        session.execute(
            update(Shard).where(Shard.id == shard_id).values(status=ShardStatus.COMPLETED)
        )
        session.execute(
            update(Job).where(Job.id == job_id).values(status=JobStatus.FINALIZING, shards_done=1)
        )
    storage = Storage.of(settings)
    manifest_path = posixpath.join(storage.output_dir(job_id), MANIFEST_NAME)

    assert (
        process_shard(shard_id, worker="w1", engines=NoEngines(), settings=settings)
        is Outcome.SKIPPED
    )
    first_manifest = storage.read_bytes(manifest_path)
    assert (
        process_shard(shard_id, worker="w2", engines=NoEngines(), settings=settings)
        is Outcome.SKIPPED
    )

    assert storage.read_bytes(manifest_path) == first_manifest
    assert json.loads(first_manifest)["hardware"] is None  # no engine step was ever recorded
    assert job_and_shards(settings, job_id) == (JobStatus.COMPLETED, [ShardStatus.COMPLETED])


def test_a_running_shard_of_a_cancelling_job_ends_cancelled_without_an_engine(settings, tmp_path):
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 6, shard_size=10)
    with session_scope(settings) as session:
        leases.claim_shard(session, shard_id, "w1", settings.lease_seconds)
    with session_scope(settings) as session:
        # w1's heartbeat is fresh: the cancel leaves its shard to it, and w1 then dies.
        service.cancel_job(session, job_id, lease_seconds=settings.lease_seconds)
    assert job_and_shards(settings, job_id) == (JobStatus.CANCELLING, [ShardStatus.RUNNING])
    # w1 dies: its heartbeat goes stale
    age_heartbeat(settings, shard_id, timedelta(seconds=settings.lease_seconds + 5))
    engines = NoEngines()

    outcome = process_shard(shard_id, worker="w2", engines=engines, settings=settings)

    assert outcome is Outcome.CANCELLED
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_id)
        assert shard.status is ShardStatus.CANCELLED
        assert shard.finished_at is not None
        assert session.get(Job, job_id).shards_done == 1
        assert session.scalar(select(func.count()).select_from(Checkpoint)) == 0
    assert output_rows(settings, job_id) == []


def test_a_queued_shard_of_a_cancelling_job_ends_cancelled_without_an_engine(settings, tmp_path):
    job_id, shard_ids = create_items_job(settings, tmp_path, 6, shard_size=3)
    with session_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.CANCELLING))

    outcome = process_shard(shard_ids[0], worker="w1", engines=NoEngines(), settings=settings)

    assert outcome is Outcome.CANCELLED
    assert job_and_shards(settings, job_id)[1] == [ShardStatus.CANCELLED, ShardStatus.QUEUED]


def test_a_shard_that_no_longer_exists_is_skipped(settings, tmp_path):
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 3, shard_size=10)
    engines = NoEngines()

    assert (
        process_shard(shard_id + 1000, worker="w1", engines=engines, settings=settings)
        is Outcome.SKIPPED
    )
    assert engines.closed == 0
    assert job_and_shards(settings, job_id) == (JobStatus.QUEUED, [ShardStatus.QUEUED])


@pytest.mark.parametrize("final", [JobStatus.COMPLETED, JobStatus.CANCELLED, JobStatus.FAILED])
def test_a_shard_of_a_job_that_already_ended_is_skipped_and_left_as_it_was(
    final, settings, tmp_path
):
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 3, shard_size=10)
    with session_scope(settings) as session:
        session.execute(update(Job).where(Job.id == job_id).values(status=final))

    outcome = process_shard(shard_id, worker="w1", engines=NoEngines(), settings=settings)

    assert outcome is Outcome.SKIPPED
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_id)
        assert (shard.status, shard.attempts, shard.worker) == (ShardStatus.QUEUED, 0, None)
        assert session.get(Job, job_id).status is final
    storage = Storage.of(settings)
    assert not storage.exists(posixpath.join(storage.output_dir(job_id), MANIFEST_NAME))


def test_the_last_shard_of_a_cancelling_job_ending_in_process_shard_ends_the_job_cancelled(
    settings, tmp_path
):
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 6, shard_size=10)
    with session_scope(settings) as session:
        leases.claim_shard(session, shard_id, "w1", settings.lease_seconds)
    with session_scope(settings) as session:
        service.cancel_job(session, job_id, lease_seconds=settings.lease_seconds)
    # w1 is alive: a delivery elsewhere leaves the shard to it (it keeps its finished rows).
    process_shard(shard_id, worker="w2", engines=NoEngines(), settings=settings)
    assert job_and_shards(settings, job_id) == (JobStatus.CANCELLING, [ShardStatus.RUNNING])

    # w1 dies: its heartbeat goes stale
    age_heartbeat(settings, shard_id, timedelta(seconds=settings.lease_seconds + 5))
    process_shard(shard_id, worker="w2", engines=NoEngines(), settings=settings)

    assert job_and_shards(settings, job_id) == (JobStatus.CANCELLED, [ShardStatus.CANCELLED])


def test_a_cancelled_job_keeps_only_its_committed_part_files(small_commits, tmp_path):
    """A part file no checkpoint records (its worker died before the commit) is not output of
    a job that ends cancelled either: readers of the directory see committed rows only. The
    state machine only ends the job; the commit protocol's owner deletes the file as the
    transaction commits, with no call from the caller."""
    settings = small_commits
    job_id, _ = create_items_job(settings, tmp_path, 20, shard_size=12)
    storage = Storage.of(settings)
    orphan = posixpath.join(storage.output_dir(job_id), "part-s00000-a001-00000.parquet")
    storage.write_bytes(orphan, b"never committed")

    with session_scope(settings) as session:
        job = service.cancel_job(session, job_id)
        assert job.status is JobStatus.CANCELLED
        assert storage.exists(orphan)  # until the end commits

    assert not storage.exists(orphan)


def test_when_a_task_is_sent_again_follows_the_outcome_of_its_delivery(settings, tmp_path):
    _, shard_ids = create_items_job(settings, tmp_path, 4, shard_size=2)
    first, second = shard_ids
    with session_scope(settings) as session:
        session.execute(
            update(Shard).where(Shard.id == first).values(retry_at=utcnow() + timedelta(seconds=40))
        )

    def again(outcome: Outcome, shard_id: int = first, delivered: int = first) -> float | None:
        return send_again_after(outcome, shard_id, delivered=delivered, settings=settings)

    # Handed back: at once; its rows must never wait on a task that is gone.
    assert again(Outcome.INTERRUPTED) == 0.0 and again(Outcome.ENGINE_DIED) == 0.0
    # A counted failure comes back after the shard's own backoff...
    assert 35 < (again(Outcome.RETRYING) or 0) <= 40
    # ...unless it ran in another shard's turn: its own task is still in the broker.
    assert again(Outcome.RETRYING, shard_id=first, delivered=second) is None
    assert again(Outcome.WAITING) == RETRY_WAITING_SECONDS
    assert again(Outcome.BUSY) == RETRY_BUSY_SECONDS
    for ended in (Outcome.COMPLETED, Outcome.FAILED, Outcome.CANCELLED, Outcome.SKIPPED):
        assert again(ended) is None
    assert again(Outcome.LOST) is None  # the worker that took it over has its task
    assert [database_retry_seconds(n) for n in range(6)] == [5, 10, 20, 40, 60, 60]
