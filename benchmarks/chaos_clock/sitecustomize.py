"""A chaos worker's wall clock, steppable: the clock-step fault (benchmarks/chaos_faults.py).

The harness puts this directory first on a worker's PYTHONPATH, so its Python imports this
module at start-up, before anything else. From then on `time.time`, `time.time_ns` and
batchllm's `utcnow` (batchllm/store/models.py: the one function batchllm reads UTC from) add the
offset, in seconds, written in $BATCHLLM_CHAOS_CLOCK_FILE (read again at most once a second).
The monotonic clock is left alone, as a real wall-clock step (NTP, a clock set by hand) leaves
it. C code (libpq, hiredis) keeps the real clock: only Python's reads step.

Why not libfaketime: Debian's 0.9.10 hangs `threading.Event.wait` when it fakes the monotonic
clock too, and fails `time.sleep` with EINVAL when it does not.
"""

from __future__ import annotations

import os
import time

_FILE = os.environ.get("BATCHLLM_CHAOS_CLOCK_FILE")


def _install(path: str) -> None:
    real_time, real_time_ns, monotonic = time.time, time.time_ns, time.monotonic
    state = {"offset": 0.0, "read_at": float("-inf")}

    def offset() -> float:
        now = monotonic()
        if now - state["read_at"] >= 1.0:
            state["read_at"] = now
            try:
                with open(path) as text:
                    state["offset"] = float(text.read().strip() or 0)
            except (OSError, ValueError):
                pass
        return state["offset"]

    def stepped_time() -> float:
        return real_time() + offset()

    def stepped_time_ns() -> int:
        return real_time_ns() + int(offset() * 1e9)

    time.time = stepped_time
    time.time_ns = stepped_time_ns

    from datetime import datetime, timedelta

    from batchllm.store import models

    real_utcnow = models.utcnow

    def stepped_utcnow() -> datetime:
        return real_utcnow() + timedelta(seconds=offset())

    models.utcnow = stepped_utcnow


if _FILE:
    _install(_FILE)
