"""The `batchllm` console script (and `python -m batchllm`): a `run` goes to a warm runner when
one of this checkout is up (kept_engine/handoff.py), anything else to the CLI in this process;
a cold `run` starts its engine's process first (kept_engine/early.py). Only the standard
library is imported before that.

A command that ends (returns or exits) leaves the process at once, after what Python's own exit
does that has an effect (the program's threads joined, the atexit handlers run, the standard
streams flushed), skipping the teardown of every imported module: 0.3-0.4 s of a run's exit
here (the modules of pyarrow, SQLAlchemy, pydantic and batchllm freed one by one, then a last
collection over all of them). An exception other than SystemExit leaves the usual way, with its
traceback."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


def main() -> None:
    from batchllm.kept_engine.handoff import hand_off, is_handed_command

    code = hand_off(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    if is_handed_command(sys.argv[1:]):  # a cold `run`: its engine process starts now
        from batchllm.kept_engine import early

        early.start(sys.argv[1:])
    from batchllm.cli import main as cli_main

    try:
        cli_main()
        code = 0
    except SystemExit as exc:
        code = exit_status(exc)
    exit_now(code)


def exit_status(exc: SystemExit) -> int:
    """The process's exit status for a SystemExit, as Python's own exit gives it (a message
    is printed to stderr, with status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def exit_now(code: int) -> None:
    """Python's exit without the teardown of its modules: wait for the program's non-daemon
    threads (and the executors that join at exit), run the atexit handlers, flush the
    standard streams, and end the process with `code`."""
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
