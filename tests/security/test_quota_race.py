"""The active-batch quota holds under concurrency: 30 creates sent at once by one key with
BATCHLLM_API_MAX_ACTIVE_BATCHES=3 accept exactly 3 and leave no job of the refused ones, on
SQLite and on PostgreSQL (before the count and the insert shared a lock, 15-27 were accepted)."""

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

import httpx
import pytest
from sqlalchemy import func, select

from batchllm.settings import Settings
from batchllm.store.db import get_engine, session_scope, upgrade
from batchllm.store.models import Batch, Job
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


def _line(custom_id: str) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    line = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}
    return json.dumps(line).encode() + b"\n"


def _race(served: Served) -> None:
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
    expected = [200] * MAX_ACTIVE_BATCHES + [429] * (CREATES - MAX_ACTIVE_BATCHES)
    assert statuses == expected, (
        f"{statuses.count(200)} of {CREATES} accepted: "
        f"{[r.text[:120] for r in responses if r.status_code not in (200, 429)]}"
    )
    for refused in (r for r in responses if r.status_code == 429):
        assert refused.json()["error"]["code"] == "batch_quota_exceeded", refused.text
    accepted = {r.json()["id"] for r in responses if r.status_code == 200}
    with session_scope(served.settings) as session:
        batches = set(session.scalars(select(Batch.job_id)))
        jobs = session.scalar(select(func.count()).select_from(Job))
    assert batches == accepted
    # A create refused when its batch came to be recorded leaves no job behind.
    assert jobs == MAX_ACTIVE_BATCHES


def test_30_concurrent_creates_accept_exactly_the_quota_on_sqlite(tmp_path: Path) -> None:
    served = start_serve(tmp_path)
    try:
        _race(served)
    finally:
        stop_serve(served)


def test_30_concurrent_creates_accept_exactly_the_quota_on_postgresql(tmp_path: Path) -> None:
    with postgres_database(f"batchllm_quota_{uuid.uuid4().hex[:12]}") as url:
        upgrade(url)
        served = start_serve(tmp_path, database_url=url)
        try:
            _race(served)
        finally:
            stop_serve(served)
            get_engine(served.settings).dispose()
