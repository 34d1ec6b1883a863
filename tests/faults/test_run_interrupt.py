"""Ctrl-C of `batchllm run` (no fleet: SQLite in a fresh BATCHLLM_HOME) part-way through a job.

Two runs start at once, each in its own session (as `setsid batchllm run ...`) with its engine
on its own core, and each is interrupted once 30-60 % of its rows are committed: one with
SIGINT to its whole process group (a terminal's Ctrl-C, which reaches vLLM's EngineCore too),
the other with SIGINT to its main process only. Either way the process must exit non-zero
within EXIT_WITHIN seconds; the job must end `failed` ("interrupted") or `cancelled`, never
`completed` and without `_SUCCESS`; its committed rows must be real results (no request aborted
by the interrupt recorded as `ok`), each line at most once; and no engine process may remain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batchllm.demo.workload import write_workload
from batchllm.output.parts import SUCCESS_NAME, read_output
from batchllm.storage import Storage
from tests.support.cli import kill_group
from tests.support.faults import alive_of, descendants, kill_recorded
from tests.support.fleet import REPO, tail
from tests.support.homes import latest_job
from tests.support.job_checks import assert_each_line_at_most_once, expected_rows
from tests.support.skips import require

pytestmark = pytest.mark.faults

ROWS = 2000
MAX_TOKENS = 64
INTERRUPT_AT = 0.30  # share of rows committed when SIGINT is sent (aim: 30-60 %)
START_TIMEOUT = 300  # engine start plus 30 % of the job, two runs sharing two cores
EXIT_WITHIN = 60
ENGINE_GONE_WITHIN = 15


@dataclass
class Run:
    variant: str  # "group" or "main"
    home: Path
    source: Path
    log_path: Path
    proc: subprocess.Popen
    recorded: dict[int, float] = field(default_factory=dict)
    share_at_signal: float | None = None
    signalled_at: float | None = None
    exit_seconds: float | None = None
    engine_left: dict[int, str] = field(default_factory=dict)
    engine_gone_seconds: float | None = None

    def job(self) -> dict | None:
        return latest_job(self.home)

    def tail(self) -> str:
        return tail(self.log_path, 40)


def start_run(variant: str, *, model: Path, work_dir: Path, core: int) -> Run:
    home = work_dir / variant / "home"
    home.mkdir(parents=True)
    source = write_workload(work_dir / variant / "j.jsonl", requests=ROWS, seed=30 + core)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    env["BATCHLLM_KEEP_ALIVE"] = "0"  # no engine kept after the test
    env.update(
        {
            "BATCHLLM_HOME": str(home),
            # Commit often, so the job row shows the run's progress as it goes.
            "BATCHLLM_COMMIT_ROWS": "100",
            "BATCHLLM_COMMIT_SECONDS": "2",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
        }
    )
    script = Path(sys.executable).with_name("batchllm")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "batchllm"]
    log_path = work_dir / variant / "run.log"
    with log_path.open("wb") as log:
        # start_new_session: what `setsid batchllm run ...` does; the pid leads its own group.
        proc = subprocess.Popen(
            [
                *command,
                "run",
                str(source),
                "--model",
                str(model),
                "--max-tokens",
                str(MAX_TOKENS),
                "--ignore-eos",
                "--max-model-len",
                "512",
                "--enforce-eager",
            ],
            env=env,
            cwd=work_dir / variant,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Run(variant=variant, home=home, source=source, log_path=log_path, proc=proc)


def interrupt(run: Run) -> None:
    if run.variant == "group":
        os.killpg(run.proc.pid, signal.SIGINT)
    else:
        os.kill(run.proc.pid, signal.SIGINT)
    run.signalled_at = time.monotonic()


@pytest.fixture(scope="module")
def interrupted(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Both runs, started together and each interrupted at INTERRUPT_AT of its rows."""
    import importlib.util

    require(importlib.util.find_spec("vllm") is not None, "vllm is not installed")
    work_dir = tmp_path_factory.mktemp("interrupt")
    cores = os.cpu_count() or 1
    runs = {
        v: start_run(v, model=tiny_model, work_dir=work_dir, core=i % cores)
        for i, v in enumerate(("group", "main"))
    }
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while any(r.signalled_at is None for r in runs.values()):
            for run in runs.values():
                if run.signalled_at is not None:
                    # Its exit, timed while the other run is still on its way to its signal
                    # (waited for only after the loop, it read as the other run's wait).
                    if run.exit_seconds is None and run.proc.poll() is not None:
                        run.exit_seconds = time.monotonic() - run.signalled_at
                    continue
                run.recorded.update(descendants(run.proc.pid))
                if run.proc.poll() is not None:
                    raise AssertionError(
                        f"`batchllm run` ({run.variant}) exited with "
                        f"{run.proc.returncode} before it was interrupted:\n" + run.tail()
                    )
                job = run.job()
                if job and job["request_total"]:
                    done = job["request_completed"] + job["request_failed"]
                    share = done / job["request_total"]
                    if share >= INTERRUPT_AT:
                        run.share_at_signal = share
                        interrupt(run)
            if time.monotonic() > deadline:
                late = [r.variant for r in runs.values() if r.signalled_at is None]
                raise AssertionError(
                    f"runs {late} did not reach {INTERRUPT_AT:.0%} of their rows "
                    f"within {START_TIMEOUT}s:\n" + "\n".join(runs[v].tail() for v in late)
                )
            time.sleep(0.2)
        for run in runs.values():
            if run.exit_seconds is not None:
                continue
            remaining = run.signalled_at + EXIT_WITHIN - time.monotonic()
            try:
                run.proc.wait(timeout=max(remaining, 0.1))
                run.exit_seconds = time.monotonic() - run.signalled_at
            except subprocess.TimeoutExpired:
                pass
        for run in runs.values():
            gone_by = time.monotonic() + ENGINE_GONE_WITHIN
            while alive_of(run.recorded) and time.monotonic() < gone_by:
                time.sleep(0.25)
            run.engine_left = alive_of(run.recorded)
            if not run.engine_left and run.exit_seconds is not None:
                run.engine_gone_seconds = time.monotonic() - run.signalled_at
        yield runs
    finally:
        for run in runs.values():
            kill_group(run.proc)
            kill_recorded(run.recorded)


def check_interrupted_run(run: Run, recovery) -> None:
    assert run.exit_seconds is not None, (
        f"`batchllm run` still ran {EXIT_WITHIN}s after SIGINT ({run.variant}):\n" + run.tail()
    )
    recovery(
        "SIGINT -> process exited",
        run.exit_seconds,
        f"signalled at {run.share_at_signal:.0%} of rows; exit code {run.proc.returncode}",
    )
    assert run.proc.returncode != 0, "an interrupted run exited 0\n" + run.tail()

    job = run.job()
    assert job is not None
    assert job["status"] in ("failed", "cancelled"), (
        f"job {job['status']} after SIGINT: {job['error']}\n" + run.tail()
    )
    if job["status"] == "failed":
        assert "interrupted" in (job["error"] or ""), job["error"]
    storage = Storage(str(run.home / "jobs"))
    out_dir = storage.output_dir(job["id"])
    assert not storage.exists(f"{out_dir}/{SUCCESS_NAME}"), "an interrupted job wrote _SUCCESS"

    rows = read_output(storage, out_dir).to_pylist()
    assert rows, "the rows finished before the interrupt were not kept"
    assert_each_line_at_most_once(rows, expected_rows(run.source))
    assert len(rows) == job["request_completed"] + job["request_failed"]
    reasons = {r["finish_reason"] for r in rows if r["status"] == "ok"}
    assert reasons <= {"stop", "length"}, f"ok rows with finish reasons {reasons}"
    cut = [
        r
        for r in rows
        if r["status"] == "ok" and (not r["text"] or r["completion_tokens"] != MAX_TOKENS)
    ]
    assert not cut, (
        f"{len(cut)} ok rows cut short by the interrupt (ignore_eos, "
        f"max_tokens {MAX_TOKENS}), e.g. {cut[0]}"
    )

    recovery(
        "SIGINT -> engine processes gone",
        run.engine_gone_seconds,
        f"{len(run.recorded)} child processes recorded",
    )
    assert not run.engine_left, (
        f"engine processes outlived `batchllm run` by {ENGINE_GONE_WITHIN}s: {run.engine_left}"
    )


def test_ctrl_c_to_the_process_group_of_batchllm_run_fails_the_job_and_keeps_only_results(
    interrupted, recovery
):
    check_interrupted_run(interrupted["group"], recovery)


def test_sigint_to_the_main_process_of_batchllm_run_fails_the_job_and_keeps_only_results(
    interrupted, recovery
):
    check_interrupted_run(interrupted["main"], recovery)
