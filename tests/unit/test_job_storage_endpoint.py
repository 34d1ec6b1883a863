"""A job's files are reached through the settings a caller passes, never the process's own:
with the S3 endpoint given only in the Settings object (the process's environment names a dead
one), a local run writes its parts, and reading, exporting, retrying and deleting the job all
reach the same server (Storage.for_job)."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from batchllm.client import Client
from batchllm.output.openai_files import ERRORS_NAME, OUTPUT_NAME, export_openai
from batchllm.settings import Settings, get_settings
from batchllm.store import service
from batchllm.store.db import session_scope
from tests.support.fake_runs import FakeEngine, FakeEngines, write_items
from tests.support.s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, moto_server

# Nothing listens here: a read or write that took the process's settings would fail on it.
DEAD_ENDPOINT = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> S3Server:
    with moto_server(tmp_path_factory.mktemp("moto")) as running:
        yield running


@pytest.fixture
def passed_settings(server: S3Server, tmp_path, monkeypatch) -> Settings:
    for name, value in {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
        "BATCHLLM_S3_ENDPOINT": DEAD_ENDPOINT,
        "BATCHLLM_HOME": str(tmp_path / "process-home"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("BATCHLLM_STORAGE", raising=False)
    monkeypatch.delenv("BATCHLLM_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    settings = Settings(
        home=tmp_path / "home",
        storage=f"s3://{server.new_bucket()}/jobs",
        s3_endpoint=server.endpoint,
        commit_rows=5,
    )
    yield settings
    get_settings.cache_clear()


def _objects(server: S3Server, settings: Settings, job_id: str) -> list[str]:
    root = settings.storage.removeprefix("s3://")
    listed = server.filesystem().get_file_info(pafs.FileSelector(root, recursive=True))
    return [i.path for i in listed if i.type == pafs.FileType.File and job_id in i.path]


def test_run_read_export_retry_and_delete_go_through_the_settings_endpoint(
    server, passed_settings, tmp_path
):
    settings = passed_settings
    source = write_items(tmp_path / "in.jsonl", 9, extra=["{not json"])
    client = Client(settings)
    job = client.run(
        source, model="/models/fake", max_model_len=64, engines=FakeEngines(FakeEngine())
    )
    assert (job.status, job.completed, job.failed) == ("completed", 9, 1)
    assert any("/output/part-" in path for path in _objects(server, settings, job.id))

    table = client.results(job).to_table()
    assert sorted(table.column("line").to_pylist()) == list(range(1, 11))

    with session_scope(settings) as session:
        row = service.get_job(session, job.id)
    counts = export_openai(row, tmp_path / "export", settings=settings)
    assert (counts.output, counts.errors) == (9, 1)
    assert len((tmp_path / "export" / OUTPUT_NAME).read_text().splitlines()) == 9
    (error,) = [json.loads(x) for x in (tmp_path / "export" / ERRORS_NAME).read_text().splitlines()]
    assert error["custom_id"] == "line-10"

    retried = client.retry(job, all_errors=True, engines=FakeEngines(FakeEngine()))
    assert (retried.status, retried.completed, retried.failed) == ("completed", 9, 1)

    client.delete(job)
    assert _objects(server, settings, job.id) == []
