"""Reading a fleet job back and checking its rows: what the integration and fault suites
assert after a job ran (every line exactly once, or at most once after a crash)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy import select

from batchllm.output.parts import read_output
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import Checkpoint, Job, Shard

T = TypeVar("T")


def load_job(fleet_env, job_id: str) -> tuple[Job, list[Shard]]:
    with session_scope(fleet_env.settings) as session:
        job = session.get(Job, job_id)
        session.refresh(job)
        shards = list(
            session.scalars(select(Shard).where(Shard.job_id == job_id).order_by(Shard.index))
        )
        return job, shards


def wait_for(
    check: Callable[[], T | None],
    *,
    timeout: float,
    what: str | Callable[[], str],
    interval: float = 0.25,
) -> T:
    """`check()`'s first true value, asked every `interval` seconds; an AssertionError naming
    `what` (a text, or a function that tells it at the time, e.g. with log tails) at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            told = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {told}")
        time.sleep(interval)


def wait_until_final(fleet_env, job_id: str, timeout: float) -> Job:
    def final():
        job, _ = load_job(fleet_env, job_id)
        return job if job.status.is_final else None

    return wait_for(final, timeout=timeout, what=f"job {job_id} to end")


def expected_rows(source: Path) -> dict[int, tuple[str, str]]:
    """Every input line: its custom_id and whether it must come out `ok` or `error`."""
    expected = {}
    for number, raw in enumerate(source.read_text().splitlines(), start=1):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            obj = {}
        valid = bool(obj.get("prompt") or obj.get("messages") or obj.get("body"))
        expected[number] = (obj.get("custom_id") or f"line-{number}", "ok" if valid else "error")
    return expected


def output_rows(fleet_env, job_id: str) -> list[dict]:
    storage = Storage.of(fleet_env.settings)
    return read_output(storage, storage.output_dir(job_id)).to_pylist()


def assert_each_line_at_most_once(rows: list[dict], expected: dict[int, tuple[str, str]]) -> None:
    lines = [r["line"] for r in rows]
    assert len(lines) == len(set(lines)), "a line was written more than once"
    for row in rows:
        assert (row["custom_id"], row["status"]) == expected[row["line"]], row
        if row["status"] == "ok":
            assert row["text"] is not None and row["completion_tokens"] > 0, row


def assert_exactly_once(rows: list[dict], expected: dict[int, tuple[str, str]]) -> None:
    assert_each_line_at_most_once(rows, expected)
    assert {r["line"] for r in rows} == set(expected)


def checkpoints_of(fleet_env, shard_id: int) -> list[Checkpoint]:
    with session_scope(fleet_env.settings) as session:
        return list(
            session.scalars(
                select(Checkpoint).where(Checkpoint.shard_id == shard_id).order_by(Checkpoint.seq)
            )
        )
