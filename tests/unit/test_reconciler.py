"""Moving stuck states on: re-claiming a shard by the worker that ran it, cancelling jobs whose
workers are gone, and the reconciler's pass (stale leases, tasks the broker lost, cancelled and
finalizing jobs), on SQLite with the broker replaced by what the test says it holds."""

from __future__ import annotations

import json
import posixpath
from datetime import timedelta

import pytest
from sqlalchemy import update

from batchllm.errors import ShardBusy
from batchllm.execution.runner import ShardRunner
from batchllm.jobs.create import create_job
from batchllm.output.parts import MANIFEST_NAME, SUCCESS_NAME
from batchllm.storage import Storage
from batchllm.store import leases, recovery, service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus, utcnow
from batchllm.worker.celery_app import TASK_RUN_SHARD, queue_for_model
from batchllm.worker.reconciler import reconcile_once
from tests.support.fake_runs import (
    FakeEngine,
    create_items_job,
    job_and_shards,
    job_left_finalizing,
    make_spec,
    output_rows,
    small_commits,
    write_items,
)
from tests.support.inputs import source_of

LEASE = 120.0
QUEUE = queue_for_model(make_spec().model)


class Broker:
    """What the reconciler sees of the broker: the shard ids it holds, and the tasks sent."""

    def __init__(self) -> None:
        self.holds: set[int] = set()
        self.inspected: list[tuple[str, set[str], str]] = []
        self.sent: list[tuple[int, str]] = []

    def shard_ids_in_broker(
        self, url: str, queues: set[str], task_name: str, unacked_grace: float | None = None
    ) -> set[int]:
        self.inspected.append((url, queues, task_name))
        return set(self.holds)

    def send(self, shard_id: int, queue: str) -> None:
        self.sent.append((shard_id, queue))


@pytest.fixture
def broker(settings, monkeypatch) -> Broker:
    settings.lease_seconds = LEASE
    fake = Broker()
    monkeypatch.setattr("batchllm.worker.reconciler.shard_ids_in_broker", fake.shard_ids_in_broker)
    return fake


def claim(settings, shard_id: int, worker: str) -> int:
    with session_scope(settings) as session:
        return leases.claim_shard(session, shard_id, worker, LEASE).attempts


def set_shard(
    settings,
    shard_id: int,
    *,
    heartbeat_age: float | None = None,
    dispatched_age: float | None = None,
) -> None:
    values = {}
    if heartbeat_age is not None:
        values["heartbeat_at"] = utcnow() - timedelta(seconds=heartbeat_age)
    if dispatched_age is not None:
        values["dispatched_at"] = utcnow() - timedelta(seconds=dispatched_age)
    with session_scope(settings) as session:
        session.execute(update(Shard).where(Shard.id == shard_id).values(**values))


# -- claims -------------------------------------------------------------------------------------


def test_the_worker_that_ran_a_shard_can_claim_it_again_while_its_heartbeat_is_fresh(
    settings, tmp_path
):
    _, (shard_id,) = create_items_job(settings, tmp_path, 4, shard_size=4)
    assert claim(settings, shard_id, "w1") == 1

    assert claim(settings, shard_id, "w1") == 2

    with pytest.raises(ShardBusy, match="running on w1"), session_scope(settings) as session:
        leases.claim_shard(session, shard_id, "w2", LEASE)
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_id)
        assert (shard.status, shard.worker, shard.attempts) == (ShardStatus.RUNNING, "w1", 2)
        # The earlier run's attempt is fenced off: it can no longer heartbeat or end the shard.
        assert leases.heartbeat(session, {shard_id: 1}) == {shard_id}
        assert state_machine.end_shard(session, shard_id, ShardStatus.COMPLETED, attempt=1) is None


# -- cancel -------------------------------------------------------------------------------------


def test_cancelling_a_job_whose_running_shard_lost_its_worker_ends_it_cancelled_at_once(
    settings, tmp_path
):
    settings.lease_seconds = LEASE
    job_id, (running, _queued) = create_items_job(settings, tmp_path, 8, shard_size=4)
    claim(settings, running, "dead")
    set_shard(settings, running, heartbeat_age=LEASE + 60)

    with session_scope(settings) as session:
        job = service.cancel_job(session, job_id)
        assert job.status is JobStatus.CANCELLED
        assert job.finished_at is not None

    assert job_and_shards(settings, job_id) == (
        JobStatus.CANCELLED,
        [ShardStatus.CANCELLED, ShardStatus.CANCELLED],
    )
    with session_scope(settings) as session:
        assert session.get(Job, job_id).shards_done == 2


def test_cancelling_a_job_whose_running_shard_is_alive_waits_until_its_lease_runs_out(
    settings, tmp_path
):
    settings.lease_seconds = LEASE
    job_id, (running, _queued) = create_items_job(settings, tmp_path, 8, shard_size=4)
    claim(settings, running, "alive")

    with session_scope(settings) as session:
        assert service.cancel_job(session, job_id).status is JobStatus.CANCELLING
    assert job_and_shards(settings, job_id) == (
        JobStatus.CANCELLING,
        [ShardStatus.RUNNING, ShardStatus.CANCELLED],
    )
    with session_scope(settings) as session:
        assert recovery.end_stale_shards_of_cancelled_jobs(session, LEASE) == []
    assert job_and_shards(settings, job_id)[0] is JobStatus.CANCELLING

    set_shard(settings, running, heartbeat_age=LEASE + 1)
    with session_scope(settings) as session:
        assert recovery.end_stale_shards_of_cancelled_jobs(session, LEASE) == [job_id]
    with session_scope(settings) as session:
        assert recovery.end_stale_shards_of_cancelled_jobs(session, LEASE) == []

    assert job_and_shards(settings, job_id) == (
        JobStatus.CANCELLED,
        [ShardStatus.CANCELLED, ShardStatus.CANCELLED],
    )


# -- the reconciler's pass ----------------------------------------------------------------------


def test_a_running_shard_whose_worker_stopped_heartbeating_is_queued_and_sent_again_once(
    settings, tmp_path, broker
):
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 4, shard_size=4)
    claim(settings, shard_id, "dead")
    assert not reconcile_once(broker.send, settings)  # its heartbeat is fresh
    set_shard(settings, shard_id, heartbeat_age=LEASE + 1)

    first = reconcile_once(broker.send, settings)
    second = reconcile_once(broker.send, settings)

    assert first.requeued_stale == [shard_id]
    assert not second
    assert broker.sent == [(shard_id, QUEUE)]
    assert job_and_shards(settings, job_id) == (JobStatus.IN_PROGRESS, [ShardStatus.QUEUED])
    # Just re-sent: the lost-task check leaves it alone until a lease has passed.
    assert broker.inspected == []
    with session_scope(settings) as session:
        assert leases.claim_shard(session, shard_id, "w2", LEASE).attempts == 2


def test_a_queued_shard_whose_task_the_broker_lost_is_sent_again_once(settings, tmp_path, broker):
    job_id, (lost, just_sent) = create_items_job(settings, tmp_path, 8, shard_size=4)
    set_shard(settings, lost, dispatched_age=LEASE + 1)
    set_shard(settings, just_sent, dispatched_age=1)

    first = reconcile_once(broker.send, settings)
    second = reconcile_once(broker.send, settings)

    assert first.resent_lost == [lost]
    assert not second
    assert broker.sent == [(lost, QUEUE)]
    assert broker.inspected == [(settings.broker_url, {QUEUE}, TASK_RUN_SHARD)]
    assert job_and_shards(settings, job_id) == (JobStatus.QUEUED, [ShardStatus.QUEUED] * 2)


def test_a_queued_shard_whose_task_the_broker_still_holds_is_not_sent_again(
    settings, tmp_path, broker
):
    _, (shard_id,) = create_items_job(settings, tmp_path, 4, shard_size=4)
    set_shard(settings, shard_id, dispatched_age=LEASE + 1)
    broker.holds = {shard_id}

    assert not reconcile_once(broker.send, settings)
    assert not reconcile_once(broker.send, settings)

    assert broker.sent == []
    assert len(broker.inspected) == 2  # still old enough to look for it on every pass


def test_a_cancelling_job_whose_only_running_shard_lost_its_worker_ends_cancelled(
    settings, tmp_path, broker
):
    job_id, (shard_id,) = create_items_job(settings, tmp_path, 4, shard_size=4)
    claim(settings, shard_id, "dead")
    with session_scope(settings) as session:
        assert service.cancel_job(session, job_id).status is JobStatus.CANCELLING
    assert not reconcile_once(broker.send, settings)
    set_shard(settings, shard_id, heartbeat_age=LEASE + 1)

    done = reconcile_once(broker.send, settings)

    assert done.cancelled_jobs == [job_id]
    assert done.requeued_stale == [] and broker.sent == []
    assert job_and_shards(settings, job_id) == (JobStatus.CANCELLED, [ShardStatus.CANCELLED])
    assert not reconcile_once(broker.send, settings)


def test_a_job_left_finalizing_is_completed_with_the_hardware_recorded_at_its_first_step(
    small_commits, tmp_path, broker, monkeypatch
):
    settings = small_commits
    job_id, _ = job_left_finalizing(
        settings, tmp_path, monkeypatch, hardware="8x H100 80GB", vllm_version="0.99.0"
    )
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job_id)
    assert not storage.exists(posixpath.join(out_dir, SUCCESS_NAME))

    done = reconcile_once(broker.send, settings)

    assert done.finalized_jobs == [job_id]
    assert not reconcile_once(broker.send, settings)
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED
        assert (job.hardware, job.vllm_version) == ("8x H100 80GB", "0.99.0")
        assert (job.request_completed, job.request_failed) == (20, 0)
        assert job.requests_per_s > 0
    assert storage.exists(posixpath.join(out_dir, SUCCESS_NAME))
    manifest = json.loads(storage.read_bytes(posixpath.join(out_dir, MANIFEST_NAME)))
    assert (manifest["job_id"], manifest["status"]) == (job_id, "completed")
    assert (manifest["hardware"], manifest["vllm_version"]) == ("8x H100 80GB", "0.99.0")
    assert manifest["rows"] == {"total": 20, "ok": 20, "error": 0}
    assert sorted(r["line"] for r in output_rows(settings, job_id)) == list(range(1, 21))
    assert broker.sent == []


def test_the_shards_of_a_local_run_are_never_sent_to_the_fleet_and_a_killed_run_ends_failed(
    settings, broker, tmp_path
):
    created = create_job(
        source_of(write_items(tmp_path / "in.jsonl", 8), settings),
        make_spec(),
        shard_size=4,
        settings=settings,
        local_run=True,
    )
    with session_scope(settings) as session:
        running, queued = [s.id for s in session.get(Job, created.job.id).shards]
    claim(settings, running, "local@host")
    set_shard(settings, running, heartbeat_age=LEASE + 5)  # the `batchllm run` was killed
    set_shard(settings, queued, dispatched_age=LEASE + 5)

    reconcile_once(broker.send, settings)
    assert broker.sent == []
    with session_scope(settings) as session:
        assert recovery.fail_abandoned_local_runs(session, LEASE) == [created.job.id]
    status, _ = job_and_shards(settings, created.job.id)
    assert status is JobStatus.FAILED
