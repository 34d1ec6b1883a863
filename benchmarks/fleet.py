"""The fleet simulation: N `batchllm worker --engine instant` processes on a private Redis and
PostgreSQL (batchllm/process/services.py, benchmarks/private_postgres.py), one job of M
lines, then several jobs at once.

Everything but generation is real (execution/instant.py), so what is measured is what a fleet
costs beyond its GPUs: the rows/s the fleet's own machinery sustains, the time from submit to
the first committed row and to completion, shard-claim conflicts, PostgreSQL connections
against max_connections, Redis commands per shard, and a reconciler pass over the history the
runs leave. CPU seconds of the workers, PostgreSQL and Redis are recorded per run so that the
report can say which of them bends the curve.

    python -m benchmarks.fleet --workers 1,5,10,20 --lines 200000 --output fleet.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import batchllm
from batchllm.bench.figures import BenchFailed
from batchllm.bench.parts.overhead import write_lines
from batchllm.process.services import RedisServer, tail
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults
from benchmarks.private_postgres import PostgresCluster

Say = Callable[[str], None]
_REPO = Path(batchllm.__file__).resolve().parents[1]
MAX_MODEL_LEN = 512
MAX_TOKENS = (8, 32)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its waited-for children (/proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def children_of(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Fleet:
    """The services, the environment the workers share, and the workers themselves."""

    def __init__(self, work_dir: Path, model: str, *, max_connections: int) -> None:
        self.work_dir, self.model = work_dir, model
        self.redis = RedisServer(work_dir=work_dir / "redis")
        self.postgres = PostgresCluster(max_connections=max_connections)
        self.workers: list[tuple[str, subprocess.Popen, Path]] = []
        self.env: dict[str, str] = {}
        self.settings: Settings | None = None

    def start_services(self) -> Settings:
        from batchllm.store.db import upgrade

        self.redis.start()
        self.postgres.start_new()
        upgrade(self.postgres.url)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
        self.env.update(
            {
                "PYTHONPATH": os.pathsep.join(
                    [str(_REPO), *filter(None, [os.getenv("PYTHONPATH")])]
                ),
                "BATCHLLM_HOME": str(self.work_dir / "home"),
                "BATCHLLM_DATABASE_URL": self.postgres.url,
                "BATCHLLM_BROKER_URL": self.redis.url,
                "BATCHLLM_STORAGE": str(self.work_dir / "storage"),
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.settings = Settings(
            home=self.work_dir / "home",
            database_url=self.postgres.url,
            broker_url=self.redis.url,
            storage=str(self.work_dir / "storage"),
        )
        return self.settings

    def start_workers(self, count: int, tag: str) -> float:
        """Start `count` instant workers and wait until each says ready; returns the seconds."""
        started = time.monotonic()
        for i in range(count):
            name = f"{tag}-w{i}@fleet"
            log_path = self.work_dir / "logs" / f"{name}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            proc = subprocess.Popen(
                [sys.executable, "-m", "batchllm", "worker", "--engine", "instant"]
                + ["--model", self.model, "--name", name, "--loglevel", "INFO"]
                + ["--max-model-len", str(MAX_MODEL_LEN)],
                env=self.env,
                stdout=log_path.open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.workers.append((name, proc, log_path))
        deadline = time.monotonic() + 120 + 15 * count
        for name, proc, log_path in self.workers:
            while f"{name} ready." not in log_path.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BenchFailed(f"worker {name} did not start:\n{tail(log_path, 30)}")
                time.sleep(0.2)
        return time.monotonic() - started

    def worker_cpu(self) -> float:
        return sum(cpu_seconds(proc.pid) for _, proc, _ in self.workers)

    def postgres_cpu(self) -> float:
        pid = self.postgres.pid
        if pid is None:
            return 0.0
        return cpu_seconds(pid) + sum(cpu_seconds(c) for c in children_of(pid))

    def redis_cpu(self) -> float:
        return cpu_seconds(self.redis.proc.pid) if self.redis.proc is not None else 0.0

    def stop_workers(self) -> None:
        for _, proc, _ in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in self.workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self.workers = []

    def stop(self) -> None:
        self.stop_workers()
        self.redis.stop()
        self.postgres.destroy()


class Sampler:
    """Samples PostgreSQL's client connections every 0.2 s while a run goes, and notes when
    the first row of a job submitted in the run was committed (`first_row`, seconds after
    `started`): while the submit still runs, for a job whose shards stream."""

    def __init__(self, postgres: PostgresCluster) -> None:
        self.postgres = postgres
        self.samples: list[int] = []
        self.first_row: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        with postgres.connect() as conn:
            self._before = [row[0] for row in conn.execute("SELECT id FROM jobs").fetchall()]
        self.started = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.samples.append(self.postgres.connections())
                if self.first_row is None:
                    self._look_for_a_row()
            except Exception:
                pass

    def _look_for_a_row(self) -> None:
        with self.postgres.connect() as conn:
            (rows,) = conn.execute(
                "SELECT count(*) FROM jobs WHERE NOT (id = ANY(%s)) "
                "AND request_completed + request_failed > 0",
                (self._before,),
            ).fetchone()
        if rows:
            self.first_row = time.monotonic() - self.started

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _spec(model: str, sized: bool = True, max_tokens: int = MAX_TOKENS[1]) -> JobSpec:
    """The bench's job; `sized=False`: no max_model_len, so a worker sizes it from its rows
    (the sizing pass, once per job: execution/context/resolve.py resolve_max_model_len)."""
    return JobSpec(
        model=model,
        engine=EngineOptions(max_model_len=MAX_MODEL_LEN if sized else None),
        sampling=SamplingDefaults(max_tokens=max_tokens, ignore_eos=True),
    )


def run_jobs(
    fleet: Fleet,
    sources: list[Path],
    *,
    shard_size: int,
    timeout: float,
    sized: bool = True,
    max_tokens: int = MAX_TOKENS[1],
    settings: Settings | None = None,
) -> dict:
    """Submit the files one after another as fast as submit goes, then follow every job to its
    end; the figures of the whole set."""
    from batchllm.input.files.source import resolve_input
    from batchllm.jobs.submit import submit_job
    from batchllm.store.db import get_engine

    settings = settings or fleet.settings
    assert settings is not None
    redis_before = fleet.redis.commands()
    outcomes_before = task_outcomes(fleet)
    sizing_before = sizing_passes(fleet)
    cpu_before = (fleet.worker_cpu(), fleet.postgres_cpu(), fleet.redis_cpu())
    with Sampler(fleet.postgres) as sampler:
        started = sampler.started
        # This process's CPU while it submits: validation, storing, the submit's token pass
        # (its thread) and queueing; the sampler's 0.2 s polls are in it too, a few ms.
        submit_cpu = time.process_time()
        job_ids, submitted = [], []
        for source in sources:
            job_ids.append(
                submit_job(
                    resolve_input(source, s3_endpoint=settings.resolved_s3_endpoint),
                    _spec(fleet.model, sized, max_tokens),
                    shard_size=shard_size,
                    settings=settings,
                ).id
            )
            submitted.append(time.monotonic() - started)
        submit_cpu = time.process_time() - submit_cpu
        get_engine(settings).dispose()  # the bench's own connection is not the fleet's
        first_row, rows = _follow(fleet.postgres, job_ids, started, timeout)
        ended = time.monotonic() - started
    cpu_after = (fleet.worker_cpu(), fleet.postgres_cpu(), fleet.redis_cpu())
    redis_after = fleet.redis.commands()
    facts = _shard_facts(fleet.postgres, job_ids)
    cpu = {
        "submit": submit_cpu,
        "workers": cpu_after[0] - cpu_before[0],
        "postgres": cpu_after[1] - cpu_before[1],
        "redis": cpu_after[2] - cpu_before[2],
    }
    redis_calls = {k: v - redis_before.get(k, 0) for k, v in redis_after.items()}
    redis_total = sum(redis_calls.values())
    return {
        "jobs": len(job_ids),
        "rows": rows,
        "shards": facts["shards"],
        "submit_seconds": submitted[-1],
        # The sampler polls every 0.2 s; _follow only once the submit returned.
        "first_row_s": min(first_row, sampler.first_row or first_row),
        "completed_s": ended,
        "rows_per_s": rows / ended,
        "rows_per_s_after_queued": rows / (ended - submitted[-1]),
        "claim_conflicts": facts["extra_claims"],
        # Workers that ran a job's sizing pass (0 when the jobs give max_model_len).
        "sizing_passes": sizing_passes(fleet) - sizing_before,
        # Deliveries by outcome: 'busy' is a shard claimed while another worker held it.
        "task_outcomes": settled_outcomes(fleet, outcomes_before, facts["shards"]),
        "pg_connections_peak": max(sampler.samples, default=0),
        "pg_connections_median": statistics.median(sampler.samples) if sampler.samples else 0,
        "pg_max_connections": fleet.postgres.max_connections,
        "redis_commands": redis_total,
        "redis_commands_per_shard": redis_total / max(1, facts["shards"]),
        "redis_top_commands": dict(sorted(redis_calls.items(), key=lambda kv: -kv[1])[:6]),
        "cpu_seconds": cpu,
        # Item 4 of issue 37: where a row's CPU goes (µs a row).
        "cpu_us_per_row": {k: round(v * 1e6 / max(1, rows), 1) for k, v in cpu.items()},
        "worker_idle_share": facts["idle_share"],
        "checkpoints": facts["checkpoints"],
        "load_average_1m": os.getloadavg()[0],
    }


def _follow(
    postgres: PostgresCluster, job_ids: list[str], started: float, timeout: float
) -> tuple[float, int]:
    first_row: float | None = None
    with postgres.connect() as conn:
        while True:
            rows = conn.execute(
                "SELECT status, request_completed + request_failed FROM jobs WHERE id = ANY(%s)",
                (job_ids,),
            ).fetchall()
            now = time.monotonic() - started
            if first_row is None and any(r[1] for r in rows):
                first_row = now
            if all(r[0] in ("completed", "failed", "cancelled", "expired") for r in rows):
                bad = [r[0] for r in rows if r[0] != "completed"]
                if bad:
                    raise BenchFailed(f"fleet jobs ended {bad}")
                return first_row or now, sum(r[1] for r in rows)
            if now > timeout:
                raise BenchFailed(f"fleet jobs not done after {timeout:.0f} s: {rows}")
            time.sleep(0.05)


def _shard_facts(postgres: PostgresCluster, job_ids: list[str]) -> dict[str, Any]:
    with postgres.connect() as conn:
        shards, attempts = conn.execute(
            "SELECT count(*), coalesce(sum(attempts), 0) FROM shards WHERE job_id = ANY(%s)",
            (job_ids,),
        ).fetchone()
        (checkpoints,) = conn.execute(
            "SELECT count(*) FROM checkpoints c JOIN shards s ON s.id = c.shard_id "
            "WHERE s.job_id = ANY(%s)",
            (job_ids,),
        ).fetchone()
        runs = conn.execute(
            "SELECT worker, extract(epoch from started_at), extract(epoch from finished_at) "
            "FROM shards WHERE job_id = ANY(%s) AND started_at IS NOT NULL "
            "AND finished_at IS NOT NULL",
            (job_ids,),
        ).fetchall()
    return {
        "shards": shards,
        "extra_claims": attempts - shards,
        "checkpoints": checkpoints,
        "idle_share": idle_share([(w, float(a), float(b)) for w, a, b in runs]),
    }


def idle_share(runs: list[tuple[str, float, float]]) -> float | None:
    """The share of each worker's time, from its first shard's start to its last shard's end,
    that went between shards (the task's acknowledgement, the next delivery, fair share, the
    claim): the time its engine had no shard to run. Summed over the workers."""
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for worker, started, finished in runs:
        by_worker.setdefault(worker, []).append((started, finished))
    span = idle = 0.0
    for spans in by_worker.values():
        spans.sort()
        span += spans[-1][1] - spans[0][0]
        idle += sum(max(0.0, b[0] - a[1]) for a, b in itertools.pairwise(spans))
    return round(idle / span, 3) if span > 0 else None


_OUTCOME = re.compile(r"run_shard\[[^\]]+\] succeeded in [0-9.e-]+s: '(\w+)'")


def sizing_passes(fleet: Fleet) -> int:
    """How many sizing passes the workers ran so far, from their log lines."""
    return sum(
        log.read_text(errors="replace").count("max_model_len sized to")
        for _, _, log in fleet.workers
    )


def task_outcomes(fleet: Fleet) -> dict[str, int]:
    """How the workers' shard tasks ended so far, counted from their Celery log lines."""
    counts: dict[str, int] = {}
    for _, _, log in fleet.workers:
        for outcome in _OUTCOME.findall(log.read_text(errors="replace")):
            counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def settled_outcomes(
    fleet: Fleet, before: dict[str, int], shards: int, deadline_s: float = 30.0
) -> dict[str, int]:
    """The task outcomes since `before`, once every shard's 'completed' line is in the logs.

    Celery logs a task's outcome after the task returned, and the last shard's task marks its
    job completed before it returns: a job seen completed can still miss that line for a moment
    (a busy machine: 7 of 8 read once). So wait for it, with a deadline; what is there then is
    the answer (a shard completed twice shows as more)."""
    until = time.monotonic() + deadline_s
    while True:
        counts = {
            k: v - before.get(k, 0) for k, v in task_outcomes(fleet).items() if v - before.get(k, 0)
        }
        if counts.get("completed", 0) >= shards or time.monotonic() > until:
            return counts
        time.sleep(0.2)


def reconciler_pass_ms(settings: Settings, repeats: int = 5) -> dict[str, float]:
    """reconcile_once over the database as the runs left it (every job ended), timed."""
    from batchllm.worker.reconciler import reconcile_once

    sent: list[int] = []
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        reconcile_once(lambda shard_id, queue: sent.append(shard_id), settings)
        times.append((time.perf_counter() - started) * 1000)
    return {"median_ms": statistics.median(times), "max_ms": max(times), "resent": len(sent)}


def measure_fleet(
    work_dir: Path,
    *,
    model: str,
    workers: list[int],
    lines: int,
    shard_size: int,
    concurrent_jobs: int,
    max_connections: int,
    unsized: bool = False,
    prompt_words: tuple[int, int] = (8, 64),
    max_tokens: tuple[int, int] = MAX_TOKENS,
    submit_modes: list[str] | None = None,
    say: Say = print,
) -> dict[str, Any]:
    """`submit_modes`: also run the one job (and, with `unsized`, the one without
    max_model_len) once per BATCHLLM_TOKENIZE_AT_SUBMIT mode, side by side on the same
    workers (execution/context/submit_pass.py)."""
    fleet = Fleet(work_dir, model, max_connections=max_connections)
    source = write_lines(
        work_dir / "input.jsonl",
        lines,
        model=model,
        prompt_words=prompt_words,
        output_tokens=max_tokens,
    )
    part = max(1, lines // concurrent_jobs)
    parts = [
        write_lines(
            work_dir / f"concurrent-{i}.jsonl",
            part,
            model=model,
            prompt_words=prompt_words,
            output_tokens=max_tokens,
            seed=i + 1,
        )
        for i in range(concurrent_jobs)
    ]
    results = []
    job_args: dict[str, Any] = {
        "shard_size": shard_size,
        "timeout": 1800,
        "max_tokens": max_tokens[1],
    }
    try:
        settings = fleet.start_services()
        for count in workers:
            say(f"fleet: starting {count} instant worker(s)")
            ready_s = fleet.start_workers(count, f"n{count}")
            time.sleep(2)
            idle_connections = fleet.postgres.connections()
            rss = [rss_bytes(proc.pid) for _, proc, _ in fleet.workers]
            say(f"fleet: N={count}: one job of {lines:,} lines")
            one = run_jobs(fleet, [source], **job_args)
            say(
                f"fleet: N={count}: {one['rows_per_s']:,.0f} rows/s; {concurrent_jobs} jobs at once"
            )
            several = run_jobs(fleet, parts, **job_args)
            without = None
            if unsized:
                say(f"fleet: N={count}: one job of {lines:,} lines without max_model_len")
                without = run_jobs(fleet, [source], **job_args, sized=False)
            by_mode: dict[str, dict[str, Any]] = {}
            for mode in submit_modes or []:
                in_mode = settings.model_copy(update={"tokenize_at_submit": mode})
                say(f"fleet: N={count}: submit tokenizing {mode!r}")
                by_mode[mode] = {
                    "one_job": run_jobs(fleet, [source], **job_args, settings=in_mode),
                    "one_job_unsized": run_jobs(
                        fleet, [source], **job_args, sized=False, settings=in_mode
                    )
                    if unsized
                    else None,
                }
            peak_rss = [rss_bytes(proc.pid, "VmHWM") for _, proc, _ in fleet.workers]
            results.append(
                {
                    "workers": count,
                    "workers_ready_s": ready_s,
                    "idle_pg_connections": idle_connections,
                    "worker_rss_mib_median": statistics.median(rss) / 2**20,
                    "worker_peak_rss_mib_max": max(peak_rss) / 2**20,
                    "one_job": one,
                    "concurrent_jobs": several,
                    "one_job_unsized": without,
                    "submit_modes": by_mode,
                    "reconciler_pass": reconciler_pass_ms(settings),
                }
            )
            fleet.stop_workers()
    finally:
        fleet.stop()
    return {
        "lines": lines,
        "shard_size": shard_size,
        "concurrent_jobs": concurrent_jobs,
        "prompt_words": list(prompt_words),
        "max_tokens": list(max_tokens),
        "cpus": os.cpu_count(),
        "runs": results,
    }


def _span(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,5,10,20", help="comma-separated fleet sizes")
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--shard-size", type=int, default=2_000)
    parser.add_argument("--concurrent-jobs", type=int, default=4)
    parser.add_argument("--max-connections", type=int, default=100)
    parser.add_argument("--model", default=None, help="default: the tiny demo model, built")
    parser.add_argument("--work-dir", type=Path, default=Path(".bench-fleet"))
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--prompt-words",
        default="8-64",
        help="words per prompt, MIN-MAX (issue 37's job: 3-3)",
    )
    parser.add_argument(
        "--max-tokens",
        default=f"{MAX_TOKENS[0]}-{MAX_TOKENS[1]}",
        help="max_tokens per line, MIN-MAX (issue 37's job: 8-8)",
    )
    parser.add_argument(
        "--submit-modes",
        default="",
        help="comma-separated BATCHLLM_TOKENIZE_AT_SUBMIT modes (never,auto,always) to run "
        "the one job under, side by side",
    )
    parser.add_argument(
        "--unsized",
        action="store_true",
        help="also run the one job without max_model_len (a worker sizes it from its rows)",
    )
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from batchllm.engine.models.demo_model import build_demo_model

        model = str(args.work_dir / "model")
        if not (Path(model) / "config.json").exists():
            build_demo_model(Path(model))
    figures = measure_fleet(
        args.work_dir,
        model=model,
        workers=[int(n) for n in args.workers.split(",")],
        lines=args.lines,
        shard_size=args.shard_size,
        concurrent_jobs=args.concurrent_jobs,
        max_connections=args.max_connections,
        unsized=args.unsized,
        prompt_words=_span(args.prompt_words),
        max_tokens=_span(args.max_tokens),
        submit_modes=[m for m in args.submit_modes.split(",") if m],
        say=lambda text: print(text, file=sys.stderr, flush=True),
    )
    figures["command"] = "python -m benchmarks.fleet " + " ".join(argv or sys.argv[1:])
    figures["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = json.dumps(figures, indent=1)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
