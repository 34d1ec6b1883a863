"""The per-key quotas hold under concurrency: 30 creates sent at once by one key with
BATCHLLM_API_MAX_ACTIVE_BATCHES=3 accept exactly 3, and with BATCHLLM_API_MAX_ENQUEUED_ROWS=11
and 2-line files exactly floor(11/2) = 5; the refused ones leave no job, on SQLite and on
PostgreSQL (before the count and the insert shared a lock, 15-27 were accepted). And the
enqueued-rows quota through the `openai` SDK: a key over it gets a 429 (RateLimitError) naming
its numbers, another key is unaffected.

The server dispatches to the in-memory broker (tests/support/serve.py's Served): no worker runs,
so every accepted batch's lines stay enqueued."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from batchllm.settings import Settings
from batchllm.store.db import get_engine, session_scope, upgrade
from batchllm.store.models import Batch, Job, job_id_of
from tests.support.serve import (
    HOST,
    MAX_ACTIVE_BATCHES,
    REPO,
    Served,
    free_port,
    start_serve,
    stop_serve,
)
from tests.support.services import postgres_database

pytestmark = pytest.mark.security

CHAT = "/v1/chat/completions"
CREATES = 30
LINES = 2  # each raced batch's file
ENQUEUED_LIMIT = 11  # floor(11 / 2) = 5 batches fit, with a line to spare
# High enough that only the enqueued-rows quota refuses in its race.
ROWS_RACE_ENV = {
    "BATCHLLM_API_MAX_ENQUEUED_ROWS": str(ENQUEUED_LIMIT),
    "BATCHLLM_API_MAX_ACTIVE_BATCHES": "1000",
}


def _line(custom_id: str) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    line = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}
    return json.dumps(line).encode() + b"\n"


def _race(served: Served, *, accepts: int, code: str) -> None:
    """30 creates of one 2-line file at once: exactly `accepts` accepted, the others refused
    429 with `code`, and only the accepted ones' jobs and batches recorded."""
    headers = served.new_key("racer")
    with httpx.Client(base_url=served.base_url, headers=headers, timeout=120) as client:
        upload = client.post(
            "/v1/files",
            files={"file": ("in.jsonl", _line("a") + _line("b"), "application/jsonl")},
            data={"purpose": "batch"},
        )
        assert upload.status_code == 200, upload.text
        file_id = upload.json()["id"]

    def create(_: int) -> httpx.Response:
        # A client each: one connection per request, all in flight at once.
        with httpx.Client(base_url=served.base_url, headers=headers, timeout=120) as one:
            return one.post(
                "/v1/batches",
                json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"},
            )

    with ThreadPoolExecutor(CREATES) as pool:
        responses = list(pool.map(create, range(CREATES)))
    statuses = sorted(r.status_code for r in responses)
    expected = [200] * accepts + [429] * (CREATES - accepts)
    assert statuses == expected, (
        f"{statuses.count(200)} of {CREATES} accepted: "
        f"{[r.text[:120] for r in responses if r.status_code not in (200, 429)]}"
    )
    for refused in (r for r in responses if r.status_code == 429):
        assert refused.json()["error"]["code"] == code, refused.text
    accepted = {job_id_of(r.json()["id"]) for r in responses if r.status_code == 200}
    with session_scope(served.settings) as session:
        batches = set(session.scalars(select(Batch.job_id)))
        jobs = session.scalar(select(func.count()).select_from(Job))
    assert batches == accepted
    # A create refused when its batch came to be recorded leaves no job behind.
    assert jobs == accepts
    with httpx.Client(base_url=served.base_url, headers=headers, timeout=120) as client:
        listed = client.get("/v1/batches")
    assert listed.headers["x-batchllm-enqueued-rows"] == str(accepts * LINES)


@contextmanager
def _served(tmp_path: Path, postgres: bool, **env: str) -> Iterator[Served]:
    """A server on the home's SQLite database, or on a fresh PostgreSQL database."""
    if not postgres:
        served = start_serve(tmp_path, **env)
        try:
            yield served
        finally:
            stop_serve(served)
        return
    with postgres_database(f"batchllm_quota_{uuid.uuid4().hex[:12]}") as url:
        upgrade(url)
        served = start_serve(tmp_path, database_url=url, **env)
        try:
            yield served
        finally:
            stop_serve(served)
            get_engine(served.settings).dispose()


def test_30_concurrent_creates_accept_exactly_the_quota_on_sqlite(tmp_path: Path) -> None:
    with _served(tmp_path, postgres=False) as served:
        _race(served, accepts=MAX_ACTIVE_BATCHES, code="batch_quota_exceeded")


def test_30_concurrent_creates_accept_exactly_the_quota_on_postgresql(tmp_path: Path) -> None:
    with _served(tmp_path, postgres=True) as served:
        _race(served, accepts=MAX_ACTIVE_BATCHES, code="batch_quota_exceeded")


@pytest.mark.parametrize("postgres", [False, True], ids=["sqlite", "postgresql"])
def test_30_concurrent_creates_take_exactly_the_enqueued_rows_quota(
    tmp_path: Path, postgres: bool
) -> None:
    with _served(tmp_path, postgres, **ROWS_RACE_ENV) as served:
        _race(served, accepts=ENQUEUED_LIMIT // LINES, code="enqueued_rows_quota_exceeded")


def test_a_key_over_its_enqueued_rows_quota_is_refused_and_another_key_is_not(
    tmp_path: Path,
) -> None:
    """Through the `openai` SDK: alice's 6 lines enqueued, a 6-line batch more is over her
    quota of 11 (a RateLimitError naming 6 asked, 6 in use, 11 the quota) and leaves nothing
    recorded; bob's 11 lines at once are accepted."""
    openai = pytest.importorskip("openai")
    from openai.types import Batch as BatchObject

    with _served(tmp_path, postgres=False, **ROWS_RACE_ENV) as served:

        def client(name: str) -> Any:
            key = served.new_key(name)["Authorization"].removeprefix("Bearer ")
            return openai.OpenAI(
                base_url=f"{served.base_url}/v1",
                api_key=key,
                max_retries=0,
                timeout=60,
                _strict_response_validation=True,  # every object parsed by the SDK's models
            )

        def create(one: Any, lines: int, prefix: str) -> BatchObject:
            content = b"".join(_line(f"{prefix}-{i}") for i in range(lines))
            file = one.files.create(file=("in.jsonl", content), purpose="batch")
            return one.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")

        alice, bob = client("alice"), client("bob")
        first = create(alice, 6, "first")
        assert (first.status, first.request_counts.total) == ("in_progress", 6)
        with pytest.raises(openai.RateLimitError) as caught:
            create(alice, 6, "second")
        error = caught.value
        assert (error.status_code, error.code) == (429, "enqueued_rows_quota_exceeded")
        assert error.type == "insufficient_quota"
        message = error.message
        assert "this batch's 6 request lines and the 6 this API key has enqueued" in message
        assert "exceed its quota of 11 lines" in message
        assert [b.id for b in alice.batches.list().data] == [first.id]
        listed = alice.batches.with_raw_response.list()
        assert listed.headers["x-batchllm-enqueued-rows"] == "6"
        assert listed.headers["x-batchllm-enqueued-rows-limit"] == str(ENQUEUED_LIMIT)
        # Bob's quota is his own: all 11 lines at once.
        bobs = create(bob, ENQUEUED_LIMIT, "bob")
        assert (bobs.status, bobs.request_counts.total) == ("in_progress", ENQUEUED_LIMIT)
        assert bob.batches.with_raw_response.list().headers["x-batchllm-enqueued-rows"] == "11"
        # Alice's 5 more lines fit: 6 + 5 is at the quota, not over it.
        assert create(alice, 5, "third").request_counts.total == 5
        with session_scope(served.settings) as session:
            assert session.scalar(select(func.count()).select_from(Job)) == 3
