"""The stop signals of a worker process: the first starts the drain, a second cuts it short.

Celery calls worker_shutting_down on every SIGTERM, so a second SIGTERM reaches the worker's
handler as is. A first SIGINT (Ctrl-C) makes Celery arm a cold shutdown for the next one, which
cancels the running request from inside a signal handler; a draining worker wants that next
Ctrl-C to end the drain instead (its finished rows committed, the rest handed back). So the
next SIGINT cuts the drain short, and the one after is Celery's own again.

One stop can reach a process twice within moments: a terminal's Ctrl-C goes to the whole
process group and systemd's SIGTERM to the whole cgroup, while `worker --concurrency N`'s
supervisor forwards what it got too. A signal within ECHO_SECONDS of the first is that same
stop, not a second one, and leaves the drain alone.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from batchllm.execution.stop_request import StopRequest

log = logging.getLogger(__name__)

# Fits Kubernetes' default 30 s terminationGracePeriodSeconds with the engine's own shutdown.
DEFAULT_DRAIN_SECONDS = 20.0
ECHO_SECONDS = 1.0


class StopSignals:
    """Turns the stop signals a worker process receives into its StopRequest's requests."""

    def __init__(self, stop: StopRequest) -> None:
        self.stop = stop
        self.first_at: float | None = None

    def received(self) -> None:
        """A SIGTERM or SIGINT arrived (called from the signal handler: sets events only)."""
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            self.stop.request()
            self._take_the_next_sigint()
        elif now - self.first_at < ECHO_SECONDS:
            log.info(
                "the same stop signal again (%.1f s later): not a second one", now - self.first_at
            )
        else:
            self.stop.request()  # the runner logs the drain's end

    def _take_the_next_sigint(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can be set from the main thread only
        celery_handler = signal.getsignal(signal.SIGINT)

        def next_sigint(signum, frame) -> None:
            self.received()
            if self.stop.cut_short.is_set():
                signal.signal(signal.SIGINT, celery_handler)

        signal.signal(signal.SIGINT, next_sigint)
