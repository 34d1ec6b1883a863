"""What an engine writes while it is built goes where vLLM's logging goes, even with the engine
core in the owning process.

A quiet command (cli/console.quiet: `run` without -v, a worker) points fd 1 and 2 at its log
file and keeps sys.stdout/sys.stderr as copies of the console for its own lines. An EngineCore
process wrote its progress bars ("Loading safetensors checkpoint shards", tqdm's, written to
sys.stderr) to the log through its inherited fd 2; in the owning process they would reach the
console. While an engine is built, the building thread's writes to sys.stdout/sys.stderr go to
fd 1/2 (the log); other threads (a run printing its job's creation meanwhile) still write to
the console."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

_local = threading.local()


class _ByThread:
    """A stream that writes for the threads marked by `engine_output_to_log` to `engine`, for
    every other thread to `default`."""

    def __init__(self, default: TextIO, engine: TextIO) -> None:
        self._default, self._engine = default, engine

    def _target(self) -> TextIO:
        return self._engine if getattr(_local, "engine", False) else self._default

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)


@contextlib.contextmanager
def engine_output_to_log() -> Iterator[None]:
    """This thread's writes to sys.stdout/sys.stderr go to the process's fd 1/2 meanwhile (a
    no-op where they are the same streams: nothing was made quiet)."""
    swapped = []
    for name, original in (("stdout", sys.__stdout__), ("stderr", sys.__stderr__)):
        current = getattr(sys, name)
        if original is not None and current is not original and not isinstance(current, _ByThread):
            setattr(sys, name, _ByThread(current, original))
            swapped.append((name, current))
    _local.engine = True
    try:
        yield
    finally:
        _local.engine = False
        for name, current in swapped:
            setattr(sys, name, current)
