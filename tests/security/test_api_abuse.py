"""Hostile or odd input to the Batch API's routes: every answer an OpenAI-shaped error with a
4xx status naming what is wrong (never a 500, never a traceback), limits per key, and batches
that end on time with counts that agree with their files."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchllm.store.db import session_scope
from batchllm.store.models import Job, job_id_of
from tests.support.serve import MAX_ACTIVE_BATCHES, MAX_STORED_BYTES, Served

pytestmark = pytest.mark.security

CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, model: str = "tiny") -> bytes:
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
    }
    return json.dumps(line).encode() + b"\n"


def api(serve: Served) -> httpx.Client:
    return httpx.Client(base_url=serve.base_url, headers=serve.new_key(), timeout=30)


def upload(client: httpx.Client, content: bytes, name: str = "in.jsonl") -> dict[str, Any]:
    response = client.post(
        "/v1/files",
        files={"file": (name, content, "application/jsonl")},
        data={"purpose": "batch"},
    )
    assert response.status_code == 200, response.text
    return response.json()


def create_batch(client: httpx.Client, file_id: str, window: str = "24h") -> httpx.Response:
    return client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": window},
    )


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] is not None, body
    if code is not None:
        assert body["error"]["code"] == code, body
    assert "Traceback" not in response.text
    return body["error"]


def test_a_deeply_nested_line_is_not_a_server_error(serve: Served) -> None:
    with api(serve) as client:
        file = upload(client, chat_line("ok") + b"[" * 100_000 + b"\n")
        response = create_batch(client, file["id"])
        assert response.status_code == 200, response.text
        batch = response.json()
        # The line is one of the batch's requests, and an error line of it.
        assert batch["request_counts"]["total"] == 2
        assert batch["status"] == "in_progress"


@pytest.mark.parametrize(
    "window", ["9999999999h", "24h\n", "\u0661h", "25h", "0h", "24", "1d", " 24h", "86401s"]
)
def test_a_completion_window_other_than_up_to_24h_is_refused(serve: Served, window: str) -> None:
    with api(serve) as client:
        file = upload(client, chat_line("a"))
        error = assert_error(create_batch(client, file["id"], window), 400, "invalid_value")
        assert error["param"] == "completion_window"


def test_a_file_whose_stored_copy_is_missing_is_an_error_before_any_byte(serve: Served) -> None:
    with api(serve) as client:
        file = upload(client, chat_line("a"))
        stored = serve.settings.home / "jobs" / "files" / f"{file['id']}.jsonl"
        stored.unlink()
        response = client.get(f"/v1/files/{file['id']}/content")
        assert_error(response, 404, "file_content_missing")
        assert_error(create_batch(client, file["id"]), 404, "file_content_missing")
        # The file object itself still answers (and can be deleted).
        assert client.get(f"/v1/files/{file['id']}").status_code == 200
        assert client.delete(f"/v1/files/{file['id']}").status_code == 200


def job_status(serve: Served, job_id: str) -> str:
    with session_scope(serve.settings) as session:
        job = session.get(Job, job_id_of(job_id))  # the API's batch id names its job
        assert job is not None
        return job.status.value


def test_a_batch_expires_on_time_with_only_serve_running(serve: Served) -> None:
    with api(serve) as client:
        file = upload(client, b"".join(chat_line(f"r{i}") for i in range(5)))
        response = create_batch(client, file["id"], "2s")
        assert response.status_code == 200, response.text
        batch = response.json()
        assert batch["status"] == "in_progress"
        # Nobody reads it through the API meanwhile: serve ends it by itself, on its next
        # reconciler pass (every second here). The deadline is generous: a pass on a 2-core
        # machine busy with other suites took over 15 s once (load 14).
        deadline = batch["expires_at"] + 90
        while (status := job_status(serve, batch["id"])) != "expired":
            assert time.time() < deadline, f"still {status} 90 s after expires_at"
            time.sleep(0.2)
        assert time.time() >= batch["expires_at"]
        ended = client.get(f"/v1/batches/{batch['id']}").json()
        assert ended["status"] == "expired" and ended["expired_at"] is not None
        errors = client.get(f"/v1/files/{ended['error_file_id']}/content").text.splitlines()
        assert [json.loads(e)["error"]["code"] for e in errors] == ["batch_expired"] * 5
        assert ended["output_file_id"] is None  # no line ran: no output file id, as OpenAI
        assert ended["request_counts"] == {"total": 5, "completed": 0, "failed": 5}


def test_an_upload_with_two_file_parts_is_refused(serve: Served) -> None:
    with api(serve) as client:
        response = client.post(
            "/v1/files",
            files=[
                ("file", ("a.jsonl", chat_line("a"), "application/jsonl")),
                ("file", ("b.jsonl", chat_line("b"), "application/jsonl")),
            ],
            data={"purpose": "batch"},
        )
        assert assert_error(response, 400, "invalid_value")["param"] == "file"
        assert client.get("/v1/files").json()["data"] == []


def test_a_wrong_purpose_has_a_code(serve: Served) -> None:
    with api(serve) as client:
        response = client.post(
            "/v1/files",
            files={"file": ("a.jsonl", chat_line("a"), "application/jsonl")},
            data={"purpose": "fine-tune"},
        )
        assert assert_error(response, 400, "invalid_value")["param"] == "purpose"


@pytest.mark.parametrize("name", ["a" * 3000, "a\x00b.jsonl", "a\rb.jsonl", "a\x1bb.jsonl"])
def test_a_file_name_too_long_or_with_control_characters_is_refused(
    serve: Served, name: str
) -> None:
    # Built by hand: an HTTP client would escape some of these characters in the name.
    body = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="'
        + name.encode()
        + b'"\r\nContent-Type: application/jsonl\r\n\r\n'
        + chat_line("a")
        + b"\r\n--b--\r\n"
    )
    with api(serve) as client:
        response = client.post(
            "/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"}
        )
        error = assert_error(response, 400)
        # A CR ends the part's header line: the multipart body itself is malformed then.
        assert (error["code"], error["param"]) in (
            ("invalid_value", "file"),
            ("invalid_request", None),
        ), error
        assert client.get("/v1/files").json()["data"] == []


def test_a_megabyte_custom_id_fails_the_batch_naming_its_line(serve: Served) -> None:
    with api(serve) as client:
        file = upload(client, chat_line("a") + chat_line("x" * (1 << 20)))
        response = create_batch(client, file["id"])
        assert response.status_code == 200, response.text
        batch = response.json()
        assert batch["status"] == "failed"
        [error] = batch["errors"]["data"]
        assert (error["code"], error["param"], error["line"]) == (
            "invalid_custom_id",
            "custom_id",
            2,
        )


def test_a_key_may_have_only_so_many_unfinished_batches(serve: Served) -> None:
    with api(serve) as client:
        file = upload(client, chat_line("a"))
        for _ in range(MAX_ACTIVE_BATCHES):
            assert create_batch(client, file["id"]).status_code == 200
        refused = create_batch(client, file["id"])
        assert_error(refused, 429, "batch_quota_exceeded")
        assert refused.json()["error"]["type"] == "insufficient_quota"
        assert len(client.get("/v1/batches").json()["data"]) == MAX_ACTIVE_BATCHES
        # Another key is not held back by this one's batches.
        with api(serve) as other:
            other_file = upload(other, chat_line("b"))
            assert create_batch(other, other_file["id"]).status_code == 200
        # Cancelling one makes room again.
        first = client.get("/v1/batches").json()["data"][0]["id"]
        assert client.post(f"/v1/batches/{first}/cancel").status_code == 200
        deadline = time.monotonic() + 30
        while client.get(f"/v1/batches/{first}").json()["status"] != "cancelled":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert create_batch(client, file["id"]).status_code == 200


def test_a_key_may_store_only_so_many_bytes(serve: Served) -> None:
    with api(serve) as client:
        content = chat_line("a") * (1_500_000 // len(chat_line("a")))
        kept = []
        while sum(len(content) for _ in kept) + len(content) <= MAX_STORED_BYTES:
            kept.append(upload(client, content)["id"])
        refused = client.post(
            "/v1/files",
            files={"file": ("more.jsonl", content, "application/jsonl")},
            data={"purpose": "batch"},
        )
        assert_error(refused, 429, "storage_quota_exceeded")
        assert len(client.get("/v1/files").json()["data"]) == len(kept)
        files_dir = serve.settings.home / "jobs" / "files"
        assert all(Path(files_dir / f"{f}.jsonl").exists() for f in kept)
        assert client.delete(f"/v1/files/{kept[0]}").status_code == 200
        assert upload(client, content)["bytes"] == len(content)


def test_files_are_listed_in_cursor_pages(serve: Served) -> None:
    with api(serve) as client:
        ids = [upload(client, chat_line(str(i)))["id"] for i in range(3)]
        first = client.get("/v1/files", params={"limit": 2}).json()
        assert [f["id"] for f in first["data"]] == ids[::-1][:2]
        assert (first["has_more"], first["last_id"]) == (True, ids[1])
        rest = client.get("/v1/files", params={"limit": 2, "after": first["last_id"]}).json()
        assert ([f["id"] for f in rest["data"]], rest["has_more"]) == ([ids[0]], False)
        assert_error(client.get("/v1/files", params={"limit": 0}), 400, "invalid_value")
        assert_error(client.get("/v1/files", params={"after": "file-nope"}), 404, "not_found")
