"""`batchllm ARGS` as a user runs it: in a process of its own (`run_cli`, for the suites that
run the CLI beside workers and engines), or in this process through click's runner (`invoke`,
for the unit tests of the commands)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

from click.testing import CliRunner, Result

from batchllm.cli import cli

REPO = Path(__file__).resolve().parents[2]
# The sections `batchllm doctor` reports, each once.
DOCTOR_SECTIONS = {
    "python",
    "torch",
    "vllm",
    "hardware",
    "dtype",
    "database",
    "broker",
    "storage",
    "settings",
}
# What a local run must not inherit from the machine's environment: it would point the run at
# another database or storage than its home's.
LOCAL_UNSET = ("BATCHLLM_DATABASE_URL", "BATCHLLM_STORAGE")


def invoke(*args: str) -> Result:
    """`batchllm ARGS` in this process: its exit code and output, exceptions caught."""
    return CliRunner().invoke(cli, list(args), prog_name="batchllm")


def run_cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchllm", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_batchllm(args: list[str], *, env: dict[str, str], log: IO[bytes]) -> subprocess.Popen:
    """`batchllm ARGS` in the background, in a process group of its own (so that a test can
    signal it and every process it started, and nothing else), stdout and stderr into `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "batchllm", *args],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of a `start_new_session` child that still runs, and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def capture_supervised(monkeypatch) -> list[list[str]]:
    """`batchllm worker --concurrency N` starts no process: the argv of each child it would
    have supervised is appended to the list returned, and the supervisor returns 0."""
    started: list[list[str]] = []
    monkeypatch.setattr(
        "batchllm.process.supervisor.supervise",
        lambda commands: started.extend(argv for argv, _env in commands) or 0,
    )
    return started


def local_env(home: Path, *, unset: tuple[str, ...] = LOCAL_UNSET, **extra: str) -> dict[str, str]:
    """This process's environment for a local `batchllm` with its own home (its SQLite database
    and storage): this checkout first on the path, `unset` removed, `extra` added."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "BATCHLLM_HOME": str(home), **extra}
    for name in unset:
        env.pop(name, None)
    return env
