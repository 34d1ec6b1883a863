"""A private Redis on a free port, from a temporary directory: `batchllm bench --parts
prefix-fleet` runs its two workers on one (the product's bench needs it), and so do the
developers' benchmarks and the fault suite, whose counters must hold no other users' traffic
and which stop and start it under their workers. The machine's own Redis (6379) is never
touched, and the process started here is ended by PID, never by name. The private PostgreSQL,
which only the developers' benchmarks and tests start, is benchmarks/private_postgres.py.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchllm.process.ports import HOST, free_port


class ServiceFailed(RuntimeError):
    """A private service did not start or stop as asked."""


def tail(path: Path, lines: int = 60) -> str:
    """The last lines of a log, for a failure's message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def wait_until(answers: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not answers():
        if time.monotonic() > deadline:
            raise ServiceFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


# -- Redis ---------------------------------------------------------------------------------


class RedisServer:
    """`redis-server` on a free port, without persistence: a restart loses every queued and
    unacknowledged task (the fault the fault suite wants)."""

    def __init__(self, *, work_dir: Path) -> None:
        self.port = free_port()
        self.work_dir = work_dir
        self.log_path = work_dir / "redis.log"
        self.url = f"redis://{HOST}:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def client(self) -> Any:
        import redis

        return redis.Redis(host=HOST, port=self.port, socket_connect_timeout=2, socket_timeout=10)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30) -> None:
        if self.running():
            raise ServiceFailed("redis-server is already running")
        if shutil.which("redis-server") is None:
            raise ServiceFailed("redis-server is not on PATH")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            proc = self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", ""]
                + ["--appendonly", "no", "--daemonize", "no", "--dir", str(self.work_dir)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def answers() -> bool:
            if proc.poll() is not None:
                raise ServiceFailed(
                    f"redis-server exited with {proc.returncode}:\n" + tail(self.log_path)
                )
            try:
                return bool(self.client().ping())
            except Exception:
                return False

        wait_until(answers, timeout=timeout, what=f"redis-server on port {self.port}")

    def commands(self) -> dict[str, int]:
        """Calls per command since the start (INFO commandstats), e.g. {"lpush": 40}."""
        stats = self.client().info("commandstats")
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}

    def stop(self) -> None:
        """`SHUTDOWN NOSAVE`, then SIGTERM and SIGKILL to our PID if it does not go."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        if shutil.which("redis-cli") is not None:
            subprocess.run(
                ["redis-cli", "-h", HOST, "-p", str(self.port), "shutdown", "nosave"],
                capture_output=True,
                timeout=15,
            )
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                proc.send_signal(sig)
            try:
                proc.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                continue

    def restart(self) -> float:
        """Stop (losing everything in it) and start again on the same port; returns the time
        the stop began (time.monotonic)."""
        began = time.monotonic()
        self.stop()
        self.start()
        return began
