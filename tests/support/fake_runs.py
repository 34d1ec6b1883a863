"""Runs of real jobs on the package's fake engine (batchllm/execution/stand_in_engines.py), for the unit
tests of the runner, delivery, reconciler, client and exports: the input files they write, the
spec they run under, and what they read back."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import update

from batchllm.engine.protocol import Finished
from batchllm.execution.runner import ShardRunner
from batchllm.execution.stand_in_engines import FAKE_MAX_MODEL_LEN, FakeEngine, FakeEngines
from batchllm.jobs.create import create_job
from batchllm.output import commit
from batchllm.output.parts import list_parts, read_output
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus, utcnow
from tests.support.inputs import source_of

__all__ = ["FakeEngine", "FakeEngines"]

MAX_MODEL_LEN = FAKE_MAX_MODEL_LEN
DEFAULT_MAX_TOKENS = 5


def make_spec() -> JobSpec:
    return JobSpec(
        model="/models/fake",
        sampling=SamplingDefaults(max_tokens=DEFAULT_MAX_TOKENS),
        engine=EngineOptions(max_model_len=MAX_MODEL_LEN),
    )


def write_items(path: Path, count: int, *, extra: list[str] | None = None) -> Path:
    """`count` valid lines in the three forms (custom_id item-N, prompt words `item-N ...`),
    then the raw `extra` lines."""
    lines = []
    for i in range(count):
        text = f"item-{i} " + " ".join(["word"] * (i % 4))
        if i % 3 == 0:
            lines.append({"custom_id": f"item-{i}", "prompt": text, "max_tokens": 2 + i % 3})
        elif i % 3 == 1:
            lines.append(
                {"custom_id": f"item-{i}", "messages": [{"role": "user", "content": text}]}
            )
        else:
            lines.append(
                {
                    "custom_id": f"item-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"prompt": text},
                }
            )
    with path.open("w") as out:
        for line in lines:
            out.write(json.dumps(line) + "\n")
        for raw in extra or []:
            out.write(raw + "\n")
    return path


def create_items_job(settings, tmp_path, rows: int, *, shard_size: int) -> tuple[str, list[int]]:
    """A job of `rows` items (write_items) created and stored; its id and its shards' ids.
    Stored in file order, without prefix placement: the callers know each shard by its lines
    (the first `shard_size` lines are the first shard's)."""
    created = create_job(
        source_of(write_items(tmp_path / "in.jsonl", rows), settings),
        make_spec(),
        shard_size=shard_size,
        settings=settings.model_copy(update={"place_prefixes": False}),
    )
    with session_scope(settings) as session:
        return created.job.id, [s.id for s in session.get(Job, created.job.id).shards]


def one_line_shards(
    settings, tmp_path, name: str, shards: int, *, priority: str = "normal"
) -> list[int]:
    """A job of `shards` items (write_items) in shards of one line each, its shards' ids in
    order: for the tests of whose turn a shard is. `name` names its input file, so that one
    test can create several jobs."""
    spec = make_spec().model_copy(update={"priority": priority})
    created = create_job(
        source_of(write_items(tmp_path / f"{name}.jsonl", shards), settings),
        spec,
        shard_size=1,
        settings=settings,
    )
    with session_scope(settings) as session:
        return [s.id for s in session.get(Job, created.job.id).shards]


def retried_items_job(
    settings, tmp_path, *, max_failures: int | None = None
) -> tuple[str, list[int]]:
    """A job of 20 items in two shards (lines 1-12 and 13-20) whose failed runs come back after
    a 30 s backoff, at most `max_failures` times when it is given (the tests of shard
    failures and storage outages)."""
    settings.shard_retry_seconds = 30.0
    if max_failures is not None:
        settings.max_shard_failures = max_failures
    return create_items_job(settings, tmp_path, 20, shard_size=12)


def failing_sizing(monkeypatch, calls: list[str] | None = None) -> None:
    """The job's sizing pass raises, as the tokenizer did on the probe's poison line; `calls`
    gets the id of the job of each attempt."""

    def resolve_max_model_len(job_id, **_kwargs):
        if calls is not None:
            calls.append(job_id)
        raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")

    monkeypatch.setattr("batchllm.worker.delivery.resolve_max_model_len", resolve_max_model_len)


def job_and_shards(settings, job_id: str) -> tuple[JobStatus, list[ShardStatus]]:
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        return job.status, [s.status for s in job.shards]


def item_of(prompt: str) -> str:
    """The `item-N` a prompt the fake engine saw was made from."""
    return next(word for word in prompt.split() if word.startswith("item-"))


def output_rows(settings, job_id: str) -> list[dict]:
    storage = Storage.of(settings)
    return sorted(
        read_output(storage, storage.output_dir(job_id)).to_pylist(), key=lambda r: r["line"]
    )


def part_files(settings, job_id: str) -> list[str]:
    storage = Storage.of(settings)
    return list_parts(storage, storage.output_dir(job_id))


def read_output_file(storage: Storage, path: str) -> list[dict]:
    with storage.fs.open_input_file(path) as src:
        return pq.read_table(src).to_pylist()


@pytest.fixture
def small_commits(settings):
    settings.commit_rows = 5
    settings.shard_size = 12
    return settings


def crash_on_checkpoint(monkeypatch, crash_at: int) -> None:
    """Kill the 'process' between writing a part file and recording its checkpoint."""
    real = commit.record_checkpoint
    calls = {"n": 0}

    def record(session, **kwargs):
        calls["n"] += 1
        if calls["n"] >= crash_at:
            raise KeyboardInterrupt("simulated worker death")
        real(session, **kwargs)

    monkeypatch.setattr(commit, "record_checkpoint", record)


def shard_row(settings, shard_id: int) -> Shard:
    """The shard's row as stored now, detached from its session."""
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_id)
        session.expunge(shard)
        return shard


def engine_error(out: Finished, *, cached_tokens: int = 0) -> Finished:
    """`out` ended by the engine with finish reason "error" (as vLLM reports a request it could
    not finish): no text, no completion tokens, its prompt tokens (and prefix-cache hits)."""
    return Finished(
        request_id=out.request_id,
        text="",
        finish_reason="error",
        prompt_tokens=out.prompt_tokens,
        completion_tokens=0,
        cached_tokens=cached_tokens,
    )


def update_shard(settings, shard_id: int, **values) -> None:
    """Set columns of the shard's row, as another worker or the passing of time would."""
    with session_scope(settings) as session:
        session.execute(update(Shard).where(Shard.id == shard_id).values(**values))


def age_heartbeat(settings, shard_id: int, age: timedelta) -> None:
    """The shard's last heartbeat `age` ago: its worker went quiet (died) then."""
    update_shard(settings, shard_id, heartbeat_at=utcnow() - age)


def past_backoff(settings, shard_id: int) -> None:
    """Move the shard's retry_at into the past, as if its backoff had run out."""
    update_shard(settings, shard_id, retry_at=utcnow() - timedelta(seconds=1))


def job_left_finalizing(
    settings, tmp_path, monkeypatch, *, hardware: str, vllm_version: str
) -> tuple[str, list[int]]:
    """A job of 20 rows in two shards, both completed, left FINALIZING: the worker that ended
    the last shard died before it finalized the job."""
    job_id, shard_ids = create_items_job(settings, tmp_path, 20, shard_size=12)
    with session_scope(settings) as session:
        service.mark_generation_started(
            session, job_id, hardware=hardware, vllm_version=vllm_version
        )
    with monkeypatch.context() as patch:
        patch.setattr("batchllm.execution.runner.finalize_job", lambda *a, **k: None)
        ShardRunner(FakeEngine(), worker="w1", settings=settings).run(shard_ids)
    assert job_and_shards(settings, job_id) == (JobStatus.FINALIZING, [ShardStatus.COMPLETED] * 2)
    return job_id, shard_ids
