"""A cold `run`'s engine process started by the console script itself, before the CLI is
imported: the process that becomes the run's kept engine (kept_engine/client.Spare) starts
importing vLLM ~0.8 s sooner than the run could start it (after its own imports, its options
and its input). Importing vLLM is most of a cold start (5-7 s of ~10 here, issue 63), and it
runs on the other core while the run validates and sizes the file.

Started only when the run would start a spare itself: `run` with the vLLM engine, a keep-alive
other than 0, and no kept engine of this home up or starting (one may serve the run). It
learns everything from its stdin (kept_engine/server.py, --config-on-stdin): the run writes the
engine's config there when it adopts it as its spare, and the run's end (or a run that never
adopts it: a refused file, a usage error) closes that pipe, which ends it at once.

The standard library only, as handoff.py: the console script imports it first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from batchllm.kept_engine.handoff import home_engines_dir

CONFIG_ON_STDIN = "--config-on-stdin"
EARLY_LOG_PREFIX = "early-"  # HOME/engines/early-<pid>.log until it is adopted
_ZERO_UNITS = "smh"
_started: subprocess.Popen[bytes] | None = None


def _option(argv: list[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in argv (the last one given), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _is_zero(duration: str) -> bool | None:
    """Whether a keep-alive duration is 0 (None when it does not parse: then no early start)."""
    try:
        return float(duration.strip().rstrip(_ZERO_UNITS) or "x") == 0
    except ValueError:
        return None


def wanted(argv: list[str], engines: Path) -> bool:
    """Whether this `run` would start a spare engine process (see the module's docstring);
    anything unsure is a no: the run starts its spare itself, as before."""
    if any(arg in ("--help", "-h", "--dry-run") for arg in argv):
        return False
    if _option(argv, "--engine") not in (None, "vllm"):
        return False
    keep_alive = _option(argv, "--keep-alive") or os.environ.get("BATCHLLM_KEEP_ALIVE") or "5m"
    if _is_zero(keep_alive) is not False:
        return False
    try:
        return not any(engines.glob("eng_*.json"))  # one up or starting may serve this run
    except OSError:
        return False


def start(argv: list[str]) -> None:
    """Start the early engine process for this `run` when it is wanted."""
    global _started
    engines = home_engines_dir()
    if not wanted(argv, engines):
        return
    try:
        engines.mkdir(parents=True, exist_ok=True, mode=0o700)
        log = engines / f"{EARLY_LOG_PREFIX}{os.getpid()}.log"
        with open(log, "ab") as out:
            _started = subprocess.Popen(
                [sys.executable, "-m", "batchllm.kept_engine.server", CONFIG_ON_STDIN, str(log)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C stops the run, not the engine
                close_fds=True,
            )
    except OSError:
        _started = None  # the run starts its spare itself


def take() -> subprocess.Popen[bytes] | None:
    """The early engine process, once: the run's spare adopts it (None when there is none or
    it has ended)."""
    global _started
    process, _started = _started, None
    if process is None or process.poll() is not None:
        return None
    return process
