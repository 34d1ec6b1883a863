"""What the integration and fault suites share about a fleet under test: the environment its
workers and the test process read their settings from, submitting a job and running the CLI
the way a user does, one `batchllm worker` process with its log, and the integration suite's
fleet (FleetEnv, Worker, start_workers ... below).

The integration suite uses the machine's Redis and PostgreSQL (a private database in each,
tests/integration/conftest.py); the fault suite private servers it stops and starts, and kills
workers in ways of its own (tests/support/faults.py).

Workers run the instant engine (INSTANT_ARGS, PACED_INSTANT_ARGS) unless the engine is what a
test is about: orchestration needs a worker process, Redis and PostgreSQL, not vLLM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from batchllm.process.ports import HOST
from batchllm.process.services import tail
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults
from tests.support.cli import REPO, run_cli, start_batchllm
from tests.support.inputs import source_of
from tests.support.worker_logs import named_log_tail

__all__ = ["HOST", "REPO", "run_cli", "tail"]

# Every job of the fleet suites uses these engine options, and every worker is started with
# the matching engine flags: a worker owns its engine, and jobs whose requirements it meets
# (an explicit max_model_len up to its own) run on it as it is.
ENGINE = EngineOptions(enforce_eager=True, max_model_len=512)
WORKER_ENGINE_ARGS = ("--enforce-eager", "--max-model-len", "512")
# The instant engine (batchllm/execution/stand_in_engines.py): the model's real tokenizer and chat
# template, every request answered at its max_tokens with filler text; ready in ~1-2 s.
INSTANT_ARGS = ("--engine", "instant", "--max-model-len", "512")
# Paced: one token per request every 20 ms, so a 64-token row takes ~1.3 s whatever the
# machine's speed; for tests that must catch a job running (cancel, expire, kill mid-shard).
INSTANT_STEP_SECONDS = 0.02
PACED_INSTANT_ARGS = (*INSTANT_ARGS, "--instant-step-seconds", str(INSTANT_STEP_SECONDS))


def fleet_env_vars(
    *,
    root: Path,
    database_url: str,
    broker_url: str,
    worker_settings: dict[str, str],
) -> dict[str, str]:
    """The environment of the fleet's processes: this one's, without its BATCHLLM_ settings,
    with the fleet's database, broker and storage, offline, and a small KV cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    env.update(worker_settings)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
            "BATCHLLM_HOME": str(root / "home"),
            "BATCHLLM_DATABASE_URL": database_url,
            "BATCHLLM_BROKER_URL": broker_url,
            "BATCHLLM_STORAGE": str(root / "storage"),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def settings_of(env: dict[str, str]) -> Settings:
    """The settings the fleet's processes read from `env`: the test process reads and submits
    with the same ones."""
    return Settings(
        **{
            k.removeprefix("BATCHLLM_").lower(): v
            for k, v in env.items()
            if k.startswith("BATCHLLM_")
        }
    )


def submit(settings: Settings, source: Path, model: Path | str, *, shard_size: int, **sampling):
    """Submit a job to the fleet the way `batchllm submit` does; returns the Job row."""
    from batchllm.jobs.submit import submit_job

    spec = JobSpec(model=str(model), engine=ENGINE, sampling=SamplingDefaults(**sampling))
    return submit_job(source_of(source, settings), spec, shard_size=shard_size, settings=settings)


class WorkerProcess:
    """One `batchllm worker` process in its own process group (vLLM starts an EngineCore child
    and its workers, so one killpg reaches all of them), its output in a log file."""

    def __init__(
        self,
        name: str,
        *,
        model: Path | str,
        env: dict[str, str],
        log_path: Path,
        append: bool,
        engine_args: tuple[str, ...] = WORKER_ENGINE_ARGS,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("ab" if append else "wb")
        self._terminated = False
        self.proc = start_batchllm(
            ["worker", "--model", str(model), "--name", name, "--loglevel", "INFO", *engine_args],
            env=env,
            log=self._log,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        try:
            named = named_log_tail(self.log())
        except FileNotFoundError:
            named = ""
        return tail(self.log_path, lines) + named

    def wait_ready(self, timeout: float = 420) -> None:
        """Until Celery says ready, which a worker does only once its engine is built."""
        deadline = time.monotonic() + timeout
        while f"{self.name} ready." not in self.log():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"worker {self.name} exited with {self.proc.returncode}:\n" + self.tail()
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"worker {self.name} not ready after {timeout}s:\n" + self.tail()
                )
            time.sleep(0.2)

    def terminate(self) -> None:
        """Ask for a warm shutdown (once: a second SIGTERM would cut the worker's drain short;
        a test that wants that sends it itself)."""
        if self.alive() and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def close_log(self) -> None:
        self._log.close()


# -- the integration suite's fleet -------------------------------------------------------

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

running: list[Worker] = []  # the integration suite's live workers, for failure reports


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
        running.append(self)

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
        if self in running:
            running.remove(self)


def start_workers(
    names: list[str],
    *,
    fleet_env: FleetEnv,
    model: Path,
    log_dir: Path,
    engine_args: tuple[str, ...] = WORKER_ENGINE_ARGS,
    ready_timeout: float = 240,
    env: dict[str, str] | None = None,
) -> list[Worker]:
    """Start the workers and wait until each consumes its queue. On two cores, each worker's
    engine gets its own core for its OpenMP threads (vLLM would bind both to the same one).
    `env`: more environment for every one of them."""
    workers = []
    try:
        for i, name in enumerate(names):
            cores = str(i % (os.cpu_count() or 1))
            workers.append(
                Worker(
                    name,
                    model=model,
                    log_path=log_dir / f"{name}.log",
                    env=fleet_env.worker_env(VLLM_CPU_OMP_THREADS_BIND=cores, **(env or {})),
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
    """One small shard per worker, so each has built its engine (the slow part of a vLLM
    worker) and taken work before the tests time or balance anything."""
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


@contextlib.contextmanager
def warm_workers(
    names: list[str], *, fleet_env: FleetEnv, model: Path, work_dir: Path
) -> Iterator[list[Worker]]:
    """Paced instant-engine workers (the orchestration is the subject, not the engine), each
    proven by a warm-up shard, stopped when the block ends."""
    workers = start_workers(
        names, fleet_env=fleet_env, model=model, log_dir=work_dir, engine_args=PACED_INSTANT_ARGS
    )
    try:
        warm_up(workers, fleet_env=fleet_env, model=model, work_dir=work_dir)
        yield workers
    finally:
        stop_workers(workers)
