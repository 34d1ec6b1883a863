"""The indexes a long history needs (migrations 0011 and 0015, measured by
benchmarks/history.py on 10,000 and 100,000 jobs): the migrated schema has them, SQLite's planner
uses them for the queries that scanned every job or shard, listing batches costs the same few
statements for any page, and a key's quota and the dashboard's jobs page read no more of its
history than they show."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, inspect, select, update

from batchllm.api import batches, enqueued
from batchllm.api.app import create_app
from batchllm.api.dashboard import queries, routes
from batchllm.api.dashboard.session import Viewer
from batchllm.api.keys import create_key
from batchllm.settings import Settings
from batchllm.store.db import alembic_config, get_engine, session_scope, upgrade
from batchllm.store.models import (
    Base,
    Batch,
    Checkpoint,
    Job,
    Shard,
    ShardStatus,
    StoredFile,
    job_id_of,
    utcnow,
)
from batchllm.store.states import JobStatus
from batchllm.worker.fair_share import tenants_served
from benchmarks.history import MODEL, StatementLog, populate


def _settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'b.db'}")


def _plan(engine, statement) -> str:
    sql = str(statement.compile(engine, compile_kwargs={"literal_binds": True}))
    with engine.connect() as conn:
        return " ".join(row[-1] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))


def test_the_migrated_schema_has_every_index_the_models_declare(tmp_path):
    engine = get_engine(_settings(tmp_path))
    inspector = inspect(engine)
    for table in ("jobs", "shards", "batches", "checkpoints"):
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
            assert [job_id_of(b["id"]) for b in page["data"]] == ids[::-1][:limit]
            counts[limit] = len(statements)
    assert counts[30] == counts[2] <= 10


def test_fair_share_reads_the_windows_checkpoints_not_the_models_history(tmp_path):
    # Every shard task's turn reads it (worker/fair_share.py). Joined from the model's jobs,
    # SQLite's planner walked every job of the model and every checkpoint of each.
    settings = _settings(tmp_path)
    populate(settings, 300, owner="key_hist", live=2, shards_per_job=2)
    engine = get_engine(settings)
    with engine.begin() as conn:  # populate() counts no tokens: 10 a checkpoint
        conn.execute(update(Checkpoint).values(prompt_tokens=7, completion_tokens=3))
    log = StatementLog(engine)
    now = utcnow()
    with session_scope(settings) as session, log.recording() as statements:
        # populate()'s job n was created (and checkpointed) 300 - n minutes ago: the last
        # two are in a 150 s window.
        served = tenants_served(session, MODEL, {"key_hist"}, now=now, window=150)
    with session_scope(settings) as session:
        in_window = session.scalar(
            select(func.count())
            .select_from(Checkpoint)
            .where(Checkpoint.created_at >= now - timedelta(seconds=150))
        )
    assert 0 < in_window <= 20 and served == {"key_hist": 10.0 * in_window}
    plans = _plans(engine, statements)
    assert "ix_checkpoints_created_at" in plans[0], plans
    assert "SEARCH shards USING INTEGER PRIMARY KEY" in plans[1], plans
    assert not any("ix_jobs_model" in plan or "SCAN jobs" in plan for plan in plans), plans


def _plans(engine, statements) -> list[str]:
    """Each recorded read's plan (SQLite's EXPLAIN QUERY PLAN), one line each."""
    with engine.connect() as conn:
        return [
            " ".join(row[-1] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params))
            for _, sql, params in statements
            if sql.lstrip().upper().startswith(("SELECT", "WITH"))
        ]


def test_a_keys_quota_is_read_from_the_unfinished_jobs_not_from_its_history(tmp_path):
    # Every GET /v1/batches and dashboard refresh reads them. Joined from the key's batches,
    # SQLite's planner walked every batch the key ever made (0.2 s at 100,000).
    settings = _settings(tmp_path)
    with session_scope(settings) as session:
        key_row, _ = create_key(session, "bench")
        other, _ = create_key(session, "other")
    ids = populate(
        settings, 30, owner=key_row.id, live=3, shards_per_job=1, checkpoints_per_shard=0
    )
    with session_scope(settings) as session:
        # The newest batch's file says 7 lines; the others' jobs 10,000 each, none done.
        session.add(
            StoredFile(
                id=f"file-{ids[-1]}",
                owner=key_row.id,
                filename="in.jsonl",
                purpose="batch",
                bytes=1,
                lines=7,
                path="in.jsonl",
            )
        )
        session.add(
            Job(
                id="job_other",
                status=JobStatus.QUEUED,
                model="other-model",
                spec={},
                input_file="in.jsonl",
                storage_root="/jobs",
                output_dir="out",
                request_total=50,
            )
        )
        session.add(
            Batch(
                job_id="job_other",
                owner=other.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                input_file_id="file-y",
            )
        )
    engine = get_engine(settings)
    log = StatementLog(engine)
    with session_scope(settings) as session, log.recording() as statements:
        rows = enqueued.enqueued_rows(session, key_row.id)
        active = batches.active_batches(session, key_row.id)
        tokens = enqueued.enqueued_tokens_by_model(session, key_row.id)
        of_model = enqueued.enqueued_tokens(session, key_row.id, MODEL)
        assert session.get(Batch, "job_other").model == "other-model"  # its job's, unsaid
    assert (rows, active) == (2 * 10_000 + 7, 3)
    assert set(tokens.values()) == {0} and of_model == 0  # populate() estimates none
    plans = _plans(engine, statements[:4])
    assert all("SEARCH jobs USING INDEX ix_jobs_status" in plan for plan in plans), plans
    assert not any("ix_batches_owner" in plan for plan in plans), plans
    with session_scope(settings) as session:
        assert (
            enqueued.enqueued_rows(session, other.id),
            batches.active_batches(session, other.id),
        ) == (50, 1)


def test_the_dashboards_jobs_page_reads_no_more_of_a_long_history_than_it_shows(
    tmp_path, monkeypatch
):
    settings = _settings(tmp_path)
    with session_scope(settings) as session:
        key_row, _ = create_key(session, "bench")
    ids = populate(
        settings, 45, owner=key_row.id, live=2, shards_per_job=1, checkpoints_per_shard=0
    )
    newest = ids[::-1]
    engine = get_engine(settings)
    log = StatementLog(engine)
    monkeypatch.setattr(queries, "COUNT_STEP", 20)  # counted to 40 rows for page 1, 60 for 2
    viewer = Viewer(owner=key_row.id, name="bench", admin=False, login=True)
    with session_scope(settings) as session, log.recording() as statements:
        first = queries.job_page(session, viewer, status=None, model=None, page=1)
        quota = queries.key_quota(session, viewer, settings)
    assert [job["id"] for job in first["jobs"]] == newest[:20]
    plans = _plans(engine, statements)
    # Read along the key's indexes: no statement sorts (or counts) every one of its jobs, and
    # its models are found one index step each.
    assert not any("TEMP B-TREE FOR ORDER BY" in plan for plan in plans), plans
    assert not any("TEMP B-TREE FOR DISTINCT" in plan for plan in plans), plans
    assert any("ix_batches_owner_model_created_at (owner=? AND model>?)" in p for p in plans)
    assert (first["total"], first["more"], first["pages"]) == (40, True, 2)
    assert first["models"] == [MODEL]
    text = routes.templates.get_template("jobs_live.html").render(
        **first, quota=quota, live_url="", query={}, status="", model=""
    )
    assert "page 1 of more than 2 · more than 40 jobs" in " ".join(text.split())
    with session_scope(settings) as session:
        second = queries.job_page(session, viewer, status=None, model=None, page=2)
        past = queries.job_page(session, viewer, status=None, model=None, page=10**18)
        by_model = queries.job_page(session, viewer, status=None, model=MODEL, page=3)
        running = queries.job_page(session, viewer, status="in_progress", model=None, page=1)
    assert (second["total"], second["more"], second["pages"]) == (45, False, 3)
    assert [job["id"] for job in second["jobs"]] == newest[20:40]
    assert (past["page"], [job["id"] for job in past["jobs"]]) == (3, newest[40:])
    assert (by_model["page"], [job["id"] for job in by_model["jobs"]]) == (3, newest[40:])
    assert ([job["id"] for job in running["jobs"]], running["total"]) == (newest[:2], 2)


def test_the_migration_gives_each_batch_its_jobs_model(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    command.upgrade(alembic_config(url), "0014")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO jobs (id, status, model, spec, metadata, input_file, storage_root, "
            "output_dir, local_run, request_total, request_completed, request_failed, "
            "shards_total, shards_done, created_at, prompt_tokens, completion_tokens, "
            "cached_tokens, engine_seconds) VALUES ('job_1', 'completed', 'm-1', '{}', '{}', "
            "'in', '/jobs', 'out', 0, 1, 1, 0, 1, 1, CURRENT_TIMESTAMP, 0, 0, 0, 0)"
        )
        conn.exec_driver_sql(
            "INSERT INTO batches (job_id, owner, endpoint, completion_window, input_file_id, "
            "created_at) VALUES ('job_1', 'key_1', '/v1/chat/completions', '24h', 'file-1', "
            "CURRENT_TIMESTAMP)"
        )
    upgrade(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT job_id, model FROM batches").all() == [("job_1", "m-1")]
    model = next(c for c in inspect(engine).get_columns("batches") if c["name"] == "model")
    assert model["nullable"] is False
    engine.dispose()
