"""`batchllm serve --workers 2`: two server processes answer on one port, every request is
answered, and the expiry round still runs (once, in the parent: no worker process runs it)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from batchllm.store.db import session_scope
from batchllm.store.models import Job, job_id_of
from batchllm.store.states import JobStatus
from tests.support.serve import SERVED_MODEL, start_serve, stop_serve

pytestmark = pytest.mark.integration

# The model `start_serve` configures (no worker runs here: the batch waits, then expires).
LINES = b"".join(
    b'{"custom_id": "c%d", "method": "POST", "url": "/v1/chat/completions", "body": '
    b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}}\n'
    % (i, SERVED_MODEL.encode())
    for i in range(3)
)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _server_processes(pid: int) -> list[int]:
    """The parent's children that run the app (uvicorn's workers are spawned: their command
    line is multiprocessing's, not batchllm's)."""
    return [
        child
        for child in _children(pid)
        if b"multiprocessing.spawn" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


def test_two_server_processes_answer_and_batches_still_expire(tmp_path: Path) -> None:
    served = start_serve(tmp_path, "--workers", "2")
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2:
            assert time.monotonic() < deadline, _children(served.proc.pid)
            time.sleep(0.5)
            workers = _server_processes(served.proc.pid)
        headers = served.new_key()
        with httpx.Client(base_url=served.base_url, headers=headers, timeout=60) as client:
            uploaded = client.post(
                "/v1/files", files={"file": ("a.jsonl", LINES)}, data={"purpose": "batch"}
            )
            assert uploaded.status_code == 200, uploaded.text
            created = client.post(
                "/v1/batches",
                json={
                    "input_file_id": uploaded.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "5s",
                },
            )
            assert created.status_code == 200, created.text
        batch_id = created.json()["id"]

        async def polls() -> list[int]:
            async with httpx.AsyncClient(
                base_url=served.base_url, headers=headers, timeout=60
            ) as client:
                answers = await asyncio.gather(
                    *(client.get(f"/v1/batches/{batch_id}") for _ in range(60))
                )
            return [answer.status_code for answer in answers]

        assert asyncio.run(polls()) == [200] * 60
        # Nobody reads the batch now: only the parent's round can end it (the window is 5 s,
        # the round every BATCHLLM_RECONCILE_SECONDS, 1 s here).
        deadline = time.monotonic() + 120
        while True:
            with session_scope(served.settings) as session:
                status = session.get(Job, job_id_of(batch_id)).status
            if status is JobStatus.EXPIRED:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
    finally:
        stop_serve(served)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in workers):
        assert time.monotonic() < deadline, f"server processes {workers} outlived serve"
        time.sleep(0.5)
