"""Deleting jobs (Client.delete, as `batchllm delete` and `DELETE /v1/batches/{id}` do) and
retention (BATCHLLM_RETAIN_DAYS, applied by the reconciler), on SQLite with a local storage
and on PostgreSQL with the storage in a bucket of moto's S3 server: the job's files and objects
gone, its rows in every table gone, the other jobs untouched, a running job refused."""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from sqlalchemy import func, select, update

from batchllm import Client
from batchllm.api import batches
from batchllm.errors import JobStateError
from batchllm.jobs.create import create_job
from batchllm.settings import Settings, get_settings
from batchllm.store import service
from batchllm.store.db import session_scope, upgrade
from batchllm.store.models import Batch, Checkpoint, Job, Shard, StoredFile, batch_id_of, utcnow
from batchllm.worker.reconciler import reconcile_once
from tests.support.fake_runs import FakeEngine, FakeEngines, make_spec, write_items
from tests.support.inputs import source_of
from tests.support.s3server import S3Server, moto_server
from tests.support.services import postgres_database

pytestmark = pytest.mark.integration


@dataclass
class Place:
    """Where jobs live in a test: the settings, and every file of the job storage."""

    settings: Settings
    list_files: Callable[[], list[str]]

    def files_of(self, job_id: str) -> list[str]:
        return [path for path in self.list_files() if job_id in path]


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    with moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(params=["sqlite+local", "postgresql+s3"])
def place(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Place]:
    common = {"home": tmp_path / "home", "broker_url": "memory://", "commit_rows": 4}
    if request.param == "sqlite+local":
        root = tmp_path / "storage"
        settings = Settings(**common, storage=str(root))
        yield Place(settings, lambda: sorted(str(p) for p in root.rglob("*") if p.is_file()))
        return
    server: S3Server = request.getfixturevalue("s3_server")
    bucket = server.new_bucket()
    # In the environment too: code that opens a job's storage by its root alone (finalize,
    # the OpenAI export) finds the endpoint there, as in a user's shell.
    for name, value in server.env(bucket).items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    request.addfinalizer(get_settings.cache_clear)
    fs = server.filesystem()

    def objects() -> list[str]:
        infos = fs.get_file_info(pafs.FileSelector(bucket, recursive=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File)

    with postgres_database(f"batchllm_delete_{tmp_path.name[-20:]}".lower()) as url:
        upgrade(url)
        settings = Settings(
            **common, database_url=url, storage=f"s3://{bucket}/jobs", s3_endpoint=server.endpoint
        )
        yield Place(settings, objects)


def run_job(place: Place, tmp_path: Path, rows: int, name: str) -> str:
    job = Client(place.settings).run(
        write_items(tmp_path / f"{name}.jsonl", rows),
        model="/models/fake",
        max_model_len=64,
        engines=FakeEngines(FakeEngine()),
    )
    assert job.status == "completed" and job.completed == rows
    return job.id


def as_batch(place: Place, job_id: str) -> None:
    """Make the job a Batch API batch with its output and error files written, as
    `batchllm serve` does when a batch ends."""
    batches.record_batch(
        place.settings,
        job_id,
        owner="key_1",
        endpoint="/v1/chat/completions",
        window="24h",
        input_file_id="file-input",
    )
    with session_scope(place.settings) as session:
        batch, job = session.get(Batch, job_id), session.get(Job, job_id)
        session.expunge_all()
    batches.write_result_files(place.settings, batch, job)


def rows_of(place: Place, job_id: str) -> dict[str, int]:
    with session_scope(place.settings) as session:
        counts = {
            "jobs": session.scalar(select(func.count()).where(Job.id == job_id)),
            "shards": session.scalar(select(func.count()).where(Shard.job_id == job_id)),
            "checkpoints": session.scalar(
                select(func.count())
                .select_from(Checkpoint)
                .join(Shard)
                .where(Shard.job_id == job_id)
            ),
            "batches": session.scalar(select(func.count()).where(Batch.job_id == job_id)),
            "files": session.scalar(
                select(func.count()).where(StoredFile.filename.startswith(batch_id_of(job_id)))
            ),
        }
    return counts


def test_delete_removes_the_jobs_rows_and_files_and_nothing_else(place, tmp_path):
    doomed = run_job(place, tmp_path, 10, "doomed")
    kept = run_job(place, tmp_path, 6, "kept")
    as_batch(place, doomed)
    before = place.files_of(doomed)
    names = {posixpath.basename(p) for p in before}
    assert {"shard-00000.parquet", "_manifest.json", "_SUCCESS", "output.jsonl"} <= names
    assert any(n.startswith("part-") for n in names)
    rows = rows_of(place, doomed)
    assert rows["checkpoints"] >= 3 and rows["batches"] == 1 and rows["files"] == 2
    kept_files, kept_rows = place.files_of(kept), rows_of(place, kept)

    removed = Client(place.settings).delete(doomed[:12])

    assert place.files_of(doomed) == []
    assert rows_of(place, doomed) == dict.fromkeys(rows, 0)
    # The batch's two files, their directory, the job's directory.
    assert [posixpath.basename(p.rstrip("/")) for p in removed] == [
        "errors.jsonl",
        "output.jsonl",
        f"{doomed}-results",
        doomed,
    ]
    assert place.files_of(kept) == kept_files and rows_of(place, kept) == kept_rows
    assert len(list(Client(place.settings).iter_results(kept))) == 6


def test_a_queued_job_is_refused_until_cancelled(place, tmp_path):
    created = create_job(
        source_of(write_items(tmp_path / "q.jsonl", 5), place.settings),
        make_spec(),
        shard_size=100,
        settings=place.settings,
    )
    job_id = created.job.id
    files = place.files_of(job_id)
    assert files

    with pytest.raises(JobStateError, match=r"is queued: .*cancel it first \(batchllm cancel"):
        Client(place.settings).delete(job_id)
    assert place.files_of(job_id) == files and rows_of(place, job_id)["shards"] == 1

    assert Client(place.settings).cancel(job_id).status == "cancelled"
    Client(place.settings).delete(job_id)
    assert place.files_of(job_id) == [] and rows_of(place, job_id)["jobs"] == 0


def test_retention_deletes_only_the_ended_jobs_older_than_retain_days(place, tmp_path):
    old = run_job(place, tmp_path, 4, "old")
    recent = run_job(place, tmp_path, 4, "recent")
    waiting = create_job(
        source_of(write_items(tmp_path / "w.jsonl", 4), place.settings),
        make_spec(),
        shard_size=100,
        settings=place.settings,
    ).job.id
    long_ago = utcnow() - timedelta(days=3)
    with session_scope(place.settings) as session:
        session.execute(update(Job).where(Job.id == old).values(finished_at=long_ago))
        session.execute(update(Job).where(Job.id == waiting).values(created_at=long_ago))

    sent: list[tuple[int, str]] = []
    kept_by_default = reconcile_once(lambda *task: sent.append(task), place.settings)
    assert kept_by_default.deleted_jobs == [] and rows_of(place, old)["jobs"] == 1

    place.settings.retain_days = 2
    done = reconcile_once(lambda *task: sent.append(task), place.settings)

    assert done.deleted_jobs == [old]
    assert place.files_of(old) == [] and rows_of(place, old)["jobs"] == 0
    for job_id in (recent, waiting):
        assert place.files_of(job_id) and rows_of(place, job_id)["jobs"] == 1
    assert reconcile_once(lambda *task: sent.append(task), place.settings).deleted_jobs == []
