"""Uploads are refused before their body is read, and a body streamed past the limit is cut off
there: the temp space a refused upload takes is bounded by the limit, never by the client."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from batchllm.store.db import session_scope
from batchllm.store.models import StoredFile
from tests.support.rawhttp import (
    TempProbe,
    connect,
    read_response,
    stream_chunked_upload,
    upload_head,
)
from tests.support.serve import MAX_FILE_BYTES, Served

pytestmark = pytest.mark.security

# FastAPI's multipart parser keeps up to 1 MiB of a part in memory before spilling to disk;
# what reaches the temp dir is bounded by the limit plus the multipart framing (guard.FRAMING).
FRAMING = 64 * 1024


def assert_error(body: dict, code: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code, body
    assert "Traceback" not in body["error"]["message"]


def stored_files(serve: Served) -> int:
    with session_scope(serve.settings) as session:
        return session.scalar(select(func.count()).select_from(StoredFile))


def test_an_upload_without_a_valid_key_is_refused_before_its_body_is_read(serve: Served) -> None:
    before = stored_files(serve)
    for headers, code in (
        ({}, "missing_api_key"),
        ({"Authorization": "Bearer sk-batchllm-not-a-key"}, "invalid_api_key"),
    ):
        with TempProbe(serve.proc.pid, serve.tmpdir) as probe:
            streamed = stream_chunked_upload(serve.port, headers, total=256 << 20)
        assert streamed.response is not None, streamed
        assert streamed.response.status == 401
        assert_error(streamed.response.json(), code)
        # Refused at once: not after the server took the client's 256 MB.
        assert streamed.seconds < 5, streamed
        assert streamed.sent < 64 << 20, streamed
        assert probe.peak == 0, f"{probe.peak:,} temp bytes held for an unauthenticated upload"
    assert stored_files(serve) == before


def test_a_declared_oversize_upload_is_refused_before_any_body(serve: Served) -> None:
    headers = serve.new_key()
    with connect(serve.port) as sock, TempProbe(serve.proc.pid, serve.tmpdir) as probe:
        # The head only: the 413 must come without a byte of the 300 MB body.
        sock.sendall(upload_head(serve.port, headers, content_length=300 << 20))
        response = read_response(sock, timeout=10)
    assert response.status == 413
    assert_error(response.json(), "file_too_large")
    assert f"{MAX_FILE_BYTES:,} bytes" in response.json()["error"]["message"]
    assert response.headers.get("connection") == "close"
    assert probe.peak == 0


def test_a_chunked_upload_is_cut_off_at_the_limit(serve: Served) -> None:
    headers = serve.new_key()
    before = stored_files(serve)
    with TempProbe(serve.proc.pid, serve.tmpdir) as probe:
        streamed = stream_chunked_upload(serve.port, headers, total=64 << 20)
    assert streamed.response is not None and streamed.response.status == 413, streamed
    assert_error(streamed.response.json(), "file_too_large")
    assert probe.peak <= MAX_FILE_BYTES + FRAMING, f"{probe.peak:,} temp bytes"
    assert streamed.sent < 32 << 20, streamed  # stopped near the limit, not at the end
    assert stored_files(serve) == before
    files_dir = serve.settings.home / "jobs" / "files"
    assert not files_dir.exists() or not any(files_dir.iterdir())


def test_an_upload_within_the_limit_is_stored_whole(serve: Served) -> None:
    headers = serve.new_key()
    streamed = stream_chunked_upload(serve.port, headers, total=1 << 20, chunk=256 << 10)
    assert streamed.response is not None and streamed.response.status == 200, streamed
    file = streamed.response.json()
    assert (file["object"], file["bytes"], file["filename"]) == ("file", 1 << 20, "big.jsonl")
    assert stored_files(serve) >= 1
