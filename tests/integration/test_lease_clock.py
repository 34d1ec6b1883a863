"""Leases on PostgreSQL read the database's clock, not the worker's: a worker whose clock is an
hour off (the chaos run's clock-step fault) neither takes over a live shard nor writes a
heartbeat that looks stale to the others (batchllm/store/clock.py)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from batchllm.jobs.create import create_job
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.store import clock, leases, models, recovery, state_machine
from batchllm.store.db import get_engine, session_scope, upgrade
from batchllm.store.models import Job, Shard, ShardStatus
from tests.support.inputs import source_of
from tests.support.services import postgres_database

HOUR = timedelta(hours=1)


@pytest.fixture
def pg_settings(tmp_path: Path):
    with postgres_database(f"batchllm_clock_{uuid.uuid4().hex[:12]}") as url:
        upgrade(url)
        settings = Settings(home=tmp_path / "home", database_url=url)
        yield settings
        get_engine(settings).dispose()


def a_running_shard(settings: Settings, tmp_path: Path, worker: str) -> int:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(4)))
    created = create_job(
        source_of(source, settings), JobSpec(model="m"), shard_size=4, settings=settings
    )
    with session_scope(settings) as session:
        shard_id = session.get(Job, created.job.id).shards[0].id
        assert leases.claim_shard(session, shard_id, worker, lease_seconds=60) is not None
    return shard_id


def step_process_clock(monkeypatch: pytest.MonkeyPatch, by: timedelta) -> None:
    """The process's UTC clock, as batchllm's store reads it (utcnow, wherever imported), `by`
    off."""
    stepped = lambda: models.datetime.now(models.timezone.utc) + by  # noqa: E731
    for module in (models, clock, leases, recovery, state_machine):
        monkeypatch.setattr(module, "utcnow", stepped, raising=False)


def test_a_worker_an_hour_ahead_takes_over_no_live_shard(pg_settings, tmp_path, monkeypatch):
    shard_id = a_running_shard(pg_settings, tmp_path, "w1")
    step_process_clock(monkeypatch, HOUR)
    with session_scope(pg_settings) as session:
        assert leases.requeue_stale_shards(session, lease_seconds=60) == []
        shard = session.get(Shard, shard_id)
        assert (shard.status, shard.worker) == (ShardStatus.RUNNING, "w1")


def test_a_worker_an_hour_behind_heartbeats_in_the_databases_time(
    pg_settings, tmp_path, monkeypatch
):
    shard_id = a_running_shard(pg_settings, tmp_path, "w1")
    step_process_clock(monkeypatch, -HOUR)
    with session_scope(pg_settings) as session:
        assert leases.heartbeat(session, {shard_id: 1}) == set()
    with session_scope(pg_settings) as session:
        server_now = session.execute(select(func.now())).scalar_one()
        beat = session.get(Shard, shard_id).heartbeat_at
        assert abs(server_now - beat) < timedelta(seconds=30), (beat, server_now)
    monkeypatch.undo()  # another worker, its clock right, finds the shard alive
    with session_scope(pg_settings) as session:
        assert leases.requeue_stale_shards(session, lease_seconds=60) == []


def test_on_sqlite_the_lease_clock_is_the_process_clock(settings, monkeypatch):
    step_process_clock(monkeypatch, HOUR)
    with session_scope(settings) as session:
        ahead = clock.lease_clock(session) - models.datetime.now(models.timezone.utc)
    assert HOUR - timedelta(seconds=5) < ahead <= HOUR
