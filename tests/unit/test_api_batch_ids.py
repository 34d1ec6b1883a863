"""Batch ids as OpenAI's (`batch_<hex>`) over jobs' ids (`job_<hex>`): every Batch API answer
shows the `batch_` form, every route that takes a batch id takes either form, and the CLI and
the dashboard find the job by either (FastAPI's TestClient, SQLite, the in-memory broker;
objects checked with the `openai` package's types)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from openai.types import Batch

from batchllm.api import keys
from batchllm.api.app import create_app
from batchllm.api.batches import record_batch
from batchllm.errors import JobNotFound
from batchllm.jobs.create import create_job
from batchllm.settings import Settings
from batchllm.store import service, state_machine
from batchllm.store.db import get_engine, session_scope
from batchllm.store.models import StoredFile, batch_id_of, job_id_of
from tests.support.fake_runs import make_spec, write_items
from tests.support.file_jobs import create_from_file
from tests.support.inputs import source_of

CHAT = "/v1/chat/completions"


@pytest.fixture
def api(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setenv("BATCHLLM_BROKER_URL", "memory://")
    get_engine(settings)
    return TestClient(create_app(settings, auth=True))


def new_key(settings: Settings, name: str = "tenant") -> tuple[str, dict[str, str]]:
    with session_scope(settings) as session:
        row, key = keys.create_key(session, name)
        return row.id, {"Authorization": f"Bearer {key}"}


def queued_batch(settings: Settings, tmp_path: Path, owner: str, name: str = "in") -> str:
    """A batch's job, queued (never dispatched: no worker runs here); its job id."""
    job_id = create_from_file(
        write_items(tmp_path / f"{name}.jsonl", 2), make_spec(), settings, shard_size=10
    ).job.id
    record_batch(settings, job_id, owner=owner, endpoint=CHAT, window="24h", input_file_id="f")
    return job_id


def test_the_mapping_is_a_prefix_swap_both_ways() -> None:
    assert batch_id_of("job_0123abcd") == "batch_0123abcd"
    assert job_id_of("batch_0123abcd") == "job_0123abcd"
    assert job_id_of("job_0123abcd") == "job_0123abcd"
    assert job_id_of("file-x") == "file-x"  # names no job: answered 404 where looked up


def test_every_answer_shows_the_batch_id_and_either_id_finds_the_batch(
    api: TestClient, settings: Settings, tmp_path: Path
) -> None:
    owner, headers = new_key(settings)
    job_id = queued_batch(settings, tmp_path, owner)
    hex_part = job_id.removeprefix("job_")

    by_batch_id = api.get(f"/v1/batches/batch_{hex_part}", headers=headers)
    by_job_id = api.get(f"/v1/batches/{job_id}", headers=headers)
    assert by_batch_id.status_code == by_job_id.status_code == 200, by_batch_id.text
    batch = Batch.model_validate(by_batch_id.json())
    assert batch.id == f"batch_{hex_part}"
    assert by_job_id.json() == by_batch_id.json()

    listed = api.get("/v1/batches", headers=headers).json()
    assert [b["id"] for b in listed["data"]] == [batch.id]
    assert listed["first_id"] == listed["last_id"] == batch.id

    cancelled = api.post(f"/v1/batches/{job_id}/cancel", headers=headers)
    assert cancelled.status_code == 200, cancelled.text
    cancelled_batch = Batch.model_validate(cancelled.json())
    assert cancelled_batch.id == batch.id
    assert cancelled_batch.status in ("cancelling", "cancelled")
    assert cancelled_batch.cancelling_at is not None


def test_paging_cursors_take_either_id(api: TestClient, settings: Settings, tmp_path: Path) -> None:
    owner, headers = new_key(settings)
    made = [queued_batch(settings, tmp_path, owner, f"in{i}") for i in range(3)]
    newest_first = [batch_id_of(job_id) for job_id in reversed(made)]

    def page(after: str) -> list[str]:
        response = api.get(f"/v1/batches?limit=10&after={after}", headers=headers)
        assert response.status_code == 200, response.text
        return [b["id"] for b in response.json()["data"]]

    assert page(newest_first[0]) == page(job_id_of(newest_first[0])) == newest_first[1:]
    assert page(newest_first[1]) == page(job_id_of(newest_first[1])) == newest_first[2:]


def test_delete_by_either_id_answers_the_batch_id_and_then_neither_finds_it(
    api: TestClient, settings: Settings, tmp_path: Path
) -> None:
    owner, headers = new_key(settings)
    _, stranger = new_key(settings, "stranger")
    first, second = (queued_batch(settings, tmp_path, owner, n) for n in ("a", "b"))
    with session_scope(settings) as session:
        for job_id in (first, second):
            state_machine.fail_job(session, job_id, "ended for the test")

    # Another key's batch is unknown by either id, as ids must not be probed.
    for ref in (first, batch_id_of(first)):
        assert api.delete(f"/v1/batches/{ref}", headers=stranger).status_code == 404
    for ref, job_id in ((batch_id_of(first), first), (second, second)):
        response = api.delete(f"/v1/batches/{ref}", headers=headers)
        assert response.status_code == 200, response.text
        assert response.json() == {
            "id": batch_id_of(job_id),
            "object": "batch.deleted",
            "deleted": True,
        }
        for gone in (job_id, batch_id_of(job_id)):
            missing = api.get(f"/v1/batches/{gone}", headers=headers)
            assert missing.status_code == 404
            assert gone in missing.json()["error"]["message"]  # the id as it was asked for


def test_result_files_are_named_after_the_batch_id(
    api: TestClient, settings: Settings, tmp_path: Path
) -> None:
    """As OpenAI names them (`batch_..._output.jsonl`); the file ids are unchanged."""
    owner, headers = new_key(settings)
    job_id = queued_batch(settings, tmp_path, owner)
    with session_scope(settings) as session:
        state_machine.fail_job(session, job_id, "ended for the test")
    batch = Batch.model_validate(api.get(f"/v1/batches/{job_id}", headers=headers).json())
    assert batch.status == "failed"
    with session_scope(settings) as session:
        names = sorted(
            f.filename for f in session.query(StoredFile).filter(StoredFile.owner == owner)
        )
    assert names == [f"{batch.id}_errors.jsonl", f"{batch.id}_output.jsonl"]


def test_the_cli_lookup_and_the_dashboard_take_a_batch_id(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLLM_BROKER_URL", "memory://")
    get_engine(settings)
    job_id = queued_batch(settings, tmp_path, "key_local")
    batch_id = batch_id_of(job_id)
    with session_scope(settings) as session:
        assert service.get_job(session, batch_id).id == job_id
        assert service.get_job(session, batch_id[:12]).id == job_id  # a prefix, as job ids
        with pytest.raises(JobNotFound):
            service.get_job(session, "batch_ffffffffffffffff")

    local = TestClient(create_app(settings, auth=False, dashboard_sees_all=True))
    redirect = local.get(f"/ui/jobs/{batch_id}", follow_redirects=False)
    assert (redirect.status_code, redirect.headers["location"]) == (307, f"/ui/jobs/{job_id}")
    page = local.get(f"/ui/jobs/{batch_id}")
    assert page.status_code == 200 and f"(batch {batch_id})" in page.text
