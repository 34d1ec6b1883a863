"""The abuse suite's server: a real `batchllm serve` process on a free port, with a private
BATCHLLM_HOME (SQLite), a private TMPDIR (whose bytes the upload tests measure) and the
in-memory broker (a batch is recorded and "dispatched" to nowhere: no Redis, no worker, so a
batch stays in progress until its window passes). Its limits are set small so that abuse is
cheap to send; the module shares one server, each test has its own API keys (tenants).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from batchllm.api import keys
from batchllm.settings import Settings
from batchllm.store.db import session_scope
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
MAX_FILE_BYTES = 2 * 1024 * 1024
MAX_STORED_BYTES = 5 * 1024 * 1024
MAX_ACTIVE_BATCHES = 3
HEADER_TIMEOUT = 4.0
RECONCILE_SECONDS = 1.0


@dataclass
class Served:
    """A running `batchllm serve` and what the tests need of it."""

    proc: subprocess.Popen
    port: int
    settings: Settings  # the same database and storage, for keys and direct checks
    tmpdir: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def new_key(self, name: str = "tenant") -> dict[str, str]:
        """The Authorization header of a fresh key: a tenant of its own."""
        with session_scope(self.settings) as session:
            _, key = keys.create_key(session, name)
        return {"Authorization": f"Bearer {key}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


def start_serve(work: Path, *args: str, **env_extra: str) -> Served:
    home, tmpdir = work / "home", work / "tmp"
    tmpdir.mkdir(parents=True)
    env = {
        **os.environ,
        "BATCHLLM_HOME": str(home),
        "BATCHLLM_BROKER_URL": "memory://",
        "BATCHLLM_API_MAX_FILE_BYTES": str(MAX_FILE_BYTES),
        "BATCHLLM_API_MAX_STORED_BYTES": str(MAX_STORED_BYTES),
        "BATCHLLM_API_MAX_ACTIVE_BATCHES": str(MAX_ACTIVE_BATCHES),
        "BATCHLLM_API_HEADER_TIMEOUT": str(HEADER_TIMEOUT),
        "BATCHLLM_RECONCILE_SECONDS": str(RECONCILE_SECONDS),
        "TMPDIR": str(tmpdir),
        **env_extra,
    }
    for name in ("BATCHLLM_DATABASE_URL", "BATCHLLM_STORAGE"):
        env.pop(name, None)
    port = free_port()
    log_path = work / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchllm", "serve", "--host", HOST, "--port", str(port), *args],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    settings = Settings(home=home, database_url=None, storage=None, broker_url="memory://")
    served = Served(proc, port, settings, tmpdir, log_path)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n{served.log()}")
        try:
            if httpx.get(f"{served.base_url}/health", timeout=2).status_code == 200:
                return served
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_serve(served)
            raise AssertionError(f"serve not up after 60 s:\n{served.log()}")
        time.sleep(0.2)


def stop_serve(served: Served) -> None:
    if served.proc.poll() is None:
        served.proc.terminate()
        try:
            served.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(served.proc.pid, signal.SIGKILL)  # its own group: only what it started
            except ProcessLookupError:
                pass
            served.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_serve(tmp_path_factory.mktemp("serve"))
    try:
        yield served
    finally:
        stop_serve(served)
