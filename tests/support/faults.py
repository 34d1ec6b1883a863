"""The fault suite's harness: a private Redis and PostgreSQL that tests stop and start, real
`batchllm worker` processes that tests kill, and pools that keep warm workers across cases: one
of (paced) instant-engine workers for the cases about orchestration, one of vLLM workers for
the cases whose subject is the engine or its processes.

Nothing here touches the machine's own Redis (6379) or PostgreSQL (5432): both services run on
free ports from temporary directories. Every process started here (and every engine process
recorded under a worker) is ended by PID, never by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from batchllm.process.services import RedisServer
from batchllm.settings import Settings
from benchmarks.private_postgres import PostgresCluster
from benchmarks.private_postgres import (
    postgres_bin as postgres_bin,  # the fault suite's fixtures' too
)
from tests.support.fleet import WORKER_ENGINE_ARGS, WorkerProcess, run_cli, submit, tail
from tests.support.job_checks import wait_for
from tests.support.skips import require

DATABASE = "batchllm_faults"

# A killed worker's shard is taken over within a lease (10 s) plus a reconcile interval (5 s);
# Redis's own redelivery is an hour away, so a recovery the tests see is batchllm's, not the
# broker's.
WORKER_SETTINGS = {
    "BATCHLLM_LEASE_SECONDS": "10",
    "BATCHLLM_COMMIT_ROWS": "100",
    "BATCHLLM_COMMIT_SECONDS": "2",
    "BATCHLLM_RECONCILE_SECONDS": "5",
    "BATCHLLM_VISIBILITY_TIMEOUT": "3600",
}

_started_pids: list[tuple[int, float]] = []  # (pid, create_time) of everything we must end


# -- small helpers -------------------------------------------------------------------------


def _remember(pid: int) -> None:
    try:
        _started_pids.append((pid, psutil.Process(pid).create_time()))
    except psutil.Error:
        pass


def same_process(pid: int, created: float) -> psutil.Process | None:
    """The process with this pid if it is still the one we saw (pids are reused)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def kill_recorded(recorded: dict[int, float]) -> list[int]:
    """SIGKILL the recorded processes that are still alive; returns their pids."""
    killed = []
    for pid, created in recorded.items():
        proc = same_process(pid, created)
        if proc is not None:
            try:
                proc.kill()
                killed.append(pid)
            except psutil.Error:
                pass
    return killed


def alive_of(recorded: dict[int, float]) -> dict[int, str]:
    """The recorded processes still alive: pid -> command line."""
    alive = {}
    for pid, created in recorded.items():
        proc = same_process(pid, created)
        if proc is not None:
            try:
                alive[pid] = " ".join(proc.cmdline())[:80] or proc.name()
            except psutil.Error:
                pass
    return alive


def wait_all_gone(
    all_gone: Callable[[], bool],
    recorded: dict[int, float],
    *,
    within: float,
    after: str,
    what: str,
    log_path: Path,
) -> None:
    """Wait up to `within` s for `all_gone()`; else fail naming the recorded processes still
    alive `after` the signal, with the tail of the log at `log_path`."""
    try:
        wait_for(all_gone, timeout=within, what=what)
    except AssertionError:
        raise AssertionError(
            f"alive {within} s after {after}: {alive_of(recorded)}\n" + tail(log_path)
        ) from None


def engine_processes(root_pid: int) -> list[psutil.Process]:
    """vLLM's processes under a process: `VLLM::EngineCore`, `VLLM::Worker...` (their titles)."""
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if "VLLM" in title or "EngineCore" in title:
            found.append(child)
    return found


def descendants(root_pid: int) -> dict[int, float]:
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return {}
    recorded = {}
    for child in children:
        try:
            recorded[child.pid] = child.create_time()
        except psutil.Error:
            pass
    return recorded


# -- the private Redis and PostgreSQL (process/services.py, benchmarks/private_postgres.py) --


def fault_postgres(bin_dir: Path) -> PostgresCluster:
    """The fault suite's cluster (PostgresCluster.disposable: fast, quick to see a dead client)."""
    return PostgresCluster.disposable(database=DATABASE, bin_dir=bin_dir)


def require_private_services() -> Path:
    """Skip unless this machine can start a private Redis and PostgreSQL cluster (as the
    `postgres` user when we are root, which PostgreSQL refuses to run as); PostgreSQL's
    binaries."""
    require(
        shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None,
        "redis-server/redis-cli are not installed",
    )
    bin_dir = postgres_bin()
    require(
        bin_dir is not None and (bin_dir / "pg_ctl").exists(),
        "PostgreSQL server binaries (initdb, pg_ctl) are not installed",
    )
    assert bin_dir is not None
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            require(False, "running as root, but there is no `postgres` user to run initdb as")
    return bin_dir


# -- the environment the fleet shares ------------------------------------------------------


@dataclass
class FaultEnv:
    settings: Settings
    env: dict[str, str]
    redis: RedisServer
    postgres: PostgresCluster
    model: Path
    work_dir: Path

    def worker_env(self, **extra: str) -> dict[str, str]:
        return {**self.env, **extra}

    def submit(
        self,
        source: Path,
        *,
        shard_size: int,
        max_tokens: int,
        ignore_eos: bool = True,
        model: Path | str | None = None,
    ):
        """Submit a job to the fleet the way `batchllm submit` does; returns the Job row."""
        return submit(
            self.settings,
            source,
            model or self.model,
            shard_size=shard_size,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
        )

    def queue_length(self) -> int:
        from batchllm.worker.celery_app import queue_for_model

        return int(self.redis.client().llen(queue_for_model(str(self.model))))

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`batchllm ARGS` as a user on this fleet runs it."""
        return run_cli(self.env, *args, timeout=timeout)


def last_resort_cleanup(redis_server: RedisServer, postgres: PostgresCluster) -> None:
    """If the session dies before its fixtures' teardown (e.g. a second Ctrl-C)."""
    stop_all_workers()
    try:
        redis_server.stop()
    except Exception:
        pass
    postgres.destroy()


# -- workers -------------------------------------------------------------------------------

running_workers: list[Worker] = []


class Worker(WorkerProcess):
    """One `batchllm worker` of the fault suite; its engine children are recorded (pid and
    start time) so that the suite can check them after a kill and end any that outlive their
    worker."""

    def __init__(
        self,
        name: str,
        *,
        env: FaultEnv,
        core: int,
        log_path: Path,
        engine_args: tuple[str, ...] = WORKER_ENGINE_ARGS,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            name,
            model=env.model,
            env=env.worker_env(VLLM_CPU_OMP_THREADS_BIND=str(core), **(extra_env or {})),
            log_path=log_path,
            append=True,
            engine_args=engine_args,
        )
        self.core = core
        self.recorded: dict[int, float] = {}
        _remember(self.proc.pid)
        running_workers.append(self)

    def record_descendants(self) -> dict[int, float]:
        """Remember every process under the worker now (its engine and helpers)."""
        found = descendants(self.pid)
        self.recorded.update(found)
        return found

    def engine_core(self) -> psutil.Process | None:
        for proc in engine_processes(self.pid):
            try:
                if "EngineCore" in " ".join(proc.cmdline()) or "EngineCor" in proc.name():
                    return proc
            except psutil.Error:
                continue
        return None

    def kill_main(self) -> float:
        """SIGKILL the worker's main process only, as an OOM killer would; its children are
        left to fend for themselves. Returns the time of the kill (time.monotonic)."""
        self.record_descendants()
        os.kill(self.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        self.proc.wait(timeout=30)
        return killed_at

    def stop(self, grace: float = 30) -> None:
        """Warm shutdown first, then SIGKILL the group and whatever recorded child is left."""
        if self.alive():
            self.record_descendants()
        self.terminate()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        kill_recorded(self.recorded)
        self.close_log()
        if self in running_workers:
            running_workers.remove(self)


def stop_all_workers() -> None:
    workers = list(running_workers)
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.stop(grace=20)
    for pid, created in list(_started_pids):
        proc = same_process(pid, created)
        # Only workers and their children are left here; the services stop themselves.
        if proc is not None and proc.name() not in ("redis-server", "postgres"):
            try:
                proc.kill()
            except psutil.Error:
                pass


class Pool:
    """Warm workers kept across tests (session-wide: tests/faults/conftest.py). Tests ask for
    the number they need; dead workers are replaced, extra ones stopped, and new (or suspect)
    ones are proven to take shards with a warm engine before the test starts timing anything.
    `engine_args` says which engine its workers run (vLLM's flags, or tests/support/fleet.py's
    INSTANT_ARGS / PACED_INSTANT_ARGS); `label` names them (w1@LABEL, w2@LABEL ...)."""

    def __init__(
        self,
        env: FaultEnv,
        log_dir: Path,
        *,
        engine_args: tuple[str, ...] = WORKER_ENGINE_ARGS,
        label: str = "faults",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.env = env
        self.log_dir = log_dir
        self.engine_args = engine_args
        self.extra_env = extra_env
        self.label = label
        self.workers: list[Worker] = []
        self.serial = 0
        self.suspect = False
        self.notes: list[str] = []

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.alive()]

    def _start(self, count: int) -> list[Worker]:
        cpus = os.cpu_count() or 1
        started = []
        for _ in range(count):
            used = [w.core for w in self.alive()]
            core = min(range(cpus), key=used.count)
            self.serial += 1
            name = f"w{self.serial}@{self.label}"
            worker = Worker(
                name,
                env=self.env,
                core=core,
                log_path=self.log_dir / f"{name}.log",
                engine_args=self.engine_args,
                extra_env=self.extra_env,
            )
            self.workers.append(worker)
            started.append(worker)
        for worker in started:
            worker.wait_ready()
        return started

    def drop_dead(self) -> None:
        for worker in [w for w in self.workers if not w.alive()]:
            worker.stop()
            self.workers.remove(worker)

    def ensure(self, count: int) -> list[Worker]:
        self.drop_dead()
        alive = self.alive()
        for extra in alive[count:]:
            extra.terminate()
        for extra in alive[count:]:
            extra.stop()
            self.workers.remove(extra)
        started = self._start(count - len(self.alive()))
        if count and (started or self.suspect):
            self.probe()
        return self.alive()

    def stop_all(self) -> None:
        for worker in list(self.workers):
            worker.terminate()
        for worker in list(self.workers):
            worker.stop()
        self.workers.clear()

    def replace(self, worker: Worker) -> Worker:
        """Start a new worker in place of one that exited (what a supervisor does)."""
        worker.stop()
        if worker in self.workers:
            self.workers.remove(worker)
        (new,) = self._start(1)
        return new

    def probe(self, timeout: float = 300) -> None:
        """A tiny job whose shards must land on every worker: each builds (or proves) its
        engine. If a worker takes none, the whole pool is started afresh once."""
        for attempt in (1, 2):
            workers = self.alive()
            used = run_probe_job(self.env, len(workers), timeout=timeout, workers=workers)
            if {w.name for w in workers} <= used:
                self.suspect = False
                return
            if attempt == 2:
                raise AssertionError(
                    f"probe shards ran on {used}, not on every worker of "
                    f"{[w.name for w in workers]}" + tails(workers)
                )
            self.notes.append(
                f"workers {sorted({w.name for w in workers} - used)} took no "
                "probe shard: pool restarted"
            )
            for worker in workers:
                worker.stop(grace=5)
                self.workers.remove(worker)
            self._start(len(workers))


def run_probe_job(
    env: FaultEnv,
    count: int,
    *,
    timeout: float,
    workers: list[Worker],
    unless_exits: Worker | None = None,
) -> set[str]:
    """Run a small job of 2*count two-row shards; returns the workers that ran its shards.
    With `unless_exits`: returns an empty set as soon as that worker has exited instead (the
    job may then be left unfinished for another worker)."""
    from batchllm.demo.workload import write_workload
    from batchllm.store.db import session_scope
    from batchllm.store.models import Job, JobStatus

    source = write_workload(
        env.work_dir / f"probe-{time.monotonic_ns()}.jsonl", requests=4 * count, prompt_words=(4, 8)
    )
    job_id = env.submit(source, shard_size=2, max_tokens=4).id

    def ended():
        if unless_exits is not None and not unless_exits.alive():
            return (None, "exited", set())
        with session_scope(env.settings) as session:
            job = session.get(Job, job_id)
            return (
                (job.status, job.error, {s.worker for s in job.shards})
                if job.status.is_final
                else None
            )

    try:
        status, error, used = wait_for(
            ended, timeout=timeout, what="the probe job to end", interval=0.5
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}" + tails(workers)) from None
    if status is None:  # unless_exits exited
        return set()
    assert status is JobStatus.COMPLETED, f"probe job {status.value}: {error}" + tails(workers)
    return {u for u in used if u}


def tails(workers: list[Worker]) -> str:
    return "".join(f"\n--- {w.name} log (tail) ---\n{w.tail()}" for w in workers)
