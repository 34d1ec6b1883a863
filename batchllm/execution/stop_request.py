"""How a runner stops before its shards end: a worker's SIGTERM, a Ctrl-C of `batchllm run`.

On the first request the runner feeds no more rows and claims no more shards. Rows in the
engine that have not started generating go back at once; those generating may go on for up to
`drain_seconds` (the drain): a spot instance's notice or a
pod's grace period is long enough for many of them to finish and be committed, instead of
being thrown away and generated again by another worker. The drain ends when they have all
finished, at its deadline, or at a second request (a second SIGTERM or Ctrl-C). Then the
finished rows are committed, the rest are aborted, and the shards are handed back.
"""

from __future__ import annotations

import threading


class StopRequest:
    """Set from signal handlers (Event.set only: nothing here blocks), read by the runner."""

    def __init__(self, drain_seconds: float = 0.0, requested: threading.Event | None = None):
        self.drain_seconds = drain_seconds
        self.requested = requested if requested is not None else threading.Event()
        self.cut_short = threading.Event()

    def request(self) -> None:
        """The first call asks for a stop (with its drain), any later one cuts the drain short."""
        if self.requested.is_set():
            self.cut_short.set()
        else:
            self.requested.set()
