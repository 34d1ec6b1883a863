"""Where a user's kept engines are found: one state file per engine under HOME/engines (what it
serves, its process, its socket, whether it is ready), and the lock that lets one of two runs
starting at once start the engine while the other waits for it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchllm.errors import BatchLLMError
from batchllm.kept_engine.handoff import RUNNER_PREFIX

log = logging.getLogger(__name__)

STARTING, READY, FAILED = "starting", "ready", "failed"
# AF_UNIX paths are at most 107 bytes on Linux; a longer home gets its sockets elsewhere.
_SOCKET_PATH_MAX = 100


@dataclass
class EngineRecord:
    """One kept engine, as its state file says."""

    id: str
    key: str  # model and engine settings, without the context length (a longer one serves)
    model: str
    kind: str  # "vllm", or "instant" (the simulation engine)
    pid: int
    uid: int
    socket: str
    state: str = STARTING
    max_model_len: int | None = None  # while starting: what it is being built with (-1: auto)
    keep_alive: float = 300.0  # seconds; math.inf is written as -1
    started_at: float = 0.0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def fits(self, max_model_len: int) -> bool:
        """Whether rows of a job that needs `max_model_len` fit this engine's context (unknown
        while an auto-sized engine starts: it is checked again once it is ready)."""
        return (
            self.max_model_len is None
            or self.max_model_len < 0
            or (self.max_model_len >= max_model_len)
        )


def engines_dir(home: Path) -> Path:
    folder = home / "engines"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def new_engine_id() -> str:
    return "eng_" + secrets.token_hex(4)


def socket_path(home: Path, engine_id: str) -> str:
    """The engine's socket: beside its state file, or under a private folder in the temporary
    directory when the home's path is too long for a Unix socket."""
    path = engines_dir(home) / f"{engine_id}.sock"
    if len(str(path)) <= _SOCKET_PATH_MAX:
        return str(path)
    private = Path(tempfile.gettempdir()) / f"batchllm-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    check_owned(private)
    return str(private / f"{engine_id}.sock")


def runner_files(home: Path, engine_id: str) -> tuple[Path, str]:
    """The state file and socket of the engine's warm runner (kept_engine/warm_runner.py)."""
    name = RUNNER_PREFIX + engine_id
    return engines_dir(home) / f"{name}.json", socket_path(home, name)


def check_owned(path: Path | str) -> None:
    """Refuse a socket or folder of another user: a kept engine serves its own user alone."""
    owner = os.stat(path).st_uid
    if owner != os.getuid():
        raise BatchLLMError(
            f"{path} belongs to user id {owner}, not to you (user id {os.getuid()}): a kept "
            "engine serves only the user who started it; set BATCHLLM_HOME to a folder of yours"
        )


def state_path(home: Path, engine_id: str) -> Path:
    return engines_dir(home) / f"{engine_id}.json"


def write_record(home: Path, record: EngineRecord) -> None:
    """Write the state file whole (a reader never sees half of it)."""
    target = state_path(home, record.id)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    data = asdict(record)
    if data["keep_alive"] == float("inf"):
        data["keep_alive"] = -1
    tmp.write_text(json.dumps(data))
    os.replace(tmp, target)


def remove_record(home: Path, engine_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        state_path(home, engine_id).unlink()


def read_record(path: Path) -> EngineRecord | None:
    try:
        data = json.loads(path.read_text())
        if data.get("keep_alive", 0) < 0:
            data["keep_alive"] = float("inf")
        return EngineRecord(**data)
    except (OSError, ValueError, TypeError):
        return None  # removed meanwhile, or half-written by an older batchllm


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_records(home: Path) -> list[EngineRecord]:
    """The kept engines whose process is alive; state files of dead ones are removed (a kept
    engine killed with SIGKILL cannot remove its own)."""
    records = []
    for path in sorted(engines_dir(home).glob("eng_*.json")):
        record = read_record(path)
        if record is None:
            continue
        if not alive(record.pid):
            log.info("kept engine %s (pid %d) is gone; forgetting it", record.id, record.pid)
            remove_record(home, record.id)
            with contextlib.suppress(FileNotFoundError):
                if record.socket and Path(record.socket).exists():
                    os.unlink(record.socket)
            for leftover in runner_files(home, record.id):  # its runner ends with it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            continue
        records.append(record)
    return records


def find(home: Path, id_or_prefix: str) -> EngineRecord:
    matches = [r for r in list_records(home) if r.id.startswith(id_or_prefix)]
    if len(matches) != 1:
        known = ", ".join(r.id for r in list_records(home)) or "none"
        what = "no kept engine" if not matches else "more than one kept engine"
        raise BatchLLMError(f"{what} matches {id_or_prefix!r} (kept engines: {known})")
    return matches[0]


@contextlib.contextmanager
def start_lock(home: Path) -> Iterator[None]:
    """Held while a run looks for an engine and starts one: two runs at once start one."""
    with open(engines_dir(home) / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
