"""What a tenant names or writes cannot reach past validation (issue 33): a batch for a model
the deployment does not serve is refused at create, compared exactly (finding 3); a line with
a lone surrogate in its custom_id or content is an error line naming the field, never a 500
nor a job left `validating` without its batch (finding 7). In process (FastAPI's TestClient
over SQLite and the in-memory broker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select

from batchllm.api import keys
from batchllm.api.app import create_app
from batchllm.input.shards import iter_shard_rows
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import Batch, Job, JobStatus, job_id_of

pytest.importorskip("fastapi.testclient")
from fastapi.testclient import TestClient

from tests.support.serve import post_batch

CHAT = "/v1/chat/completions"
SERVED = "/models/tiny"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path / "home",
        database_url=f"sqlite:///{tmp_path / 'batchllm.db'}",
        storage=str(tmp_path / "storage"),
        broker_url="memory://",  # a batch is "dispatched" to nowhere
        # No registry on that broker: the model is configured, so a batch for it waits (the
        # look-alike tests below keep it too).
        served_models=[SERVED],
    )


def _tenant(settings: Settings) -> dict[str, str]:
    with session_scope(settings) as session:
        _, key = keys.create_key(session, "tenant")
    return {"Authorization": f"Bearer {key}"}


def _line(custom_id: str, content: str = "hi", model: str = SERVED) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def _create(client: TestClient, headers: dict[str, str], lines: list[str]):
    content = ("\n".join(lines) + "\n").encode()
    return post_batch(client, content, headers=headers)


@pytest.mark.parametrize("look_alike", ["models_tiny", "/models/tiny/", "/Models/tiny"])
def test_a_batch_for_a_model_not_in_the_served_list_is_refused_at_create(settings, look_alike):
    client = TestClient(create_app(settings, auth=True))
    headers = _tenant(settings)

    response = _create(client, headers, [_line("a", model=look_alike)])

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "body.model")
    assert repr(look_alike) in error["message"]
    with session_scope(settings) as session:
        assert session.scalars(select(Job)).all() == []  # no job, no queue


def test_a_batch_for_a_served_model_is_accepted(settings):
    client = TestClient(create_app(settings, auth=True))
    response = _create(client, _tenant(settings), [_line("a")])
    assert response.status_code == 200, response.text
    assert response.json()["status"] in ("validating", "in_progress")


def test_lone_surrogates_in_custom_id_or_content_are_error_lines_not_a_500(settings):
    client = TestClient(create_app(settings, auth=True), raise_server_exceptions=False)
    lines = [
        _line("ok-1"),
        _line("poison\udc00-id"),
        _line("poison-content", content="x\udc00"),
        _line("ok-2"),
    ]
    assert all("\\udc00" in line for line in lines[1:3])  # escaped in the JSON, as a tenant sends

    response = _create(client, _tenant(settings), lines)

    assert response.status_code == 200, response.text
    batch_id = response.json()["id"]
    assert response.json()["request_counts"]["total"] == 4
    with session_scope(settings) as session:
        job = session.get(Job, job_id_of(batch_id))
        assert job is not None and job.status is not JobStatus.VALIDATING
        assert job.request_total == 4
        assert session.get(Batch, job_id_of(batch_id)) is not None  # no orphan job
        paths = [shard.input_path for shard in job.shards]
    storage = Storage.of(settings)
    # Sorted by line: the shards hold them placed by prompt (input/shards.py).
    rows = sorted(
        (row for path in paths for row in iter_shard_rows(storage, path)), key=lambda r: r.line
    )
    assert [row.kind for row in rows] == ["chat", "invalid", "invalid", "chat"]
    assert rows[1].custom_id == "line-2"  # its own id cannot be written
    assert rows[1].error.startswith("field 'custom_id': text that is not valid Unicode")
    assert rows[2].custom_id == "poison-content"
    assert rows[2].error.startswith("field 'body.messages.0.content': text that is not valid")


def test_a_lone_surrogate_in_the_create_request_itself_is_a_400_naming_the_field(settings):
    client = TestClient(create_app(settings, auth=True), raise_server_exceptions=False)
    headers = _tenant(settings)
    upload = client.post(
        "/v1/files",
        headers=headers,
        files={"file": ("input.jsonl", (_line("a") + "\n").encode(), "application/jsonl")},
        data={"purpose": "batch"},
    )
    file_id = upload.json()["id"]
    # Raw JSON: the escape as a client sends it (metadata values are echoed in every response).
    raw = (
        f'{{"input_file_id": "{file_id}", "endpoint": "{CHAT}", "completion_window": "24h", '
        '"metadata": {"team": "x\\udc00"}}'
    )

    response = client.post(
        "/v1/batches", headers={**headers, "Content-Type": "application/json"}, content=raw
    )

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("metadata.team", "invalid_value")
    with session_scope(settings) as session:
        assert session.scalars(select(Job)).all() == []
