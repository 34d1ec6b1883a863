"""A quiet console for commands that start an engine: the terminal shows batchllm's own lines
(what is happening, progress, the result); vLLM's output, the engine processes' output and the
interpreter's warnings go to a log file named on the console.

Engine processes write to the file descriptors they inherit, so the redirect happens at the
descriptor level: fds 1 and 2 point at the log file, and batchllm's console lines go to copies
of the original descriptors (sys.stdout / sys.stderr are rebound to them). With `-v` nothing is
redirected and everything shows, as before.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

_ACTIVE: Path | None = None


def active_log() -> Path | None:
    """The log file of the current quiet command, if any (named again when it fails)."""
    return _ACTIVE


def own_warnings(record: logging.LogRecord) -> bool:
    """`run`'s console: batchllm's warnings and errors only (it prints its progress itself)."""
    return _is_batchllm(record) and record.levelno >= logging.WARNING


def worker_lines(record: logging.LogRecord) -> bool:
    """`worker`'s console: batchllm's lines (engine builds, resumes, hand-backs, finished jobs)
    and Celery's own (connected, `NODE ready.`, task received/succeeded/failed with its
    traceback, broker connection lost): together they say what the worker is doing, and
    supervisors and tests wait for the ready line. Not `celery.redirected`: that is stray
    print() output of libraries (vLLM's among them) that Celery turns into log lines."""
    if _is_batchllm(record):
        return True
    return record.name.split(".")[0] == "celery" and record.name != "celery.redirected"


def _is_batchllm(record: logging.LogRecord) -> bool:
    return record.name.split(".")[0] == "batchllm"


def quiet(
    log_dir: Path,
    name: str,
    *,
    shows: Callable[[logging.LogRecord], bool] = own_warnings,
    console_format: str = "%(levelname)s: %(message)s",
) -> Path | None:
    """Send everything but the log records that SHOWS accepts to LOG_DIR/NAME-<time>-<pid>.log
    (they go there too); returns its path. None, and nothing changed, when the console is not
    a pair of real file descriptors (e.g. click's test runner)."""
    global _ACTIVE
    try:
        sys.stdout.fileno()
        sys.stderr.fileno()
    except (AttributeError, io.UnsupportedOperation, ValueError):
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    console_out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    console_err = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout, sys.stderr = console_out, console_err
    # vLLM's own handler (here and in its engine processes, which inherit the environment)
    # writes to the original stderr, fd 2: the log file, with its process tags, at
    # VLLM_LOGGING_LEVEL. Its default, sys.stdout, would be the console copy above.
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.__stderr__"
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    to_file = logging.StreamHandler(
        io.TextIOWrapper(os.fdopen(os.dup(2), "wb"), line_buffering=True)
    )
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_console = logging.StreamHandler(console_err)
    to_console.addFilter(shows)
    to_console.setFormatter(logging.Formatter(console_format))
    root.addHandler(to_file)
    root.addHandler(to_console)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings.warn(...) -> the `py.warnings` logger -> the file
    _ACTIVE = path
    return path


def quiet_unless_verbose(name: str) -> None:
    """For a command that runs vLLM in this process (`run`, `pipeline run`): without -v, its
    output goes to $BATCHLLM_HOME/logs/NAME-<time>-<pid>.log, said on the first line."""
    import click

    if click.get_current_context().find_root().params.get("verbose"):
        return
    from batchllm.settings import get_settings

    log = quiet(get_settings().home / "logs", name)
    if log is not None:
        click.echo(f"vLLM's output goes to {log} (-v shows it here)", err=True)
