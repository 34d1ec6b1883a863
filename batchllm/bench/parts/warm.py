"""The warm part: what a job gains from a `batchllm worker` that owns a warm engine.

A real worker process (Celery's solo pool) is started with explicit engine flags and builds its
engine before it says ready; it serves a private Redis database and a private SQLite database.
Its readiness time (process start -> Celery's `<name> ready.`) is the engine build, paid once.
Then, on that one worker:

1. five jobs of different prompt lengths and settings in a row (greedy and sampled, a `choice`
   constraint, n=2, one naming its own max_model_len at or below the worker's). Per job, from
   the database's timestamps: submit (the job committed, its task about to go to the broker)
   to pickup (the worker claimed the shard), to first row (the first request went into the
   engine) and to completed; its rows; and the engine starts it caused, from the worker's
   Prometheus metrics. A job that starts an engine fails the part: the worker's engine is the
   operator's, and no job rebuilds it;
2. the same OpenAI chat file end to end three ways: `vllm run-batch` and `batchllm run`, each a
   fresh process building its engine for the file, and `batchllm submit FILE` to the warm
   worker, timed from the submit process's start until the database says completed (polled
   every 0.1 s). Same model, greedy, a fixed max_tokens with ignore_eos (every contender
   generates the same tokens), and the same engine flags for all three.
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
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.bench.processes import EngineLimits
from batchllm.input.schemas import EngineOptions, JobSpec, SamplingDefaults
from batchllm.settings import Settings

# The promise: a warm worker starts generating within 1 s of picking a job up.
TARGET_SECONDS = 1.0
# Issue 26's aim: the warm worker finishes the side-by-side file 3x sooner than run-batch.
TARGET_SPEEDUP = 3.0
_REDIS_HOST, _REDIS_PORT = "127.0.0.1", 6379
_MARK = "batchllm-bench-warm"
_ENGINE_STARTS = "batchllm_engine_starts_total"
_ENGINE_START_SECONDS = "batchllm_engine_start_seconds"
_ENGINE_INFO = "batchllm_engine_info"
_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class WarmJob:
    """One job of the five: its prompts' length and its settings."""

    label: str
    prompt_words: tuple[int, int]
    max_tokens: int
    temperature: float = 0.0
    n: int = 1
    choice: tuple[str, ...] | None = None
    # The job names its own engine max_model_len, this share of the worker's.
    context_share: float | None = None

    def spec(self, model: str, worker_max_model_len: int) -> JobSpec:
        engine = EngineOptions()
        if self.context_share is not None:
            engine = EngineOptions(max_model_len=int(worker_max_model_len * self.context_share))
        sampling = SamplingDefaults(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            n=self.n,
            structured={"choice": list(self.choice)} if self.choice else None,
        )
        return JobSpec(model=model, sampling=sampling, engine=engine)


# Each differs from the one before in prompt length and in settings. The last one's prompts
# and max_tokens fit in 3/4 of a 512-token context with the demo model (~4 tokens a word).
JOBS = (
    WarmJob("short prompts, greedy", (4, 8), 16),
    WarmJob("temperature 0.8", (8, 32), 64, temperature=0.8),
    WarmJob("choice of 3 labels", (16, 48), 8, choice=("yes", "no", "maybe")),
    WarmJob("n=2, temperature 0.8", (24, 56), 32, temperature=0.8, n=2),
    WarmJob("own max_model_len (3/4 the worker's)", (24, 48), 96, context_share=0.75),
)


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


def fleet_env(settings: Settings) -> dict[str, str]:
    """The environment of the worker and of `batchllm submit`: these settings only, so a
    user's BATCHLLM_DATABASE_URL or broker is never used."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    env.update(
        BATCHLLM_HOME=str(settings.home),
        BATCHLLM_DATABASE_URL=settings.resolved_database_url,
        BATCHLLM_STORAGE=settings.resolved_storage,
        BATCHLLM_BROKER_URL=settings.broker_url,
        PYTHONUNBUFFERED="1",
    )
    return env


def worker_command(model: str, limits: EngineLimits, *, name: str, metrics_port: int) -> list[str]:
    """`batchllm worker` with the engine flags it builds its engine from."""
    return [
        *(sys.executable, "-m", "batchllm", "worker", "--model", model),
        *limits.flags(),
        *("--name", name, "--loglevel", "INFO", "--metrics-port", str(metrics_port)),
    ]


class WorkerProcess:
    """One `batchllm worker` in its own process group, with its metrics on a free port."""

    def __init__(
        self, *, model: str, limits: EngineLimits, settings: Settings, log_path: Path
    ) -> None:
        from batchllm.process.stopping import PARENT_MARK

        self.model = model
        self.name = f"bench-warm-{os.getpid()}@{socket.gethostname()}"
        self.log_path = log_path
        self.metrics_port = _free_port()
        self.command = worker_command(model, limits, name=self.name, metrics_port=self.metrics_port)
        # It stops by itself should this process die without stopping it.
        env = fleet_env(settings) | {PARENT_MARK: str(os.getpid())}
        with log_path.open("wb") as log:
            self.started = time.monotonic()
            # Its own session: one signal reaches the worker, its EngineCore and engine workers.
            self.proc = subprocess.Popen(
                self.command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600) -> float:
        """Seconds from the process's start to Celery's `<name> ready.` line. The deadline is
        generous: on these 2 shared cores a build took 166 s under a load of 15."""
        deadline = self.started + timeout
        while f"{self.name} ready." not in self.log():
            if self.proc.poll() is not None:
                raise BenchFailed(f"the worker exited {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise BenchFailed(
                    f"the worker not ready after {timeout:.0f} s; see {self.log_path}"
                )
            time.sleep(_POLL_SECONDS)
        return time.monotonic() - self.started

    def metrics(self) -> list[Any]:
        """The samples of the worker's Prometheus registry."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def _model_samples(self, name: str) -> list[Any]:
        return [s for s in self.metrics() if s.name == name and s.labels.get("model") == self.model]

    def engine_starts(self) -> int:
        return sum(int(sample.value) for sample in self._model_samples(_ENGINE_STARTS))

    def engine(self) -> dict[str, Any]:
        """The engine the worker built, as its metrics describe it: its profile (the
        context and dtype vLLM resolved) and how long the build took."""
        profiles = [s.labels for s in self._model_samples(_ENGINE_INFO) if s.value == 1]
        seconds = [s.value for s in self._model_samples(_ENGINE_START_SECONDS)]
        if len(profiles) != 1 or not seconds:
            raise BenchFailed(
                f"the worker's metrics show {len(profiles)} engine profiles and "
                f"{len(seconds)} start times for {self.model}; expected one of each"
            )
        (profile,) = profiles
        return {
            "max_model_len": int(profile["max_model_len"]),
            "dtype": profile["dtype"],
            "task": profile["task"],
            "start_seconds": seconds[0],
        }

    def cpu_seconds(self) -> float:
        """CPU time used so far by the worker and its engine processes."""
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            for proc in (root, *root.children(recursive=True)):
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
        return total

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


def wait_ended(job_id: str, settings: Settings, *, timeout: float) -> dict[str, Any]:
    """Poll the database every 0.1 s until the job ends; its timestamps and counts, and the
    monotonic time at which it was seen ended. BenchFailed unless it completed."""
    from batchllm.store.db import session_scope
    from batchllm.store.models import Job, JobStatus

    deadline = time.monotonic() + timeout
    while True:
        with session_scope(settings) as session:
            row = session.get(Job, job_id)
            if row is not None and row.status.is_final:
                seen = time.monotonic()
                (shard, *more) = row.shards
                if row.status is not JobStatus.COMPLETED:
                    raise BenchFailed(
                        f"warm part: job {job_id} ended {row.status.value}: {row.error}"
                    )
                return {
                    "seen_ended": seen,
                    "picked": shard.started_at if not more else None,
                    "first_row": row.started_at,
                    "finished": row.finished_at,
                    "max_model_len": row.max_model_len,
                    "rows_ok": row.request_completed,
                    "rows_failed": row.request_failed,
                    "prompt_tokens": row.prompt_tokens,
                    "output_tokens": row.completion_tokens,
                    "hardware": row.hardware,
                    "vllm_version": row.vllm_version,
                }
        if time.monotonic() > deadline:
            raise BenchFailed(f"warm part: job {job_id} not done after {timeout:.0f} s")
        time.sleep(_POLL_SECONDS)


def time_job(
    spec: JobSpec, *, source: Path, lines: int, settings: Settings, timeout: float
) -> dict[str, Any]:
    """Submit one single-shard job, wait for it to end and read its timestamps."""
    from batchllm.jobs.submit import submit_job

    dispatched: list[datetime] = []
    job_id = submit_job(
        source,
        spec,
        shard_size=lines,
        settings=settings,
        before_dispatch=lambda _id: dispatched.append(datetime.now(timezone.utc)),
    ).id
    ended = wait_ended(job_id, settings, timeout=timeout)
    submitted = dispatched[0]
    return {
        "job_id": job_id,
        "max_model_len": ended["max_model_len"],
        "rows_ok": ended["rows_ok"],
        "rows_failed": ended["rows_failed"],
        "hardware": ended["hardware"],
        "vllm_version": ended["vllm_version"],
        "submit_to_pickup_seconds": _seconds(ended["picked"], submitted),
        "pickup_to_first_row_seconds": _seconds(ended["first_row"], ended["picked"]),
        "submit_to_first_row_seconds": _seconds(ended["first_row"], submitted),
        "submit_to_completed_seconds": _seconds(ended["finished"], submitted),
    }


def run_submitted(
    source: Path, *, model: str, settings: Settings, log_path: Path, timeout: float
) -> dict[str, Any]:
    """`batchllm submit FILE --model M` as a user runs it, timed from the process's start
    until the database says the job completed; the figures in a Run's shape."""
    command = [sys.executable, "-m", "batchllm", "submit", str(source), "--model", model]
    started = time.monotonic()
    done = subprocess.run(
        command, env=fleet_env(settings), capture_output=True, text=True, timeout=timeout
    )
    submit_seconds = time.monotonic() - started
    log_path.write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not done.stdout.split():
        raise BenchFailed(f"batchllm submit exited {done.returncode}; see {log_path}")
    job_id = done.stdout.split()[0]
    ended = wait_ended(job_id, settings, timeout=timeout)
    return {
        "seconds": ended["seen_ended"] - started,
        "requests": ended["rows_ok"] + ended["rows_failed"],
        "failed": ended["rows_failed"],
        "prompt_tokens": ended["prompt_tokens"],
        "output_tokens": ended["output_tokens"],
        "generation_seconds": _seconds(ended["finished"], ended["first_row"]),
        "extra": {"job_id": job_id, "submit_process_seconds": submit_seconds},
    }


def side_by_side_file(
    path: Path, *, model: str, lines: int, prompt_words: tuple[int, int], max_tokens: int, seed: int
) -> Path:
    """OpenAI chat lines, greedy, each generating exactly `max_tokens` (ignore_eos)."""
    from batchllm.bench.workload import Workload, write_openai_chat

    workload = Workload(
        requests=lines,
        prompt_words=prompt_words,
        output_tokens=(max_tokens, max_tokens),
        seed=seed,
        greedy=True,
    )
    return write_openai_chat(path, workload, 0, model=model)


def require_no_engine_start(what: str, starts: int) -> None:
    """The worker's engine is the operator's: a job that starts an engine fails the part."""
    if starts:
        raise BenchFailed(
            f"warm part: {what} started {starts} engine(s) on the warm worker; expected 0"
        )


def side_by_side(
    worker: WorkerProcess,
    *,
    limits: EngineLimits,
    lines: int,
    prompt_words: tuple[int, int],
    max_tokens: int,
    seed: int,
    settings: Settings,
    workdir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """One OpenAI chat file through run-batch, `batchllm run` and the warm worker."""
    from batchllm.bench.processes import run_batchllm, run_vllm_batch

    model = worker.model
    source = side_by_side_file(
        workdir / "side-by-side.jsonl",
        model=model,
        lines=lines,
        prompt_words=prompt_words,
        max_tokens=max_tokens,
        seed=seed,
    )
    out: dict[str, Any] = {
        "lines": lines,
        "prompt_words": list(prompt_words),
        "max_tokens": max_tokens,
        "limits": asdict(limits),
        "target_speedup": TARGET_SPEEDUP,
        "cpu_count": os.cpu_count(),
        "skipped": {},
    }
    # The idle worker and its engine wait beside the two processes: what they cost is shown.
    idle_from = worker.cpu_seconds()
    say(f"[warm] side by side, {lines:,} lines: vllm run-batch (own process)")
    try:
        out["vllm_run_batch"] = with_load(
            lambda: asdict(run_vllm_batch(source, workdir, model=model, limits=limits))
        )
    except BenchFailed as exc:  # a peer that may not run here (a vLLM without it)
        out["skipped"]["vllm_run_batch"] = str(exc)
        say(f"[warm] vllm run-batch did not run: {exc}")
    say(f"[warm] side by side, {lines:,} lines: batchllm run (own process)")
    out["batchllm_run"] = with_load(
        lambda: asdict(
            run_batchllm(source, workdir, model=model, limits=limits, max_tokens=max_tokens)
        )
    )
    out["idle_worker_cpu_seconds"] = worker.cpu_seconds() - idle_from
    say(f"[warm] side by side, {lines:,} lines: batchllm submit to the warm worker")
    before = worker.engine_starts()
    out["warm_worker"] = with_load(
        lambda: run_submitted(
            source, model=model, settings=settings, log_path=workdir / "submit.log", timeout=1800
        )
    )
    out["warm_worker_engine_starts"] = worker.engine_starts() - before
    require_no_engine_start("the side-by-side job", out["warm_worker_engine_starts"])
    check_like_for_like(out, lines=lines, max_tokens=max_tokens)
    out |= speedups(out)
    say(
        "[warm] side by side: "
        + ", ".join(
            f"{key} {out[key]['seconds']:.1f} s"
            for key in ("vllm_run_batch", "batchllm_run", "warm_worker")
            if key in out
        )
    )
    return out


def with_load(go: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`go()`'s figures with the machine's 1-minute load average before and after: a wall
    time measured while other work held the cores says so."""
    before = os.getloadavg()[0]
    figures = go()
    return figures | {"load_average": [before, os.getloadavg()[0]]}


def check_like_for_like(side: dict[str, Any], *, lines: int, max_tokens: int) -> None:
    """Every contender ran every line and generated the same tokens, or the wall times
    compare different work."""
    expected = lines * max_tokens
    for key in ("vllm_run_batch", "batchllm_run", "warm_worker"):
        run = side.get(key)
        if run is None:
            continue
        if run["requests"] != lines or run["failed"] or run["output_tokens"] != expected:
            raise BenchFailed(
                f"side by side: {key} ran {run['requests']} requests ({run['failed']} failed) "
                f"and generated {run['output_tokens']} tokens; expected {lines} requests and "
                f"{expected} tokens"
            )


def speedups(side: dict[str, Any]) -> dict[str, Any]:
    """How many times sooner the warm worker finished the file than each fresh process."""
    warm = side["warm_worker"]["seconds"]
    out: dict[str, Any] = {"run_over_warm": side["batchllm_run"]["seconds"] / warm}
    if "vllm_run_batch" in side:
        out["run_batch_over_warm"] = side["vllm_run_batch"]["seconds"] / warm
        out["target_met"] = out["run_batch_over_warm"] >= side["target_speedup"]
    return out


def run_warm(
    *,
    model: str,
    workdir: Path,
    limits: EngineLimits,
    lines: int = 50,
    file_lines: int = 1000,
    file_prompt_words: tuple[int, int] = (8, 64),
    max_tokens: int = 64,
    seed: int = 0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Start a worker with `limits` as its engine flags (max_model_len capped at the model's
    context; dtype `auto` resolved by the worker), run the five jobs of `lines` lines on it,
    then the side-by-side file of `file_lines` (none when 0: the five jobs alone, as the test
    suite runs it, whose run-batch and run are tested by the bench's own parts); the figures
    of each, and the worker ended."""
    from batchllm.bench.contenders import bench_settings
    from batchllm.demo.workload import write_workload
    from batchllm.engine.sizing import model_limit
    from batchllm.store.db import get_engine

    workdir.mkdir(parents=True, exist_ok=True)
    # The worker and this process must name the model alike: it is the queue and the metric label.
    model = str(Path(model).resolve()) if Path(model).exists() else model
    limits = replace(limits, max_model_len=min(limits.max_model_len, model_limit(model)))
    jobs: list[dict[str, Any]] = []
    with private_redis() as broker_url:
        settings = bench_settings(workdir / "home").model_copy(update={"broker_url": broker_url})
        get_engine(settings)  # creates and migrates the SQLite database before the worker opens it
        load_at_start = os.getloadavg()[0]
        worker = WorkerProcess(
            model=model, limits=limits, settings=settings, log_path=workdir / "worker.log"
        )
        try:
            ready = worker.wait_ready()
            load_at_ready = os.getloadavg()[0]
            engine = worker.engine()
            starts_at_ready = worker.engine_starts()
            if starts_at_ready != 1:
                raise BenchFailed(
                    f"the worker said ready after {starts_at_ready} engine starts; expected its "
                    "one start-up build"
                )
            say(
                f"[warm] worker {worker.name} ready in {ready:.1f} s (engine build "
                f"{engine['start_seconds']:.1f} s, max_model_len {engine['max_model_len']}, "
                f"{engine['dtype']}); log {worker.log_path}"
            )
            for n, job in enumerate(JOBS):
                source = write_workload(
                    workdir / f"job-{n}.jsonl",
                    requests=lines,
                    prompt_words=job.prompt_words,
                    forms=("chat",),
                    seed=seed + n,
                )
                spec = job.spec(model, engine["max_model_len"])
                before = worker.engine_starts()
                figures = time_job(spec, source=source, lines=lines, settings=settings, timeout=600)
                figures.update(
                    label=job.label,
                    prompt_words=list(job.prompt_words),
                    max_tokens=job.max_tokens,
                    temperature=job.temperature,
                    n=job.n,
                    choice=list(job.choice) if job.choice else None,
                    explicit_max_model_len=spec.engine.max_model_len,
                    engine_starts=worker.engine_starts() - before,
                )
                jobs.append(figures)
                say(
                    f"[warm] job {n + 1} ({job.label}): submit to first row "
                    f"{figures['submit_to_first_row_seconds']:.2f} s, to completed "
                    f"{figures['submit_to_completed_seconds']:.2f} s, rows "
                    f"{figures['rows_ok']} ok / {figures['rows_failed']} failed, engine starts "
                    f"{figures['engine_starts']}"
                )
                require_no_engine_start(f"job {n + 1} ({job.label})", figures["engine_starts"])
            served = replace(limits, max_model_len=engine["max_model_len"], dtype=engine["dtype"])
            side: dict[str, Any] | None = None
            if file_lines:
                side = side_by_side(
                    worker,
                    limits=served,
                    lines=file_lines,
                    prompt_words=file_prompt_words,
                    max_tokens=max_tokens,
                    seed=seed,
                    settings=settings,
                    workdir=workdir,
                    say=say,
                )
            engine_starts = worker.engine_starts()
        finally:
            pids = worker.stop()
            get_engine(settings).dispose()
    worker_figures = {
        "command": worker.command,
        "ready_seconds": ready,
        "load_average": [load_at_start, load_at_ready],
        "engine": engine,
        "engine_starts": engine_starts,
        "log": str(worker.log_path),
        "pids": pids,
    }
    summary = summarize(jobs, lines=lines) | {"worker": worker_figures}
    return summary | ({"side_by_side": side} if side else {})


def summarize(jobs: list[dict[str, Any]], *, lines: int) -> dict[str, Any]:
    """Per-job figures, and over the jobs: what a warm worker's user waits."""
    out: dict[str, Any] = {
        "lines": lines,
        "jobs": jobs,
        "engine": {"version": jobs[0]["vllm_version"], "hardware": jobs[0]["hardware"]},
        "jobs_with_engine_starts": sum(1 for job in jobs if job["engine_starts"]),
        "target_seconds": TARGET_SECONDS,
    }
    for key in (
        "pickup_to_first_row_seconds",
        "submit_to_first_row_seconds",
        "submit_to_completed_seconds",
    ):
        values = [job[key] for job in jobs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    out["target_met"] = out["pickup_to_first_row_seconds"]["max"] <= TARGET_SECONDS
    return out
