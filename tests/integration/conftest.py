"""Fixtures for the fleet tests: the real Redis and PostgreSQL on 127.0.0.1 and real
`batchllm worker` processes.

Each test session gets a fresh PostgreSQL database and an empty Redis database of its own, so
sessions running side by side on one machine cannot take each other's shards. Workers run in
their own process groups (vLLM starts an EngineCore child and its workers), so one killpg
reaches all of them; their output goes to log files whose tails are attached to a failing
test's report.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from batchllm.settings import Settings
from tests.support.fleet import (
    HOST,
    WORKER_ENGINE_ARGS,
    WorkerProcess,
    fleet_env_vars,
    run_cli,
    settings_of,
    submit,
)
from tests.support.services import postgres_database, redis_database
from tests.support.skips import require

# Small enough that a shard of the tiny model commits several checkpoints, and that a killed
# worker's shard is taken over within a test: its lease expires after 10 s and the surviving
# worker's sweeper queues it again. Redis's own redelivery is an hour away, so a passing kill
# test shows that the sweeper, not the broker, recovered the shard.
WORKER_SETTINGS = {
    "BATCHLLM_COMMIT_ROWS": "100",
    "BATCHLLM_COMMIT_SECONDS": "2",
    "BATCHLLM_LEASE_SECONDS": "10",
    "BATCHLLM_VISIBILITY_TIMEOUT": "3600",
}

_running: list[Worker] = []


# -- services ------------------------------------------------------------------------------


@dataclass
class FleetEnv:
    """Where the fleet under test keeps its state: what workers and the test process share."""

    settings: Settings
    env: dict[str, str]
    redis: redis.Redis  # the broker's database

    def worker_env(self, **extra: str) -> dict[str, str]:
        return {**self.env, **extra}

    def submit(self, source: Path, model: Path | str, *, shard_size: int, max_tokens: int = 64):
        """Submit a job to the fleet the way `batchllm submit` does; returns the Job row."""
        return submit(self.settings, source, model, shard_size=shard_size, max_tokens=max_tokens)

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`batchllm ARGS` as a user on this fleet runs it."""
        return run_cli(self.env, *args, timeout=timeout)


@pytest.fixture(scope="session")
def fleet_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetEnv]:
    require(importlib.util.find_spec("vllm") is not None, "vllm is not installed")
    token = uuid.uuid4().hex[:12]
    with (
        redis_database(token) as (broker, broker_url),
        postgres_database(f"batchllm_it_{token}") as url,
    ):
        from batchllm.store.db import get_engine, upgrade

        upgrade(url)
        root = tmp_path_factory.mktemp("fleet")
        env = fleet_env_vars(
            root=root, database_url=url, broker_url=broker_url, worker_settings=WORKER_SETTINGS
        )
        settings = settings_of(env)
        try:
            yield FleetEnv(settings=settings, env=env, redis=broker)
        finally:
            get_engine(settings).dispose()


# -- workers -------------------------------------------------------------------------------


class Worker(WorkerProcess):
    """One `batchllm worker` of the integration fleet, killed with its whole group."""

    def __init__(
        self,
        name: str,
        *,
        model: Path,
        env: dict[str, str],
        log_path: Path,
        engine_args: tuple[str, ...] = WORKER_ENGINE_ARGS,
    ) -> None:
        super().__init__(
            name, model=model, env=env, log_path=log_path, append=False, engine_args=engine_args
        )
        _running.append(self)

    def kill(self) -> None:
        """SIGKILL the whole group at once: the worker, its EngineCore and engine workers."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Warm shutdown first (vLLM cleans up its shared memory), then kill what is left."""
        self.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self.close_log()
        if self in _running:
            _running.remove(self)


def start_workers(
    names: list[str],
    *,
    fleet_env: FleetEnv,
    model: Path,
    log_dir: Path,
    engine_args: tuple[str, ...] = WORKER_ENGINE_ARGS,
    ready_timeout: float = 240,
) -> list[Worker]:
    """Start the workers and wait until each consumes its queue. On two cores, each worker's
    engine gets its own core for its OpenMP threads (vLLM would bind both to the same one)."""
    workers = []
    try:
        for i, name in enumerate(names):
            cores = str(i % (os.cpu_count() or 1))
            workers.append(
                Worker(
                    name,
                    model=model,
                    log_path=log_dir / f"{name}.log",
                    env=fleet_env.worker_env(VLLM_CPU_OMP_THREADS_BIND=cores),
                    engine_args=engine_args,
                )
            )
        for worker in workers:
            worker.wait_ready(ready_timeout)
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: list[Worker]) -> None:
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.stop()


def tails(workers: list[Worker]) -> str:
    return "".join(f"\n--- {w.name} log (tail) ---\n{w.tail()}" for w in workers)


def warm_up(workers: list[Worker], *, fleet_env: FleetEnv, model: Path, work_dir: Path) -> None:
    """One small shard per worker, so each builds its engine (the slow part, and slower for one
    worker than the other) before the tests time or balance anything."""
    from batchllm.demo.workload import write_workload
    from batchllm.store.db import session_scope
    from batchllm.store.models import Job, JobStatus

    source = write_workload(work_dir / "warm-up.jsonl", requests=4 * len(workers))
    job_id = fleet_env.submit(source, model, shard_size=4, max_tokens=8).id
    deadline = time.monotonic() + 240
    while True:
        with session_scope(fleet_env.settings) as session:
            job = session.get(Job, job_id)
            status, workers_used = job.status, {s.worker for s in job.shards}
        if status.is_final:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"warm-up job still {status.value} after 240s" + tails(workers))
        time.sleep(0.5)
    assert status is JobStatus.COMPLETED, f"warm-up job {status.value}: {job.error}" + tails(
        workers
    )
    assert workers_used == {w.name for w in workers}, f"warm-up shards ran on {workers_used}"


@pytest.fixture(scope="class")
def pair(fleet_env: FleetEnv, tiny_model: Path, tmp_path_factory) -> list[Worker]:
    """Two workers serving the tiny model with warm engines, alive for one test class."""
    work_dir = tmp_path_factory.mktemp("workers")
    workers = start_workers(
        ["w1@test", "w2@test"], fleet_env=fleet_env, model=tiny_model, log_dir=work_dir
    )
    try:
        warm_up(workers, fleet_env=fleet_env, model=tiny_model, work_dir=work_dir)
        yield workers
    finally:
        stop_workers(workers)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for worker in list(_running):
            report.sections.append((f"worker {worker.name} log (tail)", worker.tail()))
