"""The warm part: how soon a job submitted to an already-warm `batchllm worker` starts generating.

A real worker process (Celery's solo pool, its own vLLM engine) serves a private Redis database
and a private SQLite database. A first job warms its engine; then small jobs follow one at a
time, each sized to a shorter context than the warm engine's (each of them rebuilt the engine
before the engine cache let a longer-context engine serve them), and last, optionally, one that
needs a longer context: the one rebuild. Per job, from the database's own timestamps:

- submit to pickup: the job committed, its task about to go to the broker (submit_job's
  before_dispatch; a worker may start the job before submit_job returns) -> the worker claimed
  the shard (shards.started_at). The worker sizes the job's context and picks its engine
  before it claims, so a rebuild lands here;
- pickup to first row: the claim -> the first request added to the engine (jobs.started_at);
- submit to first row: the two together, what a user waits for;

and the engine starts the job caused, from the worker's Prometheus metrics.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.settings import Settings

# The promise: a warm worker starts generating within 1 s of picking a job up.
TARGET_SECONDS = 1.0
_REDIS_HOST, _REDIS_PORT = "127.0.0.1", 6379
_MARK = "batchllm-bench-warm"
_ENGINE_STARTS = "batchllm_engine_starts_total"


@dataclass(frozen=True)
class WarmJob:
    kind: str  # warm-up, shorter (than the warm engine's context) or longer
    max_tokens: int
    prompt_words: tuple[int, int]


WARM_UP = WarmJob("warm-up", 256, (32, 64))
# Each sized (longest prompt + max_tokens, rounded up to 64) below the warm-up's context, and
# mostly to a context of its own: before the engine cache reused a longer engine, each rebuilt.
SHORTER = (
    WarmJob("shorter", 16, (4, 8)),
    WarmJob("shorter", 48, (8, 24)),
    WarmJob("shorter", 96, (8, 32)),
    WarmJob("shorter", 128, (16, 48)),
    WarmJob("shorter", 160, (24, 56)),
)
LONGER = WarmJob("longer", 512, (32, 64))


def plan(jobs: int, *, rebuild: bool) -> list[WarmJob]:
    """The warm-up, `jobs` shorter jobs (cycling through SHORTER), and the longer one."""
    return [WARM_UP, *(SHORTER[i % len(SHORTER)] for i in range(jobs)), *([LONGER] * rebuild)]


@contextmanager
def private_redis() -> Iterator[str]:
    """An empty database of the local Redis, marked as ours so that nothing else running here
    picks it; flushed afterwards. Yields its URL."""
    import redis

    try:
        redis.Redis(host=_REDIS_HOST, port=_REDIS_PORT, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        raise BenchFailed(
            f"the warm part needs Redis at {_REDIS_HOST}:{_REDIS_PORT}: {exc}"
        ) from None
    token = uuid.uuid4().hex
    for index in range(15, 0, -1):
        client = redis.Redis(host=_REDIS_HOST, port=_REDIS_PORT, db=index)
        try:
            if client.dbsize() == 0 and client.set(_MARK, token, nx=True):
                break
        except redis.ResponseError:  # the server has fewer databases
            continue
    else:
        raise BenchFailed(f"no empty Redis database at {_REDIS_HOST}:{_REDIS_PORT}")
    try:
        yield f"redis://{_REDIS_HOST}:{_REDIS_PORT}/{index}"
    finally:
        client.flushdb()
        client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerProcess:
    """One `batchllm worker` in its own process group, with its metrics on a free port."""

    def __init__(self, *, model: str, settings: Settings, log_path: Path) -> None:
        self.name = f"bench-warm-{os.getpid()}@{socket.gethostname()}"
        self.log_path = log_path
        self.metrics_port = _free_port()
        # Only these settings: a user's BATCHLLM_DATABASE_URL or broker must not be used.
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
        env.update(
            BATCHLLM_HOME=str(settings.home),
            BATCHLLM_DATABASE_URL=settings.resolved_database_url,
            BATCHLLM_STORAGE=settings.resolved_storage,
            BATCHLLM_BROKER_URL=settings.broker_url,
            PYTHONUNBUFFERED="1",
        )
        command = [sys.executable, "-m", "batchllm", "worker", "--model", model]
        command += ["--name", self.name, "--loglevel", "INFO"]
        command += ["--metrics-port", str(self.metrics_port)]
        with log_path.open("wb") as log:
            # Its own session: one signal reaches the worker, its EngineCore and engine workers.
            self.proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180) -> float:
        started, deadline = time.monotonic(), time.monotonic() + timeout
        while f"{self.name} ready." not in self.log():
            if self.proc.poll() is not None:
                raise BenchFailed(f"the worker exited {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise BenchFailed(
                    f"the worker not ready after {timeout:.0f} s; see {self.log_path}"
                )
            time.sleep(0.2)
        return time.monotonic() - started

    def engine_starts(self, model: str) -> int:
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return sum(
            int(sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == _ENGINE_STARTS and sample.labels.get("model") == model
        )

    def stop(self) -> list[int]:
        """Warm shutdown (the worker shuts its engine down), then make sure that nothing it
        started outlives it: an engine process left behind would hold its memory (a GPU).
        Returns the ids of the processes ended: the worker's and its children's."""
        import psutil

        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        _, alive = psutil.wait_procs(tree, timeout=30)
        for child in alive:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=30)
        return [self.proc.pid, *(child.pid for child in tree)]


def _seconds(later: datetime | None, earlier: datetime | None) -> float | None:
    return (later - earlier).total_seconds() if later and earlier else None


def time_job(
    job: WarmJob, *, source: Path, model: str, lines: int, settings: Settings, timeout: float
) -> dict[str, Any]:
    """Submit one single-shard job, wait for it to end and read its timestamps."""
    from batchllm.input.schemas import JobSpec, SamplingDefaults
    from batchllm.store.db import session_scope
    from batchllm.store.models import Job, JobStatus
    from batchllm.worker.dispatch import submit_job

    spec = JobSpec(model=model, sampling=SamplingDefaults(max_tokens=job.max_tokens))
    dispatched: list[datetime] = []
    called = time.perf_counter()
    job_id = submit_job(
        source,
        spec,
        shard_size=lines,
        settings=settings,
        before_dispatch=lambda _id: dispatched.append(datetime.now(timezone.utc)),
    ).id
    submit_seconds = time.perf_counter() - called
    submitted = dispatched[0]
    deadline = time.monotonic() + timeout
    while True:
        with session_scope(settings) as session:
            row = session.get(Job, job_id)
            assert row is not None  # submit_job committed it
            if row.status.is_final:
                (shard,) = row.shards
                picked, first = shard.started_at, row.started_at
                finished = row.finished_at
                status, error = row.status, row.error
                figures = {
                    "job_id": job_id,
                    "kind": job.kind,
                    "max_tokens": job.max_tokens,
                    "prompt_words": list(job.prompt_words),
                    "max_model_len": row.max_model_len,
                    "rows_ok": row.request_completed,
                    "rows_failed": row.request_failed,
                    "hardware": row.hardware,
                    "vllm_version": row.vllm_version,
                }
                break
        if time.monotonic() > deadline:
            raise BenchFailed(f"warm part: job {job_id} not done after {timeout:.0f} s")
        time.sleep(0.1)
    if status is not JobStatus.COMPLETED:
        raise BenchFailed(f"warm part: job {job_id} ended {status.value}: {error}")
    return figures | {
        "submit_call_seconds": submit_seconds,
        "submit_to_pickup_seconds": _seconds(picked, submitted),
        "pickup_to_first_row_seconds": _seconds(first, picked),
        "submit_to_first_row_seconds": _seconds(first, submitted),
        "submit_to_done_seconds": _seconds(finished, submitted),
    }


def run_warm(
    *,
    model: str,
    workdir: Path,
    jobs: int = 5,
    lines: int = 50,
    rebuild: bool = True,
    seed: int = 0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Start a worker, run the warm-up, `jobs` shorter jobs and (with `rebuild`) one longer
    job on it one after another; the figures of each, and the worker ended."""
    from batchllm.bench.contenders import bench_settings
    from batchllm.demo.workload import write_workload
    from batchllm.store.db import get_engine

    workdir.mkdir(parents=True, exist_ok=True)
    # The worker and this process must name the model alike: it is the queue and the metric label.
    model = str(Path(model).resolve()) if Path(model).exists() else model
    results: list[dict[str, Any]] = []
    ready = 0.0
    with private_redis() as broker_url:
        settings = bench_settings(workdir / "home").model_copy(update={"broker_url": broker_url})
        get_engine(settings)  # creates and migrates the SQLite database before the worker opens it
        worker = WorkerProcess(model=model, settings=settings, log_path=workdir / "worker.log")
        try:
            ready = worker.wait_ready()
            say(f"[warm] worker {worker.name} ready in {ready:.1f} s; log {worker.log_path}")
            for n, job in enumerate(plan(jobs, rebuild=rebuild)):
                source = write_workload(
                    workdir / f"job-{n}.jsonl",
                    requests=lines,
                    prompt_words=job.prompt_words,
                    seed=seed + n,
                )
                before = worker.engine_starts(model)
                figures = time_job(
                    job,
                    source=source,
                    model=model,
                    lines=lines,
                    settings=settings,
                    timeout=600 if n == 0 or job is LONGER else 300,
                )
                figures["engine_starts"] = worker.engine_starts(model) - before
                results.append(figures)
                say(
                    f"[warm] job {n} ({job.kind}, max_model_len {figures['max_model_len']}): "
                    f"pickup to first row {figures['pickup_to_first_row_seconds']:.2f} s, "
                    f"submit to first row {figures['submit_to_first_row_seconds']:.2f} s, "
                    f"engine starts {figures['engine_starts']}"
                )
        finally:
            pids = worker.stop()
            get_engine(settings).dispose()
    worker_figures = {"ready_seconds": ready, "log": str(worker.log_path), "pids": pids}
    return summarize(results, lines=lines) | {"worker": worker_figures}


def summarize(results: list[dict[str, Any]], *, lines: int) -> dict[str, Any]:
    """Per-job figures, and over the shorter jobs: what a warm worker's user waits."""
    engine_len = 0
    for figures in results:
        if figures["engine_starts"]:
            engine_len = figures["max_model_len"]
        figures["engine_max_model_len"] = engine_len
    shorter = [f for f in results if f["kind"] == "shorter"]
    out: dict[str, Any] = {
        "lines": lines,
        "jobs": results,
        "engine": {"version": results[0]["vllm_version"], "hardware": results[0]["hardware"]},
        "shorter_jobs_rebuilt": sum(1 for f in shorter if f["engine_starts"]),
        "target_seconds": TARGET_SECONDS,
    }
    warm = [f for f in shorter if not f["engine_starts"]]
    if warm:
        for key in ("pickup_to_first_row_seconds", "submit_to_first_row_seconds"):
            values = [f[key] for f in warm]
            out[f"warm_{key}"] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
        out["target_met"] = out["warm_pickup_to_first_row_seconds"]["max"] <= TARGET_SECONDS
    return out
