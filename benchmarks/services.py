"""A private Redis and PostgreSQL for the fleet bench, on free ports from a temporary
directory, as the fault suite runs them (tests/faults/harness.py): the machine's own services
(6379, 5432) are never touched, and the bench can read their counters (INFO commandstats,
pg_stat_activity) without other users' traffic in them.

PostgreSQL keeps its default max_connections (100) unless told otherwise: whether a fleet
exhausts it is one of the things the bench measures.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed

HOST = "127.0.0.1"
_MACHINE_PORTS = frozenset({5432, 6379})
DATABASE = "batchllm_fleet"


def free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port not in _MACHINE_PORTS:
            return port


def _wait(check: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise BenchFailed(f"{what} did not come up within {timeout:.0f} s")


class PrivateRedis:
    """redis-server without persistence on a free port."""

    def __init__(self, work_dir: Path) -> None:
        self.port = free_port()
        self.work_dir = work_dir
        self.url = f"redis://{HOST}:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def client(self) -> Any:
        import redis

        return redis.Redis(host=HOST, port=self.port, socket_timeout=10)

    def start(self) -> None:
        if shutil.which("redis-server") is None:
            raise BenchFailed("the fleet part needs redis-server on PATH")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", ""]
            + ["--appendonly", "no", "--dir", str(self.work_dir)],
            stdout=(self.work_dir / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait(lambda: self.client().ping(), f"redis-server on port {self.port}")

    def commands(self) -> dict[str, int]:
        """Calls per command since the start (INFO commandstats), e.g. {"lpush": 40}."""
        stats = self.client().info("commandstats")
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def _postgres_bin() -> Path:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise BenchFailed("the fleet part needs PostgreSQL's server binaries (initdb, pg_ctl)")
    return Path(initdb).parent


class PrivatePostgres:
    """A throw-away cluster (initdb, trust auth) on a free port, run as `postgres` when we are
    root. Durable commits stay on (fsync, synchronous_commit): a commit costs what it would."""

    def __init__(self, *, max_connections: int = 100) -> None:
        self.bin_dir = _postgres_bin()
        self.port = free_port()
        self.max_connections = max_connections
        self.root = Path(tempfile.mkdtemp(prefix="batchllm-fleet-pg-"))
        self.data = self.root / "data"
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self.url = f"postgresql+psycopg://postgres@{HOST}:{self.port}/{DATABASE}"

    def _run(self, *argv: str) -> None:
        command = [str(self.bin_dir / argv[0]), *argv[1:]]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, cwd=self.root, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise BenchFailed(f"{argv[0]} failed: {done.stdout}\n{done.stderr}")

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\nlisten_addresses = '{HOST}'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.root}'\n"
                f"max_connections = {self.max_connections}\n"
            )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "pg.log"), "-w", "start")
        with self.connect(dbname="postgres") as conn:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')

    @property
    def pid(self) -> int | None:
        """The postmaster's pid (its backends are its children)."""
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            return None

    def connect(self, dbname: str = DATABASE) -> Any:
        import psycopg

        return psycopg.connect(
            host=HOST, port=self.port, user="postgres", dbname=dbname, autocommit=True
        )

    def connections(self) -> int:
        """Client connections open to the bench's database now (pg_stat_activity)."""
        with self.connect() as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> "
                "pg_backend_pid()",
                (DATABASE,),
            ).fetchone()
        return int(row[0]) if row else 0

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
