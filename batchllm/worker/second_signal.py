"""The second stop signal of a draining worker cuts its drain short.

Celery calls worker_shutting_down on every SIGTERM, so a second SIGTERM reaches the worker's
handler as is. A first SIGINT (Ctrl-C) makes Celery arm a cold shutdown for the next one, which
cancels the running request from inside a signal handler; a draining worker wants that next
Ctrl-C to end the drain instead (its finished rows committed, the rest handed back). So the
next SIGINT cuts the drain short, and the one after is Celery's own again.
"""

from __future__ import annotations

import signal
import threading

from batchllm.execution.stop_request import StopRequest

# Fits Kubernetes' default 30 s terminationGracePeriodSeconds with the engine's own shutdown.
DEFAULT_DRAIN_SECONDS = 20.0


def cut_short_on_second_sigint(stop: StopRequest) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can be set from the main thread only
    celery_handler = signal.getsignal(signal.SIGINT)

    def second(signum, frame) -> None:
        signal.signal(signal.SIGINT, celery_handler)
        stop.request()  # the runner logs the drain's end

    signal.signal(signal.SIGINT, second)
