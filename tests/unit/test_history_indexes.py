"""The indexes a long history needs (migration 0011, measured by benchmarks/history.py on
10,000 jobs): the migrated schema has them, SQLite's planner uses them for the queries that
scanned every job or shard, and listing batches costs the same few statements for any page."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import inspect, select

from batchllm.api.app import create_app
from batchllm.api.keys import create_key
from batchllm.settings import Settings
from batchllm.store.db import get_engine, session_scope
from batchllm.store.models import Base, Batch, Job, Shard, ShardStatus
from benchmarks.history import StatementLog, populate


def _settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'b.db'}")


def _plan(engine, statement) -> str:
    sql = str(statement.compile(engine, compile_kwargs={"literal_binds": True}))
    with engine.connect() as conn:
        return " ".join(row[-1] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))


def test_the_migrated_schema_has_every_index_the_models_declare(tmp_path):
    engine = get_engine(_settings(tmp_path))
    inspector = inspect(engine)
    for table in ("jobs", "shards", "batches"):
        declared = {i.name for i in Base.metadata.tables[table].indexes}
        assert declared <= {i["name"] for i in inspector.get_indexes(table)}, table
    assert {"ix_jobs_created_at", "ix_jobs_notified_status"} <= {
        i["name"] for i in inspector.get_indexes("jobs")
    }


def test_the_newest_jobs_running_shards_and_a_keys_batches_are_read_through_indexes(tmp_path):
    engine = get_engine(_settings(tmp_path))
    newest = select(Job.id).order_by(Job.created_at.desc()).limit(20)
    running = select(Shard.id).where(Shard.status == ShardStatus.RUNNING)
    batches = select(Batch.job_id).where(Batch.owner == "key_1").order_by(Batch.created_at.desc())
    assert "ix_jobs_created_at" in _plan(engine, newest)
    assert "ix_shards_status" in _plan(engine, running)
    assert "ix_batches_owner_created_at" in _plan(engine, batches)


def test_listing_batches_sends_the_same_few_statements_for_any_page_size(tmp_path):
    settings = _settings(tmp_path)
    with session_scope(settings) as session:
        key_row, key = create_key(session, "bench")
    ids = populate(settings, 40, owner=key_row.id, live=2)
    log = StatementLog(get_engine(settings))
    headers = {"Authorization": f"Bearer {key}"}
    counts = {}
    with TestClient(create_app(settings)) as client:
        # The key is looked up once, then trusted for a few seconds (api/auth.py): both pages
        # are counted with it known.
        assert client.get("/v1/batches?limit=1", headers=headers).status_code == 200
        for limit in (2, 30):
            with log.recording() as statements:
                page = client.get(f"/v1/batches?limit={limit}", headers=headers).json()
            assert [b["id"] for b in page["data"]] == ids[::-1][:limit]
            counts[limit] = len(statements)
    assert counts[30] == counts[2] <= 10
