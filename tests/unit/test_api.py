"""`batchllm serve`'s Batch API in process (FastAPI's TestClient over a SQLite database): API keys,
tenant isolation, upload limits, the batch-level refusals that need no broker, cursor pages,
and every object checked with the `openai` package's own types."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from batchllm.api import auth, keys
from batchllm.api.app import create_app
from batchllm.settings import Settings
from batchllm.store.db import session_scope
from batchllm.store.models import Batch as BatchRow
from batchllm.store.models import Job, StoredFile, job_id_of
from tests.support.file_jobs import create_from_file

pytest.importorskip("fastapi.testclient")
openai_types = pytest.importorskip("openai.types")
from fastapi.testclient import TestClient  # noqa: E402
from openai.types import Batch, FileDeleted, FileObject, Model  # noqa: E402

CHAT = "/v1/chat/completions"
ERROR_KEYS = {"message", "type", "param", "code"}


# -- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite database for the module (its schema is made on first use, ~0.3 s); each test
    has its own keys, so it sees only its own files and batches, and its own storage."""
    return f"sqlite:///{tmp_path_factory.mktemp('api-db') / 'batchllm.db'}"


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    # memory://: no test here may reach a real broker (the refusals below never dispatch).
    # No worker registry there, so the model is configured, as a deployment whose workers are
    # not up yet does.
    return Settings(
        home=tmp_path / "home",
        database_url=database_url,
        storage=str(tmp_path / "storage"),
        broker_url="memory://",
        served_models=["tiny"],
    )


def client_for(settings: Settings, **limits: Any) -> TestClient:
    return TestClient(create_app(settings.model_copy(update=limits), auth=True))


@pytest.fixture
def client(settings: Settings) -> TestClient:
    return client_for(settings)


def new_key(settings: Settings, name: str = "tenant") -> tuple[str, dict[str, str]]:
    """(owner id, Authorization header) of a fresh key."""
    with session_scope(settings) as session:
        row, key = keys.create_key(session, name)
        return row.id, {"Authorization": f"Bearer {key}"}


def chat_line(custom_id: str, model: str = "tiny", url: str = CHAT) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def upload(
    client: TestClient, headers: dict[str, str], content: bytes, purpose: str = "batch"
) -> Any:
    return client.post(
        "/v1/files",
        headers=headers,
        files={"file": ("input.jsonl", content, "application/jsonl")},
        data={"purpose": purpose},
    )


def uploaded(client: TestClient, headers: dict[str, str], content: bytes) -> FileObject:
    response = upload(client, headers, content)
    assert response.status_code == 200, response.text
    return FileObject.model_validate(response.json())


def assert_error(response: Any, status: int, *, code: str | None = None, param: Any = ...) -> dict:
    """An OpenAI-shaped error: exactly {"error": {message, type, param, code}}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == ERROR_KEYS
    assert isinstance(error["message"], str) and error["message"]
    expected_type = "authentication_error" if status == 401 else "invalid_request_error"
    assert error["type"] == expected_type
    if code is not None:
        assert error["code"] == code
    if param is not ...:
        assert error["param"] == param
    return error


def files_on_disk(settings: Settings) -> list[Path]:
    root = Path(settings.resolved_storage) / "files"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def file_rows(settings: Settings, owner: str) -> int:
    with session_scope(settings) as session:
        return session.scalar(
            select(func.count()).select_from(StoredFile).where(StoredFile.owner == owner)
        )


def refused_batch(client: TestClient, headers: dict[str, str], **extra: Any) -> Batch:
    """A batch refused as a whole (two models), created without any broker."""
    file = uploaded(client, headers, jsonl([chat_line("a", "m1"), chat_line("b", "m2")]))
    response = client.post(
        "/v1/batches",
        headers=headers,
        json={"input_file_id": file.id, "endpoint": CHAT, "completion_window": "24h", **extra},
    )
    assert response.status_code == 200, response.text
    batch = Batch.model_validate(response.json())
    assert batch.status == "failed"
    return batch


# -- API keys ----------------------------------------------------------------------------------

ROUTES = [
    ("get", "/v1/files"),
    ("get", "/v1/files/file-x"),
    ("get", "/v1/files/file-x/content"),
    ("delete", "/v1/files/file-x"),
    ("get", "/v1/batches"),
    ("get", "/v1/batches/batch-x"),
    ("post", "/v1/batches/batch-x/cancel"),
    ("post", "/v1/batches/batch-x/retry"),
    ("delete", "/v1/batches/batch-x"),
    ("get", "/v1/models"),
]


def test_every_route_wants_a_key(client: TestClient) -> None:
    for method, path in ROUTES:
        assert_error(getattr(client, method)(path), 401, code="missing_api_key", param=None)
    assert_error(upload(client, {}, b"{}\n"), 401, code="missing_api_key")
    for header in ("Basic abc", "Bearer", "Bearer   ", "sk-batchllm-no-scheme"):
        response = client.get("/v1/files", headers={"Authorization": header})
        assert_error(response, 401, code="missing_api_key")


def test_a_wrong_key_is_refused(client: TestClient, settings: Settings) -> None:
    _, good = new_key(settings)
    assert client.get("/v1/files", headers=good).status_code == 200
    for key in ("sk-batchllm-not-a-key", good["Authorization"].removeprefix("Bearer ") + "x"):
        response = client.get("/v1/files", headers={"Authorization": f"Bearer {key}"})
        assert_error(response, 401, code="invalid_api_key", param=None)


def test_a_revoked_key_is_refused(settings: Settings) -> None:
    client = client_for(settings, api_key_cache_seconds=0)  # looked up on every request
    owner, headers = new_key(settings, "to-revoke")
    assert client.get("/v1/batches", headers=headers).status_code == 200
    with session_scope(settings) as session:
        keys.revoke_key(session, owner)
    assert_error(client.get("/v1/batches", headers=headers), 401, code="invalid_api_key")
    assert_error(upload(client, headers, jsonl([chat_line("a")])), 401)
    assert file_rows(settings, owner) == 0


def test_a_revoked_key_is_refused_once_its_cached_lookup_is_older_than_the_setting(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = client_for(settings, api_key_cache_seconds=5)
    owner, headers = new_key(settings, "cached")
    assert client.get("/v1/batches", headers=headers).status_code == 200
    with session_scope(settings) as session:
        keys.revoke_key(session, owner)
    # Within the 5 s the server trusts its lookup (said in docs/operations.md).
    assert client.get("/v1/batches", headers=headers).status_code == 200
    later = time.monotonic() + 6
    monkeypatch.setattr(auth._KEYS, "clock", lambda: later)
    assert_error(client.get("/v1/batches", headers=headers), 401, code="invalid_api_key")


def test_without_auth_everything_belongs_to_the_local_tenant(settings: Settings) -> None:
    client = TestClient(create_app(settings, auth=False))
    file = uploaded(client, {}, jsonl([chat_line("a")]))
    assert client.get(f"/v1/files/{file.id}").status_code == 200
    with session_scope(settings) as session:
        assert session.get(StoredFile, file.id).owner == keys.LOCAL_OWNER


# -- files -------------------------------------------------------------------------------------


def test_upload_get_list_content_delete(client: TestClient, settings: Settings) -> None:
    owner, headers = new_key(settings)
    content = jsonl([chat_line("a"), chat_line("b")])
    file = uploaded(client, headers, content)
    assert (file.object, file.purpose, file.bytes, file.filename) == (
        "file",
        "batch",
        len(content),
        "input.jsonl",
    )
    assert file.id.startswith("file-")
    with session_scope(settings) as session:
        row = session.get(StoredFile, file.id)
        assert (row.owner, row.lines) == (owner, 2)
    got = client.get(f"/v1/files/{file.id}", headers=headers)
    assert FileObject.model_validate(got.json()) == file
    listed = client.get("/v1/files", headers=headers).json()
    assert [FileObject.model_validate(f).id for f in listed["data"]] == [file.id]
    assert (listed["object"], listed["has_more"]) == ("list", False)
    assert client.get("/v1/files?purpose=batch_output", headers=headers).json()["data"] == []
    assert client.get(f"/v1/files/{file.id}/content", headers=headers).content == content

    deleted = client.delete(f"/v1/files/{file.id}", headers=headers)
    assert FileDeleted.model_validate(deleted.json()).deleted is True
    assert files_on_disk(settings) == []
    assert_error(client.get(f"/v1/files/{file.id}", headers=headers), 404, code="not_found")
    assert_error(client.delete(f"/v1/files/{file.id}", headers=headers), 404)


def test_another_tenant_sees_no_file(client: TestClient, settings: Settings) -> None:
    _, alice = new_key(settings, "alice")
    _, bob = new_key(settings, "bob")
    content = jsonl([chat_line("a")])
    file = uploaded(client, alice, content)
    for method, path in (
        ("get", f"/v1/files/{file.id}"),
        ("get", f"/v1/files/{file.id}/content"),
        ("delete", f"/v1/files/{file.id}"),
    ):
        error = assert_error(getattr(client, method)(path, headers=bob), 404, code="not_found")
        # The same answer as for an id that does not exist: ids cannot be probed.
        missing = getattr(client, method)(path.replace(file.id, "file-missing"), headers=bob)
        assert error["message"].replace(file.id, "ID") == missing.json()["error"][
            "message"
        ].replace("file-missing", "ID")
    assert client.get("/v1/files", headers=bob).json()["data"] == []
    # Nor can it run a batch over it.
    response = client.post(
        "/v1/batches",
        headers=bob,
        json={"input_file_id": file.id, "endpoint": CHAT, "completion_window": "24h"},
    )
    assert_error(response, 404, code="not_found")
    # Bob's delete did nothing: the file is still Alice's, whole.
    assert client.get(f"/v1/files/{file.id}/content", headers=alice).content == content


def test_upload_over_the_byte_limit_keeps_nothing(settings: Settings) -> None:
    client = client_for(settings, api_max_file_bytes=1000)
    owner, headers = new_key(settings)
    fits = b"x" * 999 + b"\n"  # exactly the limit (uploads are not parsed)
    file = uploaded(client, headers, fits)
    assert file.bytes == 1000
    assert client.delete(f"/v1/files/{file.id}", headers=headers).status_code == 200
    assert file_rows(settings, owner) == 0 and files_on_disk(settings) == []

    # One byte over: refused while it is stored; over the limit plus the multipart framing:
    # refused from its Content-Length before a byte is read.
    for content in (fits + b"x", b"y" * 70_000):
        error = assert_error(upload(client, headers, content), 413, code="file_too_large")
        assert "1,000 bytes" in error["message"]
        assert files_on_disk(settings) == []
        assert file_rows(settings, owner) == 0
    assert client.get("/v1/files", headers=headers).json()["data"] == []


def test_upload_over_the_line_limit_keeps_nothing(settings: Settings) -> None:
    client = client_for(settings, api_max_file_lines=3)
    owner, headers = new_key(settings)
    three = jsonl([chat_line(str(i)) for i in range(3)])
    assert uploaded(client, headers, three).bytes == len(three)
    assert uploaded(client, headers, three.rstrip(b"\n")).bytes == len(three) - 1
    assert file_rows(settings, owner) == 2
    before = files_on_disk(settings)
    assert len(before) == 2
    # A fourth line, with or without its newline.
    for content in (three + jsonl([chat_line("3")]), three + b'{"custom_id": "3"}'):
        error = assert_error(upload(client, headers, content), 413, code="file_too_large")
        assert "3 lines" in error["message"]
        assert files_on_disk(settings) == before
        assert file_rows(settings, owner) == 2


def test_upload_refusals(client: TestClient, settings: Settings) -> None:
    owner, headers = new_key(settings)
    error = assert_error(upload(client, headers, b"{}\n", purpose="fine-tune"), 400)
    assert error["param"] == "purpose"
    no_purpose = client.post(
        "/v1/files", headers=headers, files={"file": ("a.jsonl", b"{}\n", "application/jsonl")}
    )
    assert_error(no_purpose, 400, param="purpose", code="invalid_value")
    no_file = client.post("/v1/files", headers=headers, data={"purpose": "batch"})
    assert_error(no_file, 400, param="file")
    assert files_on_disk(settings) == [] and file_rows(settings, owner) == 0


# -- batches -----------------------------------------------------------------------------------


def test_a_file_naming_two_models_makes_a_failed_batch(
    client: TestClient, settings: Settings
) -> None:
    _, headers = new_key(settings)
    lines = [
        chat_line("a", "m1"),
        chat_line("b", "m2"),
        chat_line("c", "m1"),
        chat_line("d", "m3"),
        chat_line("e", "m1", url="/v1/completions"),
    ]
    raw = jsonl(lines[:2]) + b"not json\n" + jsonl(lines[2:])
    file = uploaded(client, headers, raw)
    response = client.post(
        "/v1/batches",
        headers=headers,
        json={
            "input_file_id": file.id,
            "endpoint": CHAT,
            "completion_window": "20s",
            "metadata": {"team": "x"},
        },
    )
    assert response.status_code == 200, response.text
    batch = Batch.model_validate(response.json())
    assert batch.status == "failed"
    assert batch.failed_at is not None and batch.completed_at is None
    assert (batch.endpoint, batch.input_file_id, batch.completion_window) == (CHAT, file.id, "20s")
    assert batch.metadata == {"team": "x"}
    assert batch.model == "m1"  # the first model the file names, which the errors refer to
    assert batch.output_file_id is None and batch.error_file_id is None
    assert batch.request_counts.total == 0
    assert batch.errors is not None and batch.errors.object == "list"
    by_line = {e.line: e for e in batch.errors.data}
    # Line 3 does not parse: left to per-line validation, not a batch error.
    assert set(by_line) == {2, 5, 6}
    assert (by_line[2].code, by_line[2].param) == ("model_mismatch", "body.model")
    assert (by_line[5].code, by_line[5].param) == ("model_mismatch", "body.model")
    assert (by_line[6].code, by_line[6].param) == ("invalid_url", "url")
    assert all(e.message for e in batch.errors.data)
    again = client.get(f"/v1/batches/{batch.id}", headers=headers)
    assert Batch.model_validate(again.json()) == batch
    # It has ended: it cannot be cancelled.
    assert_error(
        client.post(f"/v1/batches/{batch.id}/cancel", headers=headers),
        409,
        code="batch_not_cancellable",
    )
    # Nor retried: it never stored a line.
    refused = client.post(f"/v1/batches/{batch.id}/retry", headers=headers)
    assert_error(refused, 409, code="batch_not_retryable")
    assert "before it stored any input" in refused.json()["error"]["message"]


def test_the_batch_model_is_the_first_one_named(client: TestClient, settings: Settings) -> None:
    _, headers = new_key(settings)
    lines = [chat_line("a", "zz"), chat_line("b", "aa"), chat_line("c", "zz")]
    file = uploaded(client, headers, jsonl(lines))
    response = client.post(
        "/v1/batches",
        headers=headers,
        json={"input_file_id": file.id, "endpoint": CHAT, "completion_window": "24h"},
    )
    batch = Batch.model_validate(response.json())
    assert batch.model == "zz"
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "model_mismatch")]
    assert "'zz'" in batch.errors.data[0].message


def test_lines_for_another_endpoint_fail_the_batch(client: TestClient, settings: Settings) -> None:
    _, headers = new_key(settings)
    file = uploaded(
        client,
        headers,
        jsonl([chat_line("a"), chat_line("b", url="/v1/completions"), chat_line("c")]),
    )
    response = client.post(
        "/v1/batches",
        headers=headers,
        json={"input_file_id": file.id, "endpoint": CHAT, "completion_window": "1h"},
    )
    batch = Batch.model_validate(response.json())
    assert batch.status == "failed" and batch.model == "tiny"
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [(2, "invalid_url", "url")]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/images/generations"}, "endpoint"),
        ({"endpoint": "chat/completions"}, "endpoint"),
        ({"completion_window": "1d"}, "completion_window"),
        ({"completion_window": "0h"}, "completion_window"),
        ({"completion_window": "24 h"}, "completion_window"),
        ({"completion_window": ""}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"input_file_id": None}, "input_file_id"),
    ],
)
def test_create_batch_refusals(
    client: TestClient, settings: Settings, change: dict[str, Any], param: str
) -> None:
    _, headers = new_key(settings)
    body = {"input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h", **change}
    assert_error(client.post("/v1/batches", headers=headers, json=body), 400, param=param)
    assert client.get("/v1/batches", headers=headers).json()["data"] == []


def test_sixteen_metadata_pairs_are_fine(client: TestClient, settings: Settings) -> None:
    _, headers = new_key(settings)
    metadata = {f"k{i}": "v" * 512 for i in range(16)}
    assert refused_batch(client, headers, metadata=metadata).metadata == metadata


def test_create_batch_file_refusals(client: TestClient, settings: Settings) -> None:
    _, headers = new_key(settings)
    body = {"endpoint": CHAT, "completion_window": "24h"}
    missing = client.post("/v1/batches", headers=headers, json={"input_file_id": "file-x", **body})
    assert_error(missing, 404, code="not_found")
    no_model = uploaded(client, headers, jsonl([{"custom_id": "a", "prompt": "hi"}]))
    response = client.post(
        "/v1/batches", headers=headers, json={"input_file_id": no_model.id, **body}
    )
    assert_error(response, 400, param="input_file_id", code="missing_model")
    assert client.get("/v1/batches", headers=headers).json()["data"] == []


def test_unknown_batches(client: TestClient, settings: Settings) -> None:
    _, headers = new_key(settings)
    assert_error(client.get("/v1/batches/batch_nope", headers=headers), 404, code="not_found")
    assert_error(client.post("/v1/batches/batch_nope/cancel", headers=headers), 404)
    assert_error(client.get("/v1/batches?after=batch_nope", headers=headers), 404)
    assert_error(client.get("/v1/nothing-here", headers=headers), 404)


def test_another_tenant_sees_no_batch(client: TestClient, settings: Settings) -> None:
    _, alice = new_key(settings, "alice")
    _, bob = new_key(settings, "bob")
    batch = refused_batch(client, alice)
    assert_error(client.get(f"/v1/batches/{batch.id}", headers=bob), 404, code="not_found")
    assert_error(client.post(f"/v1/batches/{batch.id}/cancel", headers=bob), 404)
    assert_error(client.post(f"/v1/batches/{batch.id}/retry", headers=bob), 404)
    assert_error(client.get(f"/v1/batches?after={batch.id}", headers=bob), 404)
    assert client.get("/v1/batches", headers=bob).json()["data"] == []
    assert client.get(f"/v1/batches/{batch.id}", headers=alice).status_code == 200


def test_batch_pages(client: TestClient, settings: Settings) -> None:
    _, headers = new_key(settings)
    made = [refused_batch(client, headers).id for _ in range(5)]
    newest_first = made[::-1]

    def page(query: str) -> dict[str, Any]:
        response = client.get(f"/v1/batches?{query}", headers=headers)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list"
        ids = [Batch.model_validate(b).id for b in body["data"]]
        ends = (ids[0], ids[-1]) if ids else (None, None)
        assert (body["first_id"], body["last_id"]) == ends
        return {"ids": ids, "has_more": body["has_more"]}

    assert page("") == {"ids": newest_first, "has_more": False}
    seen, query = [], "limit=2"
    pages = []
    while True:
        got = page(query)
        pages.append(got)
        seen += got["ids"]
        if not got["has_more"]:
            break
        query = f"limit=2&after={got['ids'][-1]}"
    assert [len(p["ids"]) for p in pages] == [2, 2, 1]
    assert seen == newest_first
    assert page("limit=5") == {"ids": newest_first, "has_more": False}
    assert page("limit=4") == {"ids": newest_first[:4], "has_more": True}
    assert page(f"after={newest_first[-1]}") == {"ids": [], "has_more": False}
    # Stable: the same page twice.
    assert page(f"limit=2&after={newest_first[1]}") == pages[1]
    for bad in ("limit=0", "limit=101", "limit=x"):
        assert_error(client.get(f"/v1/batches?{bad}", headers=headers), 400, param="limit")


def test_models_lists_what_live_workers_serve(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, headers = new_key(settings)
    body = client.get("/v1/models", headers=headers).json()
    # A non-Redis broker: no registry, only the configured model.
    assert [Model.model_validate(m).id for m in body["data"]] == ["tiny"]

    from batchllm.worker import registry

    monkeypatch.setattr(registry, "served_models", lambda _url: {"b": 1, "a": 2})
    # A model whose workers were scaled to zero lately, and one the operator configured.
    monkeypatch.setattr(registry, "recently_served", lambda _url, _within: {"c": time.time()})
    configured = client_for(settings, served_models=["d"])
    body = configured.get("/v1/models", headers=headers).json()
    models = [Model.model_validate(m) for m in body["data"]]
    assert [m.id for m in models] == ["a", "b", "c", "d"]


def test_a_refused_batch_is_a_failed_job_of_its_tenant(
    client: TestClient, settings: Settings
) -> None:
    owner, headers = new_key(settings)
    batch = refused_batch(client, headers)
    with session_scope(settings) as session:
        assert session.get(BatchRow, job_id_of(batch.id)).owner == owner
        job = session.get(Job, job_id_of(batch.id))
        assert job.status.value == "failed"
        assert "failed batch validation" in job.error


def test_delete_an_ended_batch_of_ones_own_and_not_a_queued_one(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    """batchllm's extension: DELETE /v1/batches/{id} removes the job; its input file stays."""
    owner, headers = new_key(settings)
    _other, stranger = new_key(settings, "other")
    batch = refused_batch(client, headers)

    assert_error(client.delete(f"/v1/batches/{batch.id}", headers=stranger), 404)
    response = client.delete(f"/v1/batches/{batch.id}", headers=headers)

    assert response.status_code == 200, response.text
    assert response.json() == {"id": batch.id, "object": "batch.deleted", "deleted": True}
    assert_error(client.get(f"/v1/batches/{batch.id}", headers=headers), 404)
    with session_scope(settings) as session:
        job_id = job_id_of(batch.id)
        assert session.get(Job, job_id) is None and session.get(BatchRow, job_id) is None
    assert file_rows(settings, owner) == 1 and len(files_on_disk(settings)) == 1

    from batchllm.api.batches import record_batch
    from batchllm.jobs.create import create_job
    from tests.support.fake_runs import make_spec, write_items
    from tests.support.inputs import source_of

    queued = create_from_file(
        write_items(tmp_path / "q.jsonl", 2), make_spec(), settings, shard_size=10
    ).job.id
    record_batch(settings, queued, owner=owner, endpoint=CHAT, window="24h", input_file_id="file-x")
    error = assert_error(
        client.delete(f"/v1/batches/{queued}", headers=headers), 409, code="batch_not_deletable"
    )
    assert "cancel it first" in error["message"]
    with session_scope(settings) as session:
        assert session.get(Job, queued) is not None


def test_an_unexpected_failure_is_an_openai_error(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchllm.worker import registry

    def broken(_url: str) -> dict[str, int]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(registry, "served_models", broken)
    client = TestClient(create_app(settings, auth=False), raise_server_exceptions=False)
    response = client.get("/v1/models")
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": "The server had an error while processing your request.",
            "type": "server_error",
            "param": None,
            "code": "server_error",
        }
    }


def test_a_key_over_its_enqueued_lines_quota_is_refused_with_the_numbers(
    settings: Settings,
) -> None:
    client = client_for(settings, api_max_enqueued_rows=10)
    owner, headers = new_key(settings, "busy")
    _, other = new_key(settings, "other")

    def create(headers: dict[str, str], lines: int) -> Any:
        file = uploaded(client, headers, jsonl([chat_line(f"q{i}") for i in range(lines)]))
        body = {"input_file_id": file.id, "endpoint": CHAT, "completion_window": "24h"}
        return client.post("/v1/batches", headers=headers, json=body)

    assert create(headers, 6).status_code == 200  # no worker: its 6 lines stay enqueued
    refused = create(headers, 5)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    # OpenAI's type for a quota (the SDK raises RateLimitError on the 429).
    assert (error["type"], error["code"]) == ("insufficient_quota", "enqueued_rows_quota_exceeded")
    assert "5 request lines" in error["message"] and "the 6 this API key" in error["message"]
    assert "quota of 10 lines" in error["message"]
    assert create(headers, 4).status_code == 200  # 6 + 4: at the quota, not over it
    listed = client.get("/v1/batches", headers=headers)
    assert listed.headers["x-batchllm-enqueued-rows"] == "10"
    assert listed.headers["x-batchllm-enqueued-rows-limit"] == "10"
    with session_scope(settings) as session:  # the refused create left no batch behind
        assert (
            session.scalar(
                select(func.count()).select_from(BatchRow).where(BatchRow.owner == owner)
            )
            == 2
        )
    # Another key is not held back by this one's lines.
    assert create(other, 10).status_code == 200
    # Cancelling one frees its lines.
    first = listed.json()["data"][-1]["id"]
    assert client.post(f"/v1/batches/{first}/cancel", headers=headers).status_code == 200
    assert create(headers, 5).status_code == 200
    assert client.get("/v1/batches", headers=headers).headers["x-batchllm-enqueued-rows"] == "9"
