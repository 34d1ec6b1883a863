"""The per-key quotas hold under concurrency: 30 creates sent at once by one key with
BATCHLLM_API_MAX_ACTIVE_BATCHES=3 accept exactly 3, and with BATCHLLM_API_MAX_ENQUEUED_ROWS=11
and 2-line files exactly floor(11/2) = 5; the refused ones leave no job, on SQLite and on
PostgreSQL (before the count and the insert shared a lock, 15-27 were accepted); with
BATCHLLM_API_MAX_ENQUEUED_TOKENS=55 and 10-token files exactly 5 run and the 25 others are
failed batches (`token_limit_exceeded`, as OpenAI fails them). And through the `openai` SDK: a
key over its enqueued rows gets a 429 (RateLimitError) naming its numbers, a key over its
enqueued tokens a failed batch naming them; another key is unaffected either way, and the
tokens come back when a batch ends.

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
from batchllm.store.db import session_scope, upgrade
from batchllm.store.models import Batch, Job, job_id_of
from batchllm.store.states import JobStatus
from tests.support.cli import REPO
from tests.support.serve import (
    HOST,
    MAX_ACTIVE_BATCHES,
    Served,
    free_port,
    running_serve,
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
# A line asking "hi" as the user is estimated at 5 prompt tokens (api/enqueued.py): a 2-line
# file 10, so floor(55 / 10) = 5 batches fit, with tokens to spare.
LINE_TOKENS = 5
TOKEN_LIMIT = 55
TOKENS_RACE_ENV = {
    "BATCHLLM_API_MAX_ENQUEUED_TOKENS": str(TOKEN_LIMIT),
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
    responses = _all_at_once(served, headers, _upload(served, headers))
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


def _upload(served: Served, headers: dict[str, str]) -> str:
    with httpx.Client(base_url=served.base_url, headers=headers, timeout=120) as client:
        upload = client.post(
            "/v1/files",
            files={"file": ("in.jsonl", _line("a") + _line("b"), "application/jsonl")},
            data={"purpose": "batch"},
        )
    assert upload.status_code == 200, upload.text
    return upload.json()["id"]


def _all_at_once(served: Served, headers: dict[str, str], file_id: str) -> list[httpx.Response]:
    """CREATES creates of the file, all in flight at once (a client each: one connection per
    request)."""

    def create(_: int) -> httpx.Response:
        with httpx.Client(base_url=served.base_url, headers=headers, timeout=120) as one:
            return one.post(
                "/v1/batches",
                json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"},
            )

    with ThreadPoolExecutor(CREATES) as pool:
        return list(pool.map(create, range(CREATES)))


def _token_race(served: Served) -> None:
    """30 creates of one 10-token file at once against a limit of 55 tokens: every create
    answers 200 with a batch (as OpenAI's), exactly 5 running and 25 failed with
    `token_limit_exceeded` and the numbers; the key's enqueued tokens are exactly 50."""
    headers = served.new_key("racer")
    responses = _all_at_once(served, headers, _upload(served, headers))
    assert [r.status_code for r in responses] == [200] * CREATES, [
        r.text[:200] for r in responses if r.status_code != 200
    ]
    batches = [r.json() for r in responses]
    running = [b for b in batches if b["status"] == "in_progress"]
    failed = [b for b in batches if b["status"] == "failed"]
    fits = TOKEN_LIMIT // (LINES * LINE_TOKENS)
    assert (len(running), len(failed)) == (fits, CREATES - fits), [b["status"] for b in batches]
    for batch in failed:
        (error,) = batch["errors"]["data"]
        assert error["code"] == "token_limit_exceeded", error
        assert f"Limit: {TOKEN_LIMIT} enqueued tokens" in error["message"], error
        assert "This batch's 10 prompt tokens (estimated)" in error["message"], error
    with session_scope(served.settings) as session:
        live = session.scalars(select(Job.id).where(Job.status != JobStatus.FAILED)).all()
        jobs = set(session.scalars(select(Job.id)))
    assert set(live) == {job_id_of(b["id"]) for b in running}
    # One job per create: a job made for a batch found over the limit when it was recorded
    # was dropped, the failed batch recorded in its place (no lines, nothing run).
    assert jobs == {job_id_of(b["id"]) for b in batches}
    assert all(b["request_counts"]["total"] == 0 for b in failed)
    with httpx.Client(base_url=served.base_url, headers=headers, timeout=120) as client:
        listed = client.get("/v1/batches", params={"limit": 100})
    assert json.loads(listed.headers["x-batchllm-enqueued-tokens"]) == {
        "tiny": fits * LINES * LINE_TOKENS
    }
    assert listed.headers["x-batchllm-enqueued-tokens-limit"] == str(TOKEN_LIMIT)


@contextmanager
def _served(tmp_path: Path, postgres: bool, **env: str) -> Iterator[Served]:
    """A server on the home's SQLite database, or on a fresh PostgreSQL database."""
    if not postgres:
        with running_serve(tmp_path, **env) as served:
            yield served
        return
    with postgres_database(f"batchllm_quota_{uuid.uuid4().hex[:12]}") as url:
        upgrade(url)
        with running_serve(tmp_path, database_url=url, **env) as served:
            yield served


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


@pytest.mark.parametrize("postgres", [False, True], ids=["sqlite", "postgresql"])
def test_30_concurrent_creates_take_exactly_the_enqueued_token_limit(
    tmp_path: Path, postgres: bool
) -> None:
    with _served(tmp_path, postgres, **TOKENS_RACE_ENV) as served:
        _token_race(served)


def test_a_key_over_its_enqueued_rows_quota_is_refused_and_another_key_is_not(
    tmp_path: Path,
) -> None:
    """Through the `openai` SDK: alice's 6 lines enqueued, a 6-line batch more is over her
    quota of 11 (a RateLimitError naming 6 asked, 6 in use, 11 the quota) and leaves nothing
    recorded; bob's 11 lines at once are accepted."""
    openai = pytest.importorskip("openai")
    from openai.types import Batch as BatchObject

    with _served(tmp_path, postgres=False, **ROWS_RACE_ENV) as served:

        def create(one: Any, lines: int, prefix: str) -> BatchObject:
            content = b"".join(_line(f"{prefix}-{i}") for i in range(lines))
            file = one.files.create(file=("in.jsonl", content), purpose="batch")
            return one.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")

        alice, bob = _sdk_client(served, "alice"), _sdk_client(served, "bob")
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


def _sdk_client(served: Served, name: str) -> Any:
    """An `openai` client for a new key `name`, every object parsed by the SDK's models."""
    openai = pytest.importorskip("openai")
    key = served.new_key(name)["Authorization"].removeprefix("Bearer ")
    return openai.OpenAI(
        base_url=f"{served.base_url}/v1",
        api_key=key,
        max_retries=0,
        timeout=60,
        _strict_response_validation=True,
    )


def test_a_key_over_its_enqueued_tokens_gets_a_failed_batch_and_another_key_does_not(
    tmp_path: Path,
) -> None:
    """Through the `openai` SDK, as OpenAI answers a batch over an organization's enqueued
    tokens: alice's 3 batches of 3 lines (15 tokens each) hold 45 of her 55; a fourth is
    created `failed`, errors.data[0].code `token_limit_exceeded`, its message naming the
    limit, the batch's tokens and hers; bob's 55 tokens at once run; alice's tokens come back
    when a batch of hers ends (cancelled), and the same batch then runs."""
    from openai.types import Batch as BatchObject

    with _served(tmp_path, postgres=False, **TOKENS_RACE_ENV) as served:
        alice, bob = _sdk_client(served, "alice"), _sdk_client(served, "bob")

        def create(one: Any, lines: int, prefix: str) -> BatchObject:
            content = b"".join(_line(f"{prefix}-{i}") for i in range(lines))
            file = one.files.create(file=("in.jsonl", content), purpose="batch")
            return one.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")

        held = [create(alice, 3, f"held{i}") for i in range(3)]
        assert [b.status for b in held] == ["in_progress"] * 3
        over = create(alice, 3, "over")
        assert over.status == "failed"
        assert over.errors is not None and over.errors.data is not None
        (error,) = over.errors.data
        assert error.code == "token_limit_exceeded"
        assert error.message == (
            "Enqueued token limit reached for tiny for this API key. Limit: 55 enqueued tokens. "
            "This batch's 15 prompt tokens (estimated) and the 45 already enqueued in this "
            "key's unfinished batches of tiny exceed it. Please try submitting your requests "
            "again later, once batches finish."
        )
        listed = alice.batches.with_raw_response.list()
        assert json.loads(listed.headers["x-batchllm-enqueued-tokens"]) == {"tiny": 45}
        assert listed.headers["x-batchllm-enqueued-tokens-limit"] == str(TOKEN_LIMIT)
        # Bob's limit is his own: 11 lines, all 55 tokens, at once.
        assert create(bob, 11, "bob").status == "in_progress"
        # A batch of alice's ends: its 15 tokens come back, and the batch refused now runs.
        assert alice.batches.cancel(held[0].id).status in ("cancelling", "cancelled")
        tokens = alice.batches.with_raw_response.list().headers["x-batchllm-enqueued-tokens"]
        assert json.loads(tokens) == {"tiny": 30}
        assert create(alice, 3, "again").status == "in_progress"
