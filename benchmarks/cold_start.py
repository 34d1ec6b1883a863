"""Cold start against warm runs: a first `batchllm run` from a fresh home (it starts a kept
engine: imports vLLM, builds the engine) and runs that find the kept engine up, for the current
tree and, with --baseline DIR (an older checkout), for it too, side by side in one run. The cold
start is most of what a user waits for on a small file: this says where it goes (job created,
engine ready, rows done) and whether a change made it shorter.

    python -m benchmarks.cold_start --repeats 3 --baseline /tmp/before --json cold.json

Each repeat runs the contenders in turn (current, baseline, current, baseline...: machine noise
hits both alike), each in a fresh BATCHLLM_HOME H, from the benchmark's temp dir (run from the
repo root, `python -m` imports the repo's batchllm whatever PYTHONPATH says):

    BATCHLLM_HOME=H [PYTHONPATH=DIR] python -m batchllm -v run q8.jsonl --model MODEL \\
        --temperature 0 --max-tokens 64 --enforce-eager --kv-cache-memory-bytes 536870912 \\
        --output H/cold                      # cold: starts a kept engine, which stays up
    (--pause seconds, 5 by default: the next command, as a user types it)
    ... the same, --output H/warm8           # warm, 8 questions
    ... the same with q1.jsonl, H/warm1      # warm, 1 question
    BATCHLLM_HOME=H [PYTHONPATH=DIR] python -m batchllm engine stop --all

then waits for the kept engines' processes to end (SIGKILL after 60 s). Each contender's
warm runs handed to a warm runner (batchllm/warm_runner.py) are counted from its engine log.
The cold run's offsets are the log lines "batchllm.jobs.create: job", "vLLM engine ready in" and finalize's
"completed:" (its -v output and H/engines/*.log) from the moment the benchmark started it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from batchllm.demo import chat_lines

FLAGS = ["--temperature", "0", "--max-tokens", "64", "--enforce-eager"]
FLAGS += ["--kv-cache-memory-bytes", "536870912"]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
READY = re.compile(r"vLLM engine ready in (.*)$")
FIGURES = {
    "cold_s": "cold total",
    "cold_job_created_s": "cold to job created",
    "cold_engine_ready_s": "cold to engine ready",
    "cold_completed_s": "cold to completed",
    "warm8_s": "warm, 8 questions",
    "warm1_s": "warm, 1 question",
}


class RunFailed(Exception):
    """A command that did not exit 0: (what, its output)."""


def write_questions(work: Path) -> tuple[Path, Path]:
    """q8.jsonl: chat_lines(1)'s first 8 capital/fact questions; q1.jsonl: the first of them."""
    picked = [line for line in chat_lines(1) if line["custom_id"].startswith(("capital", "fact"))]
    q8, q1 = work / "q8.jsonl", work / "q1.jsonl"
    q8.write_text("".join(json.dumps(line) + "\n" for line in picked[:8]))
    q1.write_text(json.dumps(picked[0]) + "\n")
    return q8, q1


def environment(home: Path, pythonpath: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["BATCHLLM_HOME"] = str(home)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


def imported(cwd: Path, pythonpath: str | None) -> str:
    """Where a contender's `import batchllm` comes from."""
    probe = [sys.executable, "-c", "import batchllm; print(batchllm.__file__)"]
    env = environment(cwd, pythonpath)
    done = subprocess.run(probe, env=env, cwd=cwd, text=True, capture_output=True, check=True)
    return done.stdout.strip()


def run(args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[float, str]:
    """`python -m batchllm ARGS`: (wall seconds, stdout and stderr); RunFailed unless it exits 0."""
    command = [sys.executable, "-m", "batchllm", *args]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=timeout, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        output = exc.output or ""  # bytes, what it wrote before it was killed
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        raise RunFailed(f"{' '.join(command)}: timed out after {timeout:.0f} s", output) from exc
    if done.returncode != 0:
        raise RunFailed(f"{' '.join(command)}: exit code {done.returncode}", done.stdout)
    return time.perf_counter() - started, done.stdout


def stamps(text: str, started: float) -> dict[str, Any]:
    """Offsets from `started` (epoch seconds) of the first job created, engine ready and
    completed lines in `text`, and the ready line's phases; None where a line is missing."""
    keys = ("cold_job_created_s", "cold_engine_ready_s", "cold_completed_s", "phases")
    found: dict[str, Any] = dict.fromkeys(keys)
    for line in text.splitlines():
        match = STAMP.match(line)
        if match is None:
            continue
        at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - started
        ready = READY.search(line)
        if "batchllm.jobs.create: job" in line and found["cold_job_created_s"] is None:
            found["cold_job_created_s"] = at
        elif ready is not None and found["cold_engine_ready_s"] is None:
            found["cold_engine_ready_s"], found["phases"] = at, ready.group(1)
        elif "batchllm.execution.finalize" in line and " completed:" in line:
            found["cold_completed_s"] = found["cold_completed_s"] or at
    return found


def engine_pids(home: Path) -> set[int]:
    """The kept engines' processes from HOME/engines/*.json, and their children."""
    pids: set[int] = set()
    for path in (home / "engines").glob("*.json"):
        try:
            pids.add(int(json.loads(path.read_text())["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    for pid in list(pids):
        try:
            pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass
    return pids


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_engines(env: dict[str, str], home: Path, cwd: Path, wait: float = 60.0) -> float:
    """`engine stop --all`, then the seconds until its processes were gone (SIGKILL at `wait`)."""
    pids = engine_pids(home)
    started = time.perf_counter()
    try:
        run(["engine", "stop", "--all"], env, cwd, timeout=wait)
    finally:
        while any(alive(pid) for pid in pids) and time.perf_counter() - started < wait:
            time.sleep(0.2)
        for pid in filter(alive, pids):
            print(f"  kept engine process {pid} still up after {wait:.0f} s: SIGKILL", flush=True)
            os.kill(pid, signal.SIGKILL)
    return time.perf_counter() - started


def one_contender(
    pythonpath: str | None,
    model: str,
    work: Path,
    questions: tuple[Path, Path],
    timeout: float,
    pause: float,
) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="home-", dir=work))
    env = environment(home, pythonpath)
    q8, q1 = (str(path) for path in questions)

    def job(source: str, out: str) -> tuple[float, str]:
        args = ["-v", "run", source, "--model", model, *FLAGS, "--output", str(home / out)]
        return run(args, env, work, timeout)

    try:
        started = time.time()
        cold, output = job(q8, "cold")
        logs = [output] + [p.read_text(errors="replace") for p in (home / "engines").glob("*.log")]
        found = stamps("\n".join(logs), started)
        time.sleep(pause)  # the user's next command: typed, not fired the moment one ends
        warm8, _ = job(q8, "warm8")
        warm1, _ = job(q1, "warm1")
        handed = sum(
            p.read_text(errors="replace").count("run handed over: child")
            for p in (home / "engines").glob("*.log")
        )
    finally:
        stop = stop_engines(env, home, work)
        shutil.rmtree(home, ignore_errors=True)
    return {
        "cold_s": cold,
        **found,
        "warm8_s": warm8,
        "warm1_s": warm1,
        "warm_runs_handed_over": handed,
        "stop_s": stop,
    }


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run[key] for run in runs if run[key] is not None]
    return statistics.median(values) if values else None


def cell(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def ratio(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or not bottom else top / bottom


def local_model(name: str) -> str:
    """A model directory, absolute: relative to the cwd, else to the repo (the default
    .demo/chat from a temp cwd); anything else as given (a Hugging Face name)."""
    for path in (Path(name), Path(__file__).resolve().parents[1] / name):
        if path.exists():
            return str(path.resolve())
    return name


def print_medians(medians: dict[str, dict[str, float | None]], labels: dict[str, str]) -> None:
    """Each figure's median per contender, and baseline/current when there is a baseline."""
    names, both = list(medians), "baseline" in medians
    header = f"{'seconds (median)':<24}" + "".join(f"{name:>12}" for name in names)
    print(header + ("  baseline/current" if both else ""))
    for key, label in labels.items():
        line = f"{label:<24}" + "".join(f"{cell(medians[n][key]):>12}" for n in names)
        if both:
            line += f"{cell(ratio(medians['baseline'][key], medians['current'][key]), 'x'):>18}"
        print(line)


def report(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The table, printed; the figures, returned."""
    names = list(runs)
    medians = {name: {key: median(runs[name], key) for key in FIGURES} for name in names}
    for name in names:
        medians[name]["cold_over_warm8"] = ratio(medians[name]["cold_s"], medians[name]["warm8_s"])
    print_medians(medians, {**FIGURES, "cold_over_warm8": "cold / warm 8 (ratio)"})
    for name in names:
        print(f"{name} engine ready in {runs[name][-1]['phases'] or '-'} (last repeat)")
    return {"medians": medians, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".demo/chat", help="the model every run loads")
    parser.add_argument("--baseline", type=Path, help="an older checkout (a git worktree)")
    parser.add_argument("--repeats", type=int, default=3, help="cold + warm runs per contender")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per command")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--pause",
        type=float,
        default=5.0,
        help="seconds between the cold run and the warm ones, as a user types the next "
        "command (a kept engine starts its warm runner 2 s after its first run; it is ready "
        "1-2 s later)",
    )
    args = parser.parse_args(argv)
    model = local_model(args.model)
    contenders: dict[str, str | None] = {"current": None}
    if args.baseline is not None:
        contenders["baseline"] = str(args.baseline.resolve())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(prefix="batchllm-cold-bench-") as scratch:
        work = Path(scratch)
        questions = write_questions(work)
        for name, pythonpath in contenders.items():
            print(f"{name}: batchllm from {imported(work, pythonpath)}", flush=True)
        try:
            for repeat in range(args.repeats):
                for name, pythonpath in contenders.items():
                    row = one_contender(
                        pythonpath, model, work, questions, args.timeout, args.pause
                    )
                    runs[name].append(row)
                    print(
                        f"repeat {repeat + 1} {name}: cold {row['cold_s']:.1f} s, warm 8 "
                        f"{row['warm8_s']:.1f} s, warm 1 {row['warm1_s']:.1f} s (handed to "
                        f"a warm runner: {row['warm_runs_handed_over']} of 2), engines "
                        f"stopped in {row['stop_s']:.1f} s",
                        flush=True,
                    )
        except RunFailed as exc:
            what, output = exc.args
            tail = "\n".join(output.splitlines()[-40:])
            print(f"FAILED {what}; the end of its output:\n{tail}", file=sys.stderr)
            return 1
    figures = report(runs)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
