"""Kept engines (batchllm/kept_engine/) in a test's own BATCHLLM_HOME: `batchllm` run as a user
runs it, in processes of its own, and what the tests read back: the engines' state files, their
processes, the jobs' rows and what a run said on stderr.

`KeptHome.stop_all()` ends every kept engine the home has, whatever the test left: `batchllm
engine stop --all --force` first, then SIGKILL by pid (only a process that is a kept engine of
this home: pids are reused), and it asserts nothing is left."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

from batchllm.settings import Settings
from tests.support import job_checks
from tests.support.cli import REPO, kill_group, local_env

T = TypeVar("T")

# A kept instant engine starts in 2-5 s; on a busy 2-core machine it has taken up to 30 s.
START_DEADLINE = 90.0
SERVER_MODULE = "batchllm.kept_engine.server"
_ENGINE_ID = re.compile(r"eng_[0-9a-f]{8}")


def wait_for(check: Callable[[], T | None], *, timeout: float, what: Callable[[], str] | str) -> T:
    """job_checks.wait_for, asked every 0.05 s: an engine's start and a run's steps are quick."""
    return job_checks.wait_for(check, timeout=timeout, what=what, interval=0.05)


def pid_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def write_prompts(path: Path, prefix: str, count: int) -> Path:
    """`count` prompt lines with the custom_ids `<prefix>-0` .. `<prefix>-<count - 1>`."""
    with path.open("w") as out:
        for i in range(count):
            line = {"custom_id": f"{prefix}-{i}", "prompt": f"{prefix} question number {i}"}
            out.write(json.dumps(line) + "\n")
    return path


def job_id_of(output: str) -> str:
    """The job id a `batchllm run` printed (`job job_...: N requests for ...`)."""
    found = re.search(r"\bjob (job_[0-9a-f]+)", output)
    assert found, f"no job id in the run's output:\n{output}"
    return found.group(1)


def engine_ids_started(stderr: str) -> list[str]:
    """The kept engines a run said it started, in order."""
    return re.findall(r"starting kept engine (eng_[0-9a-f]{8})", stderr)


def engine_ids_used(stderr: str) -> list[str]:
    """The kept engines a run said it found up and used."""
    return re.findall(r"using the kept engine (eng_[0-9a-f]{8})", stderr)


@dataclass
class Ran:
    """A finished `batchllm` process: its exit code and what it printed."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (
            f"`batchllm {' '.join(self.args)}` exited {self.returncode}\n"
            f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"
        )


@dataclass
class Running:
    """A `batchllm` process started in the background; its output goes to files."""

    args: tuple[str, ...]
    proc: subprocess.Popen
    out: Path
    err: Path

    def wait(self, timeout: float) -> Ran:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:.0f} s:\n{self.ran()}") from None
        return self.ran()

    def ran(self) -> Ran:
        code = self.proc.returncode if self.proc.returncode is not None else -999
        return Ran(
            self.args,
            code,
            self.out.read_text(errors="replace"),
            self.err.read_text(errors="replace"),
        )

    def end(self) -> None:
        """SIGKILL its process group if it still runs (a test that failed part-way)."""
        kill_group(self.proc)


@dataclass
class KeptHome:
    """A BATCHLLM_HOME of a test's, the environment of the `batchllm` processes run in it, and
    every kept engine pid seen in it (ended at teardown if still up)."""

    home: Path
    env: dict[str, str]
    logs: Path
    seen: dict[int, float] = field(default_factory=dict)  # pid -> its create time
    running: list[Running] = field(default_factory=list)

    @classmethod
    def of(cls, settings: Settings, logs: Path, **extra: str) -> KeptHome:
        logs.mkdir(parents=True, exist_ok=True)
        env = {**local_env(settings.home), "PYTHONUNBUFFERED": "1", **extra}
        env["BATCHLLM_KEEP_ALIVE"] = "0"  # as tests/conftest.py: only --keep-alive keeps one
        return cls(home=settings.home, env=env, logs=logs)

    @property
    def engines_dir(self) -> Path:
        return self.home / "engines"

    # -- batchllm ----------------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = 180) -> Ran:
        proc = subprocess.run(
            [sys.executable, "-m", "batchllm", *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        return Ran(tuple(args), proc.returncode, proc.stdout, proc.stderr)

    def start(self, *args: str) -> Running:
        """`batchllm ARGS` in the background, in a session of its own (as `setsid`): its pid
        leads its process group, which a terminal's Ctrl-C would reach."""
        name = f"{len(self.running)}-{args[0]}"
        out, err = self.logs / f"{name}.out", self.logs / f"{name}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "batchllm", *args],
                env=self.env,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        running = Running(tuple(args), proc, out, err)
        self.running.append(running)
        return running

    def status(self) -> list[dict[str, Any]]:
        """`batchllm engine status --json`."""
        ran = self.cli("engine", "status", "--json")
        assert ran.returncode == 0, str(ran)
        return json.loads(ran.stdout)

    # -- the state files ---------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """The state files as written (the dead engines' too); their pids are remembered."""
        found = []
        for path in (
            sorted(self.engines_dir.glob("eng_*.json")) if self.engines_dir.exists() else []
        ):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # removed as it was read
            found.append(record)
            self.remember(record.get("pid", 0))
        return found

    def record(self, engine_id: str) -> dict[str, Any] | None:
        return next((r for r in self.records() if r["id"] == engine_id), None)

    def ready(self) -> list[dict[str, Any]]:
        """The ready engines whose process runs."""
        return [r for r in self.records() if r["state"] == "ready" and pid_alive(r["pid"])]

    def wait_ready(self, engine_id: str, timeout: float = START_DEADLINE) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            record = self.record(engine_id)
            return record if record and record["state"] == "ready" else None

        return wait_for(
            ready, timeout=timeout, what=lambda: f"{engine_id} ready\n{self.tail(engine_id)}"
        )

    def remember(self, pid: int) -> None:
        if pid and pid not in self.seen:
            try:
                self.seen[pid] = psutil.Process(pid).create_time()
            except psutil.Error:
                pass

    def leftovers(self) -> list[Path]:
        """State files and sockets left in the engines folder."""
        if not self.engines_dir.exists():
            return []
        return sorted(
            p
            for p in self.engines_dir.iterdir()
            if p.suffix in (".json", ".sock") or ".tmp" in p.name
        )

    def tail(self, engine_id: str, lines: int = 30) -> str:
        path = self.engines_dir / f"{engine_id}.log"
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log {path})"
        return f"--- {path.name} (tail) ---\n" + "\n".join(text)

    # -- teardown ----------------------------------------------------------------------------

    def _engines_of_this_home(self) -> dict[int, psutil.Process]:
        """The live kept engine processes of this home among the pids seen or in state files."""
        self.records()
        found = {}
        for pid, created in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if (
                    abs(proc.create_time() - created) > 0.01
                    or proc.status() == psutil.STATUS_ZOMBIE
                ):
                    continue
                cmdline = proc.cmdline()
            except psutil.Error:
                continue
            if SERVER_MODULE in cmdline and str(self.home) in proc.environ().get(
                "BATCHLLM_HOME", ""
            ):
                found[pid] = proc
        return found

    def stop_all(self) -> None:
        """End every kept engine of this home; assert none is left, nor its files."""
        for running in self.running:
            running.end()
        stopped = self.cli("engine", "stop", "--all", "--force", timeout=180)
        left = self._engines_of_this_home()
        # A vLLM engine's EngineCore is a child process of the kept engine's: it goes too.
        children = {c.pid: c for proc in left.values() for c in _children(proc)}
        for proc in [*left.values(), *children.values()]:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        wait_for(
            lambda: not any(pid_alive(pid) for pid in [*left, *children]),
            timeout=30,
            what=f"the SIGKILLed kept engines {sorted(left)} to go",
        )
        if left:  # their state files name dead pids now: `engine status` forgets them
            self.cli("engine", "status")
        assert stopped.returncode == 0, str(stopped)
        assert not left, f"`engine stop --all --force` left kept engines running: {sorted(left)}"
        assert not self.leftovers(), f"left in {self.engines_dir}: {self.leftovers()}"


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def engine_id_in(text: str) -> str:
    found = _ENGINE_ID.search(text)
    assert found, f"no engine id in:\n{text}"
    return found.group(0)
