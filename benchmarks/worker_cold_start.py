"""A fleet worker scaled up from zero: a job is queued for a model when a `batchllm worker`
starts with no engine, so the job waits for the worker's whole start (import vLLM, build the
engine, join Celery). Measured: seconds from the worker process's start to the job's first
committed row and to its completion, and the worker's "vLLM engine ready in X s: ..." phases;
for the current tree and, with --baseline DIR (an older checkout), for it too, alternately.

    python -m benchmarks.worker_cold_start --repeats 3 --baseline /tmp/before --json w.json

Each run: a fresh BATCHLLM_HOME (SQLite), a private redis-server as the broker, and from a temp
cwd (from the repo root `python -m` imports the repo's batchllm whatever PYTHONPATH says):
`batchllm submit` of 20 chat lines (--max-tokens 16 ENGINE_FLAGS), then the clock starts and
`batchllm worker --model MODEL ENGINE_FLAGS` (it serves what the job asks); the job is read
every 0.2 s, then the worker's group gets SIGTERM (SIGKILL after 60 s). The shard commits once
(BATCHLLM_COMMIT_SECONDS is 10 s), at its end: first row = shard done, completed = finalized.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from batchllm.client import Client
from batchllm.demo import chat_lines
from batchllm.process.services import RedisServer, ServiceFailed, tail
from batchllm.settings import Settings
from benchmarks.cold_start import RunFailed, cell, imported, local_model, median, print_medians

ENGINE_FLAGS = "--enforce-eager --max-model-len 512 --kv-cache-memory-bytes 268435456".split()
STAMP = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
READY = re.compile(r"vLLM engine ready in (.*)$")
FIGURES = {
    "engine_ready_s": "start to engine ready",
    "first_row_s": "start to first row",
    "completed_s": "start to completed",
    "stop_s": "SIGTERM to exit",
}


def write_lines(work: Path) -> Path:
    """q20.jsonl: chat_lines(1)'s 20 capital and fact questions."""
    picked = [line for line in chat_lines(1) if line["custom_id"].startswith(("capital", "fact"))]
    source = work / "q20.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in picked[:20]))
    return source


def logs(home: Path) -> str:
    """The worker's console and its vLLM output log (home/logs, where a newer worker puts it)."""
    paths = [home / "worker.log", *sorted((home / "logs").glob("*.log"))]
    return "\n".join(f"--- {p.name}\n{tail(p, 30)}" for p in paths if p.exists())


def environment(home: Path, broker_url: str, pythonpath: str | None) -> dict[str, str]:
    """This process's environment without BATCHLLM_ settings or PYTHONPATH, then the run's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHLLM_", "PYTHONPATH"))}
    env.update(BATCHLLM_HOME=str(home), BATCHLLM_BROKER_URL=broker_url, BATCHLLM_KEEP_ALIVE="0")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


def submit(source: Path, model: str, env: dict[str, str], cwd: Path) -> str:
    """`batchllm submit`: the job id it prints; RunFailed unless it exits 0."""
    args = ["submit", str(source), "--model", model, "--max-tokens", "16", *ENGINE_FLAGS]
    done = subprocess.run(
        [sys.executable, "-m", "batchllm", *args], env=env, cwd=cwd, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip():
        raise RunFailed(f"submit: exit code {done.returncode}", done.stdout + done.stderr)
    return done.stdout.split()[0]


def follow(
    client: Client, job_id: str, worker: subprocess.Popen[bytes], started: float, timeout: float
) -> tuple[float, float]:
    """Seconds from `started` (time.monotonic) to the job's first counted row and to its end;
    RunFailed if the worker exits first, the job ends other than completed, or at `timeout`."""
    first_row: float | None = None
    while True:
        job, now = client.status(job_id), time.monotonic() - started
        if first_row is None and job.completed + job.failed > 0:
            first_row = now
        if job.done:
            if job.status != "completed" or first_row is None:
                raise RunFailed(f"job {job_id} ended {job.status}: {job.error}", "")
            return first_row, now
        if worker.poll() is not None:
            raise RunFailed(f"the worker exited with {worker.returncode}, job {job.status}", "")
        if now > timeout:
            raise RunFailed(f"job {job_id} still {job.status} after {timeout:.0f} s", "")
        time.sleep(0.2)


def stop_worker(worker: subprocess.Popen[bytes], wait: float = 60.0) -> float:
    """SIGTERM to the worker's process group; SIGKILL to it after `wait` s. Seconds taken."""
    started = time.monotonic()
    try:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=wait)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        print(f"  worker {worker.pid} still up after {wait:.0f} s: SIGKILL", flush=True)
    stopped = time.monotonic() - started
    with contextlib.suppress(ProcessLookupError):  # what is left of its group (EngineCore...)
        os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    return stopped


def ready_line(log: str, started: float) -> tuple[float | None, str | None]:
    """The engine-ready line's offset from `started` (epoch seconds) and its phases."""
    for line in log.splitlines():
        stamp, ready = STAMP.match(line), READY.search(line)
        if stamp is not None and ready is not None:
            at = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            return at - started, ready.group(1)
    return None, None


def one_run(
    pythonpath: str | None, model: str, work: Path, source: Path, timeout: float
) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="home-", dir=work))
    redis = RedisServer(work_dir=home / "redis")
    log_path, worker = home / "worker.log", None
    try:
        redis.start()
        env = environment(home, redis.url, pythonpath)
        client = Client(Settings(home=home, database_url=None, broker_url=redis.url))
        job_id = submit(source, model, env, work)
        command = [sys.executable, "-m", "batchllm", "worker", "--model", model, *ENGINE_FLAGS]
        with log_path.open("wb") as log:
            started, wall = time.monotonic(), time.time()
            worker = subprocess.Popen(
                command, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        try:
            first_row, completed = follow(client, job_id, worker, started, timeout)
        except RunFailed as exc:
            raise RunFailed(exc.args[0], logs(home)) from exc
        stop = stop_worker(worker)
        engine_ready, phases = ready_line(log_path.read_text(errors="replace"), wall)
    except ServiceFailed as exc:
        raise RunFailed(f"private redis-server: {exc}", "") from exc
    finally:
        if worker is not None and worker.returncode is None:
            stop_worker(worker)
        redis.stop()
        shutil.rmtree(home, ignore_errors=True)
    return {
        "first_row_s": first_row, "completed_s": completed, "engine_ready_s": engine_ready,
        "stop_s": stop, "phases": phases,
    }  # fmt: skip


def report(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The table, printed; the figures, returned."""
    names = list(runs)
    medians = {name: {key: median(runs[name], key) for key in FIGURES} for name in names}
    print_medians(medians, FIGURES)
    for name in names:
        for i, row in enumerate(runs[name]):
            print(f"{name} {i + 1}: vLLM engine ready in {row['phases'] or '-'}")
    return {"medians": medians, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".demo/chat", help="the model the job and worker use")
    parser.add_argument("--baseline", type=Path, help="an older checkout (a git worktree)")
    parser.add_argument("--repeats", type=int, default=3, help="worker starts per contender")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    model = local_model(args.model)
    contenders: dict[str, str | None] = {"current": None}
    if args.baseline is not None:
        contenders["baseline"] = str(args.baseline.resolve())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(prefix="batchllm-worker-cold-") as scratch:
        work = Path(scratch)
        source = write_lines(work)
        for name, pythonpath in contenders.items():
            print(f"{name}: batchllm from {imported(work, pythonpath)}", flush=True)
        try:
            for repeat in range(args.repeats):
                for name, pythonpath in contenders.items():
                    row = one_run(pythonpath, model, work, source, args.timeout)
                    runs[name].append(row)
                    said = ", ".join(f"{label} {cell(row[k])} s" for k, label in FIGURES.items())
                    print(f"repeat {repeat + 1} {name}: {said}", flush=True)
        except RunFailed as exc:
            what, output = exc.args
            print(f"FAILED {what}; the end of its output or log:\n{output}", file=sys.stderr)
            return 1
    figures = report(runs)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
