"""The warm part: what a job gains from a `batchllm worker` that owns a warm engine.

A real worker process (Celery's solo pool, explicit engine flags, private Redis and SQLite
databases) builds its engine once, before it says ready (its readiness time). On that worker:
1. five jobs in a row (greedy and sampled, a `choice` constraint, n=2, one with its own
   max_model_len at or below the worker's), each timed from the database (submit, pickup, first
   row, completed), with its rows and the engine starts it caused (the worker's Prometheus
   metrics): a job that starts an engine fails the part, as no job rebuilds the operator's;
2. one OpenAI chat file end to end: `vllm run-batch` and `batchllm run` (each a fresh process
   building its engine) against `batchllm submit` to the warm worker (until the database says
   completed, polled every 0.1 s); the same model, engine flags and fixed ignore_eos output.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.bench.parts.warm_worker import (
    POLL_SECONDS,
    WorkerProcess,
    fleet_env,
    private_redis,
)
from batchllm.bench.processes import EngineLimits
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults

# The promise: a warm worker starts generating within 1 s of picking a job up.
TARGET_SECONDS = 1.0
# Issue 26's aim: the warm worker finishes the side-by-side file 3x sooner than run-batch.
TARGET_SPEEDUP = 3.0


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


def _seconds(later: datetime | None, earlier: datetime | None) -> float | None:
    return (later - earlier).total_seconds() if later and earlier else None


def wait_ended(
    job_id: str, settings: Settings, *, timeout: float, part: str = "warm part"
) -> dict[str, Any]:
    """Poll the database every 0.1 s until the job ends; its timestamps and counts, and the
    monotonic time at which it was seen ended. BenchFailed, naming `part`, unless it
    completed."""
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
                    raise BenchFailed(f"{part}: job {job_id} ended {row.status.value}: {row.error}")
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
                    "cached_tokens": row.cached_tokens,
                    "hardware": row.hardware,
                    "vllm_version": row.vllm_version,
                }
        if time.monotonic() > deadline:
            raise BenchFailed(f"{part}: job {job_id} not done after {timeout:.0f} s")
        time.sleep(POLL_SECONDS)


def time_job(
    spec: JobSpec, *, source: Path, lines: int, settings: Settings, timeout: float
) -> dict[str, Any]:
    """Submit one single-shard job, wait for it to end and read its timestamps."""
    from batchllm.input.files.source import resolve_input
    from batchllm.jobs.submit import submit_job

    dispatched: list[datetime] = []
    job_id = submit_job(
        resolve_input(source, s3_endpoint=settings.resolved_s3_endpoint),
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
    from batchllm.engine.sizing import model_limit
    from batchllm.store.db import get_engine

    workdir.mkdir(parents=True, exist_ok=True)
    # The worker and this process must name the model alike: it is the queue and the metric label.
    model = str(Path(model).resolve()) if Path(model).exists() else model
    limits = replace(limits, max_model_len=min(limits.max_model_len, model_limit(model)))
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
            engine = _built_engine(worker, ready, say)
            jobs = [
                _time_warm_job(
                    worker,
                    n,
                    job,
                    say=say,
                    worker_max_model_len=engine["max_model_len"],
                    lines=lines,
                    seed=seed,
                    settings=settings,
                    workdir=workdir,
                )
                for n, job in enumerate(JOBS)
            ]
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


def _built_engine(worker: WorkerProcess, ready: float, say: Callable[[str], None]) -> dict:
    """The engine the ready worker built, which must be its only engine start."""
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
    return engine


def _time_warm_job(
    worker: WorkerProcess,
    n: int,
    job: WarmJob,
    *,
    say: Callable[[str], None],
    worker_max_model_len: int,
    lines: int,
    seed: int,
    settings: Settings,
    workdir: Path,
) -> dict[str, Any]:
    """The `n`th of the five jobs on the worker: its figures, and the engine starts it caused
    (a failure unless none)."""
    from batchllm.demo.workload import write_workload

    source = write_workload(
        workdir / f"job-{n}.jsonl",
        requests=lines,
        prompt_words=job.prompt_words,
        forms=("chat",),
        seed=seed + n,
    )
    spec = job.spec(worker.model, worker_max_model_len)
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
    say(
        f"[warm] job {n + 1} ({job.label}): submit to first row "
        f"{figures['submit_to_first_row_seconds']:.2f} s, to completed "
        f"{figures['submit_to_completed_seconds']:.2f} s, rows "
        f"{figures['rows_ok']} ok / {figures['rows_failed']} failed, engine starts "
        f"{figures['engine_starts']}"
    )
    require_no_engine_start(f"job {n + 1} ({job.label})", figures["engine_starts"])
    return figures


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
