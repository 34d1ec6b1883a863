"""The Parquet output contract as downstream readers see it, and the job lifecycle in SQL."""

from __future__ import annotations

import json
import posixpath
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from sqlalchemy import create_engine, inspect, select

from batchllm.errors import JobNotFound, JobStateError
from batchllm.jobs.create import create_job
from batchllm.output import commit
from batchllm.output.parts import (
    MANIFEST_NAME,
    OUTPUT_SCHEMA,
    SUCCESS_NAME,
    part_name,
    read_lines,
    read_output,
    write_manifest,
)
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store import leases, service, state_machine
from batchllm.store.db import session_scope, upgrade
from batchllm.store.models import Checkpoint, Job, JobStatus, Shard, ShardStatus
from tests.support.inputs import source_of
from tests.support.output_rows import OutputRow, record_part, write_part

# -- Parquet output --------------------------------------------------------------------------

EXPECTED = [
    ("a", 1, "ok", "hello", 3, 2),
    ("b", 2, "error", None, None, None),
    ("c", 3, "ok", "world", 4, 5),
    ("d", 5, "ok", "again", 6, 1),
]


@pytest.fixture
def output_dir(tmp_path: Path) -> tuple[Storage, str]:
    """Two committed part files, a manifest, _SUCCESS and a leftover temporary file."""
    storage = Storage(str(tmp_path / "store"))
    out_dir = storage.output_dir("job_test")
    storage.makedirs(out_dir)
    rows = [
        OutputRow(
            custom_id=c,
            line=n,
            status=s,
            text=t,
            finish_reason="length" if t else None,
            prompt_tokens=p,
            completion_tokens=k,
            error="field 'prompt': prompt is blank" if s == "error" else None,
        )
        for c, n, s, t, p, k in EXPECTED
    ]
    write_part(storage, out_dir, part_name(0, 0), rows[:2])
    write_part(storage, out_dir, part_name(0, 1), rows[2:])
    write_manifest(storage, out_dir, {"job_id": "job_test", "rows": {"total": 4}})
    Path(out_dir, ".part-s00000-00002.parquet.tmp").write_bytes(b"half a file")
    return storage, out_dir


def as_tuples(records: list[dict]) -> list[tuple]:
    return sorted(
        (
            r["custom_id"],
            r["line"],
            r["status"],
            r["text"],
            r["prompt_tokens"],
            r["completion_tokens"],
        )
        for r in records
    )


def test_write_part_names_files_by_shard_and_sequence(output_dir):
    storage, out_dir = output_dir

    assert storage.listdir(out_dir) == [
        ".part-s00000-00002.parquet.tmp",
        SUCCESS_NAME,
        MANIFEST_NAME,
        "part-s00000-00000.parquet",
        "part-s00000-00001.parquet",
    ]
    assert read_lines(storage, posixpath.join(out_dir, part_name(0, 1))) == [3, 5]


def test_pyarrow_dataset_reads_the_directory_as_one_table_with_the_contract_schema(output_dir):
    _, out_dir = output_dir

    table = ds.dataset(out_dir, format="parquet").to_table()

    assert table.schema.equals(OUTPUT_SCHEMA, check_metadata=False)
    assert table.schema.metadata[b"batchllm.schema_version"] == b"5"
    assert as_tuples(table.to_pylist()) == sorted(EXPECTED)
    errors = [r for r in table.to_pylist() if r["status"] == "error"]
    assert errors == [
        {
            "custom_id": "b",
            "line": 2,
            "status": "error",
            "text": None,
            "finish_reason": None,
            "prompt_tokens": None,
            "completion_tokens": None,
            "error": "field 'prompt': prompt is blank",
            # version 2's columns, null on an error row
            "structured_ok": None,
            "logprobs": None,
            "choices": None,
            "adapter": None,
            "embedding": None,
            "embeddings": None,
            "error_code": None,  # version 3's; this row was written without one
            # version 4's, null on an error row
            "reasoning": None,
            "reasoning_tokens": None,
            "tool_calls": None,
            # version 5's, null on an error row
            "scores": None,
            "label": None,
            "probs": None,
        }
    ]


def test_read_output_returns_every_committed_row(output_dir):
    storage, out_dir = output_dir

    table = read_output(storage, out_dir)

    assert as_tuples(table.to_pylist()) == sorted(EXPECTED)


def test_read_output_of_an_empty_directory_is_an_empty_table_with_the_schema(tmp_path):
    storage = Storage(str(tmp_path))

    table = read_output(storage, storage.output_dir("job_none"))

    assert table.num_rows == 0
    assert table.schema.names == OUTPUT_SCHEMA.names


def test_pandas_reads_the_directory(output_dir):
    pd = pytest.importorskip("pandas")
    _, out_dir = output_dir

    frame = pd.read_parquet(out_dir)

    assert len(frame) == len(EXPECTED)
    assert sorted(frame["custom_id"]) == ["a", "b", "c", "d"]
    assert frame.loc[frame["custom_id"] == "c", "completion_tokens"].item() == 5
    assert frame.loc[frame["custom_id"] == "b", "text"].isna().all()


def test_polars_reads_the_part_files_glob(output_dir):
    pl = pytest.importorskip("polars")
    _, out_dir = output_dir

    frame = pl.read_parquet(f"{out_dir}/*.parquet")

    assert frame.columns == OUTPUT_SCHEMA.names
    assert as_tuples(frame.to_dicts()) == sorted(EXPECTED)
    assert frame.filter(pl.col("status") == "ok")["completion_tokens"].sum() == 8


def test_duckdb_reads_the_part_files_glob(output_dir):
    duckdb = pytest.importorskip("duckdb")
    _, out_dir = output_dir

    rows = duckdb.sql(
        f"SELECT custom_id, line, status, text, prompt_tokens, completion_tokens "
        f"FROM read_parquet('{out_dir}/*.parquet') ORDER BY line"
    ).fetchall()

    assert rows == sorted(EXPECTED, key=lambda r: r[1])


def test_manifest_and_success_marker_are_written_next_to_the_data(output_dir):
    storage, out_dir = output_dir

    manifest = json.loads(storage.read_bytes(posixpath.join(out_dir, MANIFEST_NAME)))

    assert manifest == {"schema_version": 5, "job_id": "job_test", "rows": {"total": 4}}
    assert storage.read_bytes(posixpath.join(out_dir, SUCCESS_NAME)) == b""


# -- database: migrations ------------------------------------------------------------------------


def test_alembic_upgrade_creates_the_tables_and_is_idempotent(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh.db'}"

    upgrade(url)
    upgrade(url)

    engine = create_engine(url)
    try:
        inspector = inspect(engine)
        assert {"jobs", "shards", "checkpoints", "alembic_version"} <= set(
            inspector.get_table_names()
        )
        job_columns = {c["name"] for c in inspector.get_columns("jobs")}
        assert {
            "status",
            "request_total",
            "requests_per_s",
            "output_tokens_per_s",
            "hardware",
            "vllm_version",
            "metadata",
        } <= job_columns
        with engine.connect() as conn:
            versions = conn.exec_driver_sql("SELECT version_num FROM alembic_version").all()
        assert len(versions) == 1
    finally:
        engine.dispose()


def test_db_upgrade_command_runs_twice_against_the_configured_database(settings):
    from click.testing import CliRunner

    from batchllm.cli import cli

    runner = CliRunner()
    first = runner.invoke(cli, ["db", "upgrade"])
    second = runner.invoke(cli, ["db", "upgrade"])

    assert first.exit_code == 0, first.output
    assert second.exit_code == 0, second.output
    assert "newest schema" in second.output
    assert (settings.home / "batchllm.db").is_file()


# -- database: the job lifecycle -----------------------------------------------------------------


def make_input(tmp_path: Path, rows: int, bad: int = 0) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": f"prompt {i}"}) for i in range(rows)]
    lines += ["{not json"] * bad
    path.write_text("\n".join(lines) + "\n")
    return path


def spec() -> JobSpec:
    return JobSpec(model="/models/none", metadata={"team": "tests"})


def test_create_job_stores_a_queued_job_with_its_shards(settings, tmp_path):
    created = create_job(
        source_of(make_input(tmp_path, 5, bad=1), settings), spec(), shard_size=4, settings=settings
    )

    with session_scope(settings) as session:
        job = session.get(Job, created.job.id)
        assert job.status is JobStatus.QUEUED
        assert (job.request_total, job.shards_total, job.shards_done) == (6, 2, 0)
        assert job.job_metadata == {"team": "tests"}
        # Placed in prompt order (input/placement.py): the invalid line 6 (kind `invalid`
        # sorts before `prompt`), then prompts 0..4 (lines 1-5); a shard's first and last
        # lines are the range its lines fall in.
        assert [(s.index, s.rows, s.first_line, s.last_line, s.status) for s in job.shards] == [
            (0, 4, 1, 6, ShardStatus.QUEUED),
            (1, 2, 4, 5, ShardStatus.QUEUED),
        ]
        assert job.output_dir == Storage.of(settings).output_dir(job.id)
    assert Path(job.output_dir).is_dir()


def test_job_status_is_stored_by_value(settings, tmp_path):
    created = create_job(
        source_of(make_input(tmp_path, 1), settings), spec(), shard_size=4, settings=settings
    )

    with session_scope(settings) as session:
        raw = (
            session.connection()
            .exec_driver_sql("SELECT status FROM jobs WHERE id = ?", (created.job.id,))
            .scalar_one()
        )

    assert raw == "queued"


def test_a_job_runs_from_claim_through_checkpoints_to_finalizing_exactly_once(settings, tmp_path):
    created = create_job(
        source_of(make_input(tmp_path, 6), settings), spec(), shard_size=3, settings=settings
    )
    job_id = created.job.id
    with session_scope(settings) as session:
        shard_ids = [s.id for s in session.get(Job, job_id).shards]

    with session_scope(settings) as session:
        claimed = leases.claim_shard(session, shard_ids[0], "w1")
        assert claimed is not None and claimed.status is ShardStatus.RUNNING
        assert (claimed.attempts, claimed.worker) == (1, "w1")
        assert service.job_status(session, job_id) is JobStatus.IN_PROGRESS
        service.mark_generation_started(session, job_id)
    with session_scope(settings) as session:
        record_part(
            session, job_id, shard_ids[0], 0, "p0", rows=(2, 0), tokens=(10, 20), seconds=0.5
        )
        record_part(
            session, job_id, shard_ids[0], 1, "p1", rows=(0, 1), tokens=(0, 0), seconds=0.25
        )
    with session_scope(settings) as session:
        assert state_machine.end_shard(session, shard_ids[0], ShardStatus.COMPLETED) is None
        assert state_machine.end_shard(session, shard_ids[0], ShardStatus.COMPLETED) is None
        assert leases.claim_shard(session, shard_ids[0], "w2") is None
        assert leases.claim_shard(session, shard_ids[1], "w2") is not None
        record_part(
            session, job_id, shard_ids[1], 0, "p2", rows=(3, 0), tokens=(15, 30), seconds=1.0
        )
    with session_scope(settings) as session:
        assert (
            state_machine.end_shard(session, shard_ids[1], ShardStatus.COMPLETED)
            is JobStatus.FINALIZING
        )
    with session_scope(settings) as session:
        assert state_machine.end_shard(session, shard_ids[1], ShardStatus.COMPLETED) is None

    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.FINALIZING
        assert (job.request_completed, job.request_failed, job.shards_done) == (5, 1, 2)
        assert (job.prompt_tokens, job.completion_tokens) == (25, 50)
        assert job.engine_seconds == pytest.approx(1.75)
        first = session.get(Shard, shard_ids[0])
        assert (first.rows_ok, first.rows_failed, first.next_seq) == (2, 1, 2)
        assert [c.rows for c in commit.checkpoints_of(session, shard_ids[0])] == [2, 1]
        assert (
            session.scalar(select(Checkpoint.path).where(Checkpoint.shard_id == shard_ids[1]))
            == "p2"
        )
        done = state_machine.complete_job(
            session, job_id, hardware="CPU (test)", vllm_version="0.0"
        )
        assert done.status is JobStatus.COMPLETED
        assert done.wall_seconds > 0
        assert done.requests_per_s == pytest.approx(6 / done.wall_seconds)
        assert done.output_tokens_per_s == pytest.approx(50 / done.wall_seconds)
        assert done.total_tokens_per_s == pytest.approx(75 / done.wall_seconds)


def test_a_failed_shard_fails_the_job_with_its_error(settings, tmp_path):
    created = create_job(
        source_of(make_input(tmp_path, 2), settings), spec(), shard_size=10, settings=settings
    )
    with session_scope(settings) as session:
        (shard,) = session.get(Job, created.job.id).shards
        leases.claim_shard(session, shard.id, "w1")
        result = state_machine.end_shard(session, shard.id, ShardStatus.FAILED, error="engine died")

    assert result is JobStatus.FAILED
    with session_scope(settings) as session:
        job = session.get(Job, created.job.id)
        assert job.status is JobStatus.FAILED
        assert "engine died" in job.error


def test_cancel_on_a_queued_job_ends_it_cancelled_and_its_shards_cannot_be_claimed(
    settings, tmp_path
):
    created = create_job(
        source_of(make_input(tmp_path, 5), settings), spec(), shard_size=2, settings=settings
    )

    with session_scope(settings) as session:
        job = service.cancel_job(session, created.job.id)
        assert job.status is JobStatus.CANCELLED
        assert job.finished_at is not None
        assert [s.status for s in job.shards] == [ShardStatus.CANCELLED] * 3
        shard_ids = [s.id for s in job.shards]
    with session_scope(settings) as session:
        assert all(leases.claim_shard(session, i, "w1") is None for i in shard_ids)
        with pytest.raises(JobStateError, match="already cancelled"):
            service.cancel_job(session, created.job.id)


def test_cancel_on_a_running_job_waits_in_cancelling_until_its_running_shard_ends(
    settings, tmp_path
):
    created = create_job(
        source_of(make_input(tmp_path, 4), settings), spec(), shard_size=2, settings=settings
    )
    with session_scope(settings) as session:
        first, second = session.get(Job, created.job.id).shards
        leases.claim_shard(session, first.id, "w1")
        job = service.cancel_job(session, created.job.id)
        assert job.status is JobStatus.CANCELLING
        assert session.get(Shard, second.id).status is ShardStatus.CANCELLED
    with session_scope(settings) as session:
        assert (
            state_machine.end_shard(session, first.id, ShardStatus.CANCELLED) is JobStatus.CANCELLED
        )
        assert service.job_status(session, created.job.id) is JobStatus.CANCELLED


def test_get_job_finds_a_job_by_full_id_or_unique_prefix(settings, tmp_path):
    created = create_job(
        source_of(make_input(tmp_path, 1), settings), spec(), shard_size=4, settings=settings
    )
    job_id = created.job.id
    bare = job_id.removeprefix("job_")

    with session_scope(settings) as session:
        assert service.get_job(session, job_id).id == job_id
        assert service.get_job(session, job_id[:10]).id == job_id
        assert service.get_job(session, bare[:6]).id == job_id
        with pytest.raises(JobNotFound, match="no job"):
            service.get_job(session, "job_doesnotexist")


def test_get_job_refuses_an_ambiguous_prefix(settings, tmp_path):
    source = make_input(tmp_path, 1)
    create_job(source_of(source, settings), spec(), shard_size=4, settings=settings)
    create_job(source_of(source, settings), spec(), shard_size=4, settings=settings)

    with session_scope(settings) as session, pytest.raises(JobNotFound, match="ambiguous"):
        service.get_job(session, "job_")


def test_list_jobs_filters_by_status_newest_first(settings, tmp_path):
    source = make_input(tmp_path, 1)
    older = create_job(source_of(source, settings), spec(), shard_size=4, settings=settings).job.id
    newer = create_job(source_of(source, settings), spec(), shard_size=4, settings=settings).job.id
    with session_scope(settings) as session:
        service.cancel_job(session, older)

    with session_scope(settings) as session:
        assert [j.id for j in service.list_jobs(session)] == [newer, older]
        assert [j.id for j in service.list_jobs(session, status=JobStatus.CANCELLED)] == [older]
        assert [j.id for j in service.list_jobs(session, limit=1)] == [newer]


def test_strict_refusal_leaves_a_failed_job_with_the_reason(settings, tmp_path):
    from batchllm.errors import InputError

    with pytest.raises(InputError):
        create_job(
            source_of(make_input(tmp_path, 2, bad=1), settings),
            spec(),
            shard_size=4,
            strict=True,
            settings=settings,
        )

    with session_scope(settings) as session:
        (job,) = service.list_jobs(session)
        assert job.status is JobStatus.FAILED
        assert "--strict refuses the file" in job.error
        assert job.shards == []


def test_the_head_revision_read_from_the_scripts_is_alembics_own():
    from alembic.script import ScriptDirectory

    from batchllm.store.db import _head_revision, alembic_config

    alembics = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert alembics is not None
    assert _head_revision() == alembics
