"""A warm runner: `python -m batchllm.warm_runner CONFIG_JSON`, started by a kept
engine's process once its first run has ended (so it never competes with a cold run for the
cores). It imports and warms what `batchllm run` needs (the CLI, pyarrow, SQLAlchemy, the job
and output layers), then forks a child for each run handed to it (kept_engine/handoff.py); the
child takes the caller's terminal, directory and environment and runs the command there.

It holds no job, no database connection and no engine: each child opens its own, as a run in
its own process does. It ends with its kept engine (SIGTERM from it, or its parent gone), and
leaves its children, which are users' runs, to finish."""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from batchllm.kept_engine import wire
from batchllm.kept_engine.handoff import fingerprint
from batchllm.kept_engine.wire import peer_uid
from batchllm.launcher import exit_now, exit_status

log = logging.getLogger("batchllm.warm_runner")

_ACCEPT_WAIT = 1.0  # how often a stop and the parent's death are checked


def warm_up() -> None:
    """Import what a run imports after the CLI's choice, and do the first-call work pyarrow
    defers (its first array of Python objects imports pandas: 0.17-0.19 s here)."""
    import pyarrow as pa
    import pyarrow.compute
    import pyarrow.parquet
    import sqlalchemy.dialects.sqlite  # noqa: F401

    import batchllm.cli
    import batchllm.cli.console
    import batchllm.cli.progress
    import batchllm.cli.render
    import batchllm.client
    import batchllm.jobs.local
    import batchllm.kept_engine.client
    import batchllm.output.export
    import batchllm.process.stopping  # noqa: F401

    pa.array([1, None]).to_pylist()
    pa.array(["warm"]).to_pylist()


def _stdio(encodings: list[str | None]) -> None:
    """Python's stdin/stdout/stderr over the caller's descriptors, buffered as Python would
    have set them up in the caller's process (line-buffered on a terminal)."""
    stdin_encoding, stdout_encoding = (e or "utf-8" for e in encodings)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=stdin_encoding)
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False),
        encoding=stdout_encoding,
        line_buffering=os.isatty(1),
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        encoding=stdout_encoding,
        errors="backslashreplace",
        line_buffering=True,
    )


def _take_request(conn: socket.socket) -> dict[str, Any]:
    """The caller's descriptors onto 0-2 and its directory, environment and umask here."""
    _, fds, _, _ = socket.recv_fds(conn, 16, 3)
    request = wire.receive(conn)
    if len(fds) != 3:
        raise ConnectionError("the caller left before its request was read")
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    _stdio(request["encodings"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.umask(request["umask"])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = request["open_files"]
    if hard != resource.RLIM_INFINITY and (wanted == resource.RLIM_INFINITY or wanted > hard):
        wanted = hard  # the caller's soft limit, as far as the runner's hard limit allows
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return request


def _reset_process_state() -> None:
    """What the runner set for itself, back to what a fresh `batchllm` process has."""
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    from batchllm.settings import get_settings

    get_settings.cache_clear()  # settings come from the caller's environment and .env


def _watch_caller(conn: socket.socket, done: threading.Event) -> None:
    """The caller gone before the run ended: end the run as it would have ended with it."""
    with contextlib.suppress(OSError):
        while conn.recv(1):
            pass
    if not done.is_set():
        os.kill(os.getpid(), signal.SIGKILL)


def _run_child(conn: socket.socket) -> None:
    """In the forked child: run the caller's command and tell the caller its exit code."""
    exit_code = [1]
    done = threading.Event()
    try:
        request = _take_request(conn)
        _reset_process_state()
    except BaseException:  # the caller is gone or sent nonsense: nothing was started
        os._exit(1)

    def say_exit() -> None:  # registered first, so it runs after every other exit handler
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        done.set()
        with contextlib.suppress(OSError):
            wire.send(conn, {"exit": exit_code[0]})

    atexit.register(say_exit)
    wire.send(conn, {"pid": os.getpid()})
    threading.Thread(target=_watch_caller, args=(conn, done), daemon=True).start()
    sys.argv = ["batchllm", *request["argv"]]
    try:
        from batchllm.cli import main

        main()
        exit_code[0] = 0
    except SystemExit as exc:
        exit_code[0] = exit_status(exc)
    except BaseException:
        traceback.print_exc()
        exit_code[0] = 1
    exit_now(exit_code[0])  # a SystemExit would unwind through the runner's frames


def serve(listener: socket.socket, parent: int, stopping: threading.Event) -> None:
    """Fork a child per connection until stopped or the kept engine's process is gone."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    listener.settimeout(_ACCEPT_WAIT)
    while not stopping.is_set() and os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except InterruptedError:
            continue
        conn.settimeout(None)
        if peer_uid(conn) != os.getuid():  # the folder is the user's alone; this says so again
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            _run_child(conn)  # never returns
        conn.close()
        log.info("run handed over: child %d", pid)


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = json.loads(argv[1])
    socket_path, state_path = config["socket"], Path(config["state"])
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    started = time.monotonic()
    warm_up()
    gc.freeze()  # the children share the imported objects' pages instead of copying them
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        old_umask = os.umask(0o077)  # the socket is its user's alone
        try:
            listener.bind(socket_path)
        finally:
            os.umask(old_umask)
        listener.listen(16)
        tmp = state_path.with_suffix(f".tmp{os.getpid()}")
        state = {"socket": socket_path, "pid": os.getpid(), "fingerprint": fingerprint()}
        tmp.write_text(json.dumps(state))
        os.replace(tmp, state_path)  # a launcher finds it only once it can serve
        log.info("warm runner ready in %.1f s: %s", time.monotonic() - started, socket_path)
        serve(listener, config["parent"], stopping)
    finally:
        listener.close()
        for path in (state_path, Path(socket_path)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        log.info("warm runner stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
