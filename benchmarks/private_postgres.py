"""A private PostgreSQL cluster on a free port, from a temporary directory, for the developers'
benchmarks (their counters, pg_stat_activity, hold no other users' traffic) and the fault suite
(tests/support/faults.py), which stops and starts it under its workers. The machine's own
PostgreSQL (5432) is never touched, and the processes started here are ended by PID, never by
name. batchllm itself never starts one: this lives beside the benchmarks, not in the package
(tests import benchmarks/, never the other way round).

PostgreSQL keeps its default max_connections (100) and durable commits unless told otherwise:
whether a fleet exhausts its connections, and what a commit costs, are things the benchmarks
measure.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchllm.process.ports import HOST, free_port
from batchllm.process.services import ServiceFailed, tail

BENCH_DATABASE = "batchllm_fleet"


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's server binaries (initdb, pg_ctl), or None."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresCluster:
    """A throw-away cluster (initdb) on a free port of 127.0.0.1, trust auth, with one
    database, run as the `postgres` user when we are root (PostgreSQL refuses to run as root).
    `initdb_options` and `settings` (postgresql.conf's) are a user's own: the fault suite's
    cluster trades durability for speed."""

    def __init__(
        self,
        *,
        database: str = BENCH_DATABASE,
        bin_dir: Path | None = None,
        max_connections: int = 100,
        initdb_options: tuple[str, ...] = (),
        settings: Mapping[str, str] | None = None,
    ) -> None:
        found = bin_dir or postgres_bin()
        if found is None:
            raise ServiceFailed("needs PostgreSQL's server binaries (initdb, pg_ctl)")
        self.bin_dir = found
        self.database = database
        self.port = free_port()
        self.max_connections = max_connections
        self.initdb_options = initdb_options
        self.settings = dict(settings or {})
        # Not under pytest's tmp_path: that is private to root, and the server runs as postgres.
        self.root = Path(tempfile.mkdtemp(prefix=f"{database.replace('_', '-')}-pg-"))
        self.data = self.root / "data"
        self.log_path = self.root / "postgres.log"
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self.url = f"postgresql+psycopg://postgres@{HOST}:{self.port}/{database}"

    @classmethod
    def disposable(cls, *, database: str, bin_dir: Path | None = None) -> PostgresCluster:
        """A cluster for faults: commits need survive batchllm's processes, not the machine
        (an outage is a clean stop), so nothing waits for the disk; a backend whose client was
        killed -9 notices within a second even while it waits, and drops its locks, as it
        would on a real network."""
        return cls(
            database=database,
            bin_dir=bin_dir,
            max_connections=200,
            initdb_options=("--locale=C", "--no-sync"),
            settings={
                "fsync": "off",
                "synchronous_commit": "off",
                "full_page_writes": "off",
                "client_connection_check_interval": "'1s'",
            },
        )

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        command = [str(self.bin_dir / argv[0]), *argv[1:]]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(
            command, cwd=self.root, capture_output=True, text=True, timeout=timeout
        )
        if result.returncode != 0:
            raise ServiceFailed(
                f"{' '.join(argv)} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}\n" + tail(self.log_path)
            )
        return result

    def init(self) -> None:
        self._run(
            "initdb",
            *("-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8"),
            *self.initdb_options,
        )
        settings = {
            "listen_addresses": f"'{HOST}'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            "max_connections": str(self.max_connections),
            **self.settings,
        }
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("\n" + "".join(f"{name} = {value}\n" for name, value in settings.items()))

    def start(self) -> None:
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-w", "-t", "60", "start"
        )

    def create_database(self) -> None:
        with self.connect(dbname="postgres") as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')

    def start_new(self) -> None:
        """initdb, start, and create the database: an empty cluster for batchllm's migrations."""
        self.init()
        self.start()
        self.create_database()

    @property
    def pid(self) -> int | None:
        """The postmaster's pid (its backends are its children)."""
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.pid
        if pid is None:
            return False
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip() == "postgres"
        except OSError:
            return False

    def connect(self, dbname: str | None = None) -> Any:
        """A plain psycopg connection (autocommit), to the cluster's database by default."""
        import psycopg

        return psycopg.connect(
            host=HOST,
            port=self.port,
            user="postgres",
            dbname=dbname or self.database,
            autocommit=True,
            connect_timeout=5,
        )

    def connections(self) -> int:
        """Client connections open to the database now (pg_stat_activity), this one aside."""
        with self.connect() as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> "
                "pg_backend_pid()",
                (self.database,),
            ).fetchone()
        return int(row[0]) if row else 0

    def stop(self) -> None:
        """`pg_ctl stop -m fast`: the server ends every session and stops."""
        if self.running():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def destroy(self) -> None:
        """Stop the server (SIGQUIT to the postmaster when pg_ctl cannot) and delete the
        cluster."""
        try:
            self.stop()
        except Exception:
            pid = self.pid
            if pid:
                try:
                    os.kill(pid, signal.SIGQUIT)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.root, ignore_errors=True)
