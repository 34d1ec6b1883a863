"""One tenant cannot stall the fleet (issue 33, finding 1), on a real Celery worker process
(`batchllm worker --engine instant`), the machine's Redis (an empty database of its own) and
SQLite.

The probe: tenant A's batch held a line whose content was a lone surrogate; the worker's
tokenizer raised while sizing the job, the shard stayed queued, every later task of the model's
queue gave it its turn and crashed again (260,000 log lines in 90 s) and tenant B's batch never
ran. Now the line is an error row and both jobs complete; and a shard whose run fails as a whole
is retried a bounded number of times with backoff while B's work goes on.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults
from batchllm.storage import Storage
from batchllm.store.db import get_engine, session_scope, upgrade
from batchllm.store.models import Job, JobStatus, ShardStatus
from tests.support.fleet import WorkerProcess, fleet_env_vars, settings_of
from tests.support.inputs import source_of
from tests.support.job_checks import load_job, output_rows, wait_until_final
from tests.support.services import redis_database

pytestmark = pytest.mark.integration

WORKER_SETTINGS = {
    "BATCHLLM_COMMIT_SECONDS": "1",
    "BATCHLLM_RECONCILE_SECONDS": "5",
    "BATCHLLM_LEASE_SECONDS": "20",
    "BATCHLLM_SHARD_RETRY_SECONDS": "1",
    "BATCHLLM_MAX_SHARD_FAILURES": "3",
}
# Lines a worker logs for a shard task (received, ran, its outcome) and more: a bound far
# below any loop (the probe's worker logged ~3,000 lines a second).
LINES_PER_TASK = 8
TRACEBACK_LINES = 40


@dataclass
class Fleet:
    settings: Settings
    env: dict[str, str]
    worker: WorkerProcess
    model: Path

    def submit(
        self,
        lines: list[str],
        name: str,
        *,
        shard_size: int,
        before_dispatch: Callable[[str], None] | None = None,
    ) -> str:
        """A job of these lines with no max_model_len, so the worker sizes it (tokenizing
        every prompt, where the probe's poison line raised): the submit is told not to size
        it itself (BATCHLLM_TOKENIZE_AT_SUBMIT=never; execution/context/submit_pass.py)."""
        from batchllm.jobs.submit import submit_job

        path = self.settings.home / f"{name}.jsonl"
        path.write_text("".join(line + "\n" for line in lines))
        spec = JobSpec(
            model=str(self.model),
            engine=EngineOptions(enforce_eager=True),
            sampling=SamplingDefaults(max_tokens=8),
        )
        return submit_job(
            source_of(path, self.settings),
            spec,
            shard_size=shard_size,
            settings=self.settings.model_copy(update={"tokenize_at_submit": "never"}),
            before_dispatch=before_dispatch,
        ).id

    def log_lines(self) -> int:
        return len(self.worker.log().splitlines())


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """An empty database of the machine's Redis, this module's alone (tests/support/services)."""
    with redis_database(uuid.uuid4().hex) as (_client, url):
        yield url


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, redis_url: str, tmp_path_factory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("poison-fleet")
    database_url = f"sqlite:///{root / 'batchllm.db'}"
    upgrade(database_url)
    env = fleet_env_vars(
        root=root, database_url=database_url, broker_url=redis_url, worker_settings=WORKER_SETTINGS
    )
    settings = settings_of(env)
    settings.home.mkdir(parents=True, exist_ok=True)
    worker = WorkerProcess(
        "poison1",
        model=tiny_model,
        env=env,
        log_path=root / "worker.log",
        append=False,
        engine_args=("--engine", "instant", "--max-model-len", "512"),
    )
    try:
        worker.wait_ready(timeout=120)
        yield Fleet(settings=settings, env=env, worker=worker, model=tiny_model)
    finally:
        worker.terminate()
        try:
            worker.proc.wait(timeout=30)
        finally:
            if worker.alive():
                worker.proc.kill()
                worker.proc.wait(timeout=30)
            worker.close_log()
            get_engine(settings).dispose()


def _chat(custom_id: str, content: str) -> str:
    return json.dumps({"custom_id": custom_id, "messages": [{"role": "user", "content": content}]})


def _rows(fleet: Fleet, job_id: str) -> dict[str, dict]:
    return {row["custom_id"]: row for row in output_rows(fleet, job_id)}


def _new_lines(fleet: Fleet, before: int) -> list[str]:
    return fleet.worker.log().splitlines()[before:]


def _tasks_ended(lines: list[str]) -> int:
    """Shard tasks the worker ran in these lines (Celery logs one line as each ends)."""
    return sum("batchllm.run_shard[" in line and " succeeded in " in line for line in lines)


def test_a_poison_line_is_an_error_row_and_the_other_tenant_completes(fleet):
    before = fleet.log_lines()
    # json.dumps escapes the lone surrogates: the bytes a tenant sends ("x\udc00").
    tenant_a = [_chat(f"a-{i}", f"question {i}") for i in range(10)]
    tenant_a.insert(3, _chat("a-poison", "x\udc00"))
    tenant_a.insert(7, _chat("a-poison-id\udc00", "hello"))
    job_a = fleet.submit(tenant_a, "tenant-a", shard_size=5)
    job_b = fleet.submit(
        [_chat(f"b-{i}", f"other {i}") for i in range(20)], "tenant-b", shard_size=5
    )

    b = wait_until_final(fleet, job_b, timeout=120)
    assert b.status is JobStatus.COMPLETED, b.error
    rows_b = _rows(fleet, job_b)
    assert len(rows_b) == 20 and {r["status"] for r in rows_b.values()} == {"ok"}

    a = wait_until_final(fleet, job_a, timeout=60)
    assert a.status is JobStatus.COMPLETED, a.error
    rows_a = _rows(fleet, job_a)
    assert len(rows_a) == 12
    poison = rows_a["a-poison"]
    assert (poison["status"], poison["error_code"]) == ("error", "invalid_request")
    assert "messages.0.content" in poison["error"]
    poison_id = rows_a["line-8"]  # its custom_id cannot be written: the line's default one
    assert (poison_id["status"], poison_id["error_code"]) == ("error", "invalid_request")
    assert "custom_id" in poison_id["error"]
    others = [row for cid, row in rows_a.items() if cid.startswith("a-") and cid != "a-poison"]
    assert len(others) == 10 and {row["status"] for row in others} == {"ok"}
    _, shards = load_job(fleet, job_a)
    assert {(s.status, s.failures) for s in shards} == {(ShardStatus.COMPLETED, 0)}

    grown = _new_lines(fleet, before)
    assert 0 < len(grown) <= LINES_PER_TASK * _tasks_ended(grown), fleet.worker.tail(80)


def test_a_shard_that_fails_whole_is_retried_a_bounded_number_of_times_with_backoff(fleet):
    tenant_a = [_chat(f"a-{i}", f"question {i}") for i in range(6)]

    def lose_first_shard(job_id: str) -> None:
        # Its first shard's stored input is gone before any task goes out (as if the storage
        # lost it): sizing the job on the worker fails as a whole, on every attempt.
        with session_scope(fleet.settings) as session:
            first = session.get(Job, job_id).shards[0]
            Storage.of(fleet.settings).delete(first.input_path)

    before = fleet.log_lines()
    job_a = fleet.submit(tenant_a, "tenant-a-lost", shard_size=3, before_dispatch=lose_first_shard)
    job_b = fleet.submit(
        [_chat(f"b-{i}", f"later {i}") for i in range(10)], "tenant-b2", shard_size=5
    )

    b = wait_until_final(fleet, job_b, timeout=120)
    assert b.status is JobStatus.COMPLETED, b.error
    a = wait_until_final(fleet, job_a, timeout=120)
    _, shards = load_job(fleet, job_a)
    # Three attempts, each recorded, then the job ended with the reason (its rows unreadable).
    assert [s.failures for s in shards] == [3, 3]
    assert a.status is JobStatus.FAILED
    assert "failed 3 times (BATCHLLM_MAX_SHARD_FAILURES)" in (a.error or "")
    assert "FileNotFoundError" in (a.error or "") or "No such file" in (a.error or "")
    # The readable shard's rows are kept as error rows naming the cause; the lost one's are not.
    rows = output_rows(fleet, job_a)
    assert sorted(row["custom_id"] for row in rows) == ["a-3", "a-4", "a-5"]
    assert {(row["status"], row["error_code"]) for row in rows} == {("error", "shard_failed")}
    assert [s.status for s in shards] == [ShardStatus.FAILED, ShardStatus.COMPLETED]
    grown = _new_lines(fleet, before)
    # One line for each failed attempt (a traceback with a shard's first), none in between,
    # and one saying the lost shard's rows could not even be read for its error rows.
    failures = [line for line in grown if "batchllm.execution.shard_failures" in line]
    assert len(failures) == 7, "\n".join(failures)
    assert sum("could not write its error rows" in line for line in failures) == 1
    assert sum("failed (1 of 3 allowed; again in 1 s)" in line for line in failures) == 2
    assert sum("failed (2 of 3 allowed; again in 2 s)" in line for line in failures) == 2
    assert len(grown) <= LINES_PER_TASK * _tasks_ended(grown) + 2 * TRACEBACK_LINES, "\n".join(
        grown
    )
