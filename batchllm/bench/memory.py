"""Peak resident memory of a process and all its children (vLLM's EngineCore is a child).

Sampling runs in a thread of the measured process for the in-process contenders, so it is kept
cheap: the process list is refreshed once a second, the RSS read five times a second.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Collection

_INTERVAL = 0.2
_RESCAN = 1.0


class PeakRss:
    """Samples the RSS of `pid`'s process tree in a thread while the block runs."""

    def __init__(self, pid: int | None = None, *, exclude: Collection[int] = ()) -> None:
        self.pid = pid or os.getpid()
        self.exclude = set(exclude)  # children not to count (another contender's server)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _tree(self) -> list:
        import psutil

        try:
            root = psutil.Process(self.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        return [proc for proc in tree if proc.pid not in self.exclude]

    def _sample(self) -> None:
        import psutil

        procs, scanned = self._tree(), time.monotonic()
        while True:
            if time.monotonic() - scanned >= _RESCAN:
                procs, scanned = self._tree(), time.monotonic()
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.NoSuchProcess:  # ended between the scan and the read
                    pass
            self.peak = max(self.peak, total)
            if self._stop.wait(_INTERVAL):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
