"""`batchllm worker --max-idle SECONDS`: a worker that has had no task for that long (counted
from when its engine was ready) stops as on SIGTERM and exits 0, so a Deployment scaled to
zero, a Kubernetes Job or a spot instance can end when the fleet's work is done."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class IdleWatch:
    """Counts the tasks running in this process and calls `on_idle` once none has run for
    `seconds`. Celery's task_prerun/task_postrun signals call started/ended."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        self._since = clock()

    def started(self) -> None:
        with self._lock:
            self._running += 1

    def ended(self) -> None:
        with self._lock:
            self._running = max(self._running - 1, 0)
            self._since = self._clock()

    def reset(self) -> None:
        """Count idleness from now (the engine is ready: its build is not idle time)."""
        with self._lock:
            self._since = self._clock()

    def idle_for(self) -> float:
        with self._lock:
            return 0.0 if self._running else self._clock() - self._since

    def watch(self, stop: threading.Event, on_idle: Callable[[], None]) -> threading.Thread:
        """A daemon thread that calls `on_idle` once, when idle for `seconds`, unless `stop`
        is set first."""

        def loop() -> None:
            while not stop.wait(min(1.0, self.seconds / 4)):
                idle = self.idle_for()
                if idle >= self.seconds:
                    log.info("no task for %.0f s (--max-idle %g): stopping", idle, self.seconds)
                    on_idle()
                    return

        thread = threading.Thread(target=loop, name="batchllm-max-idle", daemon=True)
        thread.start()
        return thread
