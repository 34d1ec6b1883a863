"""A line per real vLLM engine built, appended to the file ENGINE_BUILD_LOG names (when set).

Engine builds are what a CPU test suite spends most of its time on (20-90 s each here); the
suite sets this variable and prints the count of lines when it ends, so a change that adds an
engine build shows up in every run. It is not prefixed BATCHLLM_ because the suites hand their
processes an environment without the BATCHLLM_ settings of the machine, and the count must
reach every process they start. Unset (every user's case), nothing is written.
"""

from __future__ import annotations

import os

ENGINE_BUILD_LOG = "ENGINE_BUILD_LOG"


def note_engine_build(what: str) -> None:
    """Record one engine build: `what` says whose (a model, a contender)."""
    path = os.environ.get(ENGINE_BUILD_LOG)
    if not path:
        return
    line = f"{os.getpid()} {what}\n".encode(errors="replace")
    # One write of an O_APPEND file: lines from processes writing at once never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def count_engine_builds(path: str | os.PathLike[str]) -> int:
    try:
        with open(path, "rb") as lines:
            return sum(1 for _ in lines)
    except FileNotFoundError:
        return 0
