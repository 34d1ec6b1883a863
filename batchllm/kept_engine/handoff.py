"""A `batchllm run` handed to a warm runner (kept_engine/warm_runner.py): the console script
starts with this module alone (the standard library and nothing else), finds a warm runner of
the same Python and the same batchllm, and hands it the command line, the working directory, the
environment and the terminal (file descriptors 0-2, over the Unix socket). The runner forks a
child that has batchllm, pyarrow and SQLAlchemy imported already; the child runs the command as
this process would have, and this process forwards its signals (Ctrl-C, SIGTERM, SIGHUP) and
exits with the child's code.

Why: a warm run of one question spent about 1 s of its 2 s importing and warming the Python it
needs before it sent the engine a request (issue 63). Nothing about the job changes: the child
runs the same code with the caller's environment, directory and terminal, and reaches the kept
engine over its socket as any run does.

Where none matches (no kept engine, another checkout or Python, edited code, or
BATCHLLM_WARM_RUNS=false), the command runs in this process as before. A handoff is all or
nothing: once the runner has taken the request it owns the run; if this process is killed, the
child is killed too, as a run in this process would have died with it."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from batchllm.kept_engine import wire

RUNNER_PREFIX = "runner-"  # HOME/engines/runner-<engine id>.json names its socket
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_OFF = ("0", "false", "f", "no", "n", "off")  # as pydantic reads a bool
_CONNECT_WAIT = 2.0  # seconds: a runner accepts at once, or it is stopping


def code_stamp(package: Path) -> list[int]:
    """How many .py files batchllm has and the newest one's mtime: an edited checkout no longer
    matches the runner that imported the old one (4 ms for the package's ~220 files)."""
    count, newest, folders = 0, 0, [str(package)]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        folders.append(entry.path)
                elif entry.name.endswith(".py"):
                    count += 1
                    newest = max(newest, entry.stat().st_mtime_ns)
    return [count, newest]


def fingerprint() -> dict[str, Any]:
    """What a warm runner must share with the command to run it: the interpreter, the batchllm
    checkout and its code, and the import path."""
    package = Path(__file__).resolve().parent.parent
    return {
        "prefix": sys.prefix,  # the venv: one interpreter serves many, with other packages
        "executable": os.path.realpath(sys.executable),
        "package": str(package),
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "stamp": code_stamp(package),
    }


def home_engines_dir() -> Path:
    """HOME/engines as settings.py resolves the home from the environment. A home set only in
    a .env file is not seen here: then no runner is found and the command runs in this
    process, which reads the .env as always."""
    return Path(os.environ.get("BATCHLLM_HOME") or "~/.batchllm").expanduser() / "engines"


def is_handed_command(argv: list[str]) -> bool:
    """`run` (after -v/-vv/--verbose, the group's only option besides --version and --help)."""
    for arg in argv:
        if arg in ("-v", "-vv", "-vvv", "--verbose"):
            continue
        return arg == "run"
    return False


def _connect(engines: Path) -> socket.socket | None:
    """A connection to a live warm runner whose fingerprint matches this process's, or None."""
    try:
        candidates = sorted(engines.glob(RUNNER_PREFIX + "*.json"))
    except OSError:
        return None
    if not candidates:
        return None
    mine = fingerprint()
    for path in candidates:
        try:
            data = json.loads(path.read_text())
            theirs = data["fingerprint"]
            address = data["socket"]
            if theirs != mine or os.stat(address).st_uid != os.getuid():
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # removed meanwhile, half-written, or of another user
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_CONNECT_WAIT)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            continue
        sock.settimeout(None)
        return sock
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def hand_off(argv: list[str]) -> int | None:
    """Run `batchllm ARGV` in a warm runner and return its exit code; None when there is no
    warm runner for it (the caller then runs the command itself)."""
    if os.environ.get("BATCHLLM_WARM_RUNS", "").strip().lower() in _OFF:
        return None
    if not is_handed_command(argv):
        return None
    sock = _connect(home_engines_dir())
    if sock is None:
        return None
    with sock:
        request = {
            "argv": argv,
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "umask": _umask(),
            "open_files": resource.getrlimit(resource.RLIMIT_NOFILE)[0],  # `ulimit -n`
            "encodings": [getattr(s, "encoding", None) for s in (sys.stdin, sys.stdout)],
        }
        try:
            socket.send_fds(sock, [b"R"], [0, 1, 2])
            wire.send(sock, request)
            started = wire.receive(sock)
        except (OSError, wire.ConnectionClosed):
            started = None
        if started is None:  # the runner refused or ended before its child started
            return None
        return _follow(sock, started["pid"])


def _follow(sock: socket.socket, child: int) -> int:
    """Forward this process's signals to the child until it says its exit code."""

    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    try:
        ended = wire.receive(sock)
    except (OSError, wire.ConnectionClosed):
        ended = None
    if ended is None:  # the child died before it could say how (killed, or a crash)
        print(
            f"error: the run (pid {child} of the warm runner) ended without an exit code",
            file=sys.stderr,
        )
        return 1
    return int(ended["exit"])
