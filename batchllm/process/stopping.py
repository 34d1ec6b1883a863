"""Stopping, in one place: how a runner is asked to stop (StopRequest, its drain and a second
signal that cuts it short, a worker's and `run`'s signals), and how commands that start child
processes end them on SIGTERM, SIGINT and SIGHUP.

A first stop feeds no more rows and claims no more shards; rows not yet generating go back at
once, those generating may finish for up to `drain_seconds` (execution/drain.py: a spot notice
or a pod's grace period lets many commit), and a second stop cuts the drain short. SIGTERM and
SIGHUP (systemd, Docker, Kubernetes; a closed terminal) would end a command before any
`finally:`, leaving its children (a worker and its vLLM engine) running under PID 1: the
handlers here clean up, then raise the signal again with the handler found, as uvicorn does.
SIGINT needs nothing: Python already turns it into KeyboardInterrupt.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from batchllm.process.parent_watch import watch_parent

log = logging.getLogger(__name__)


class Signalled(SystemExit):
    """SIGTERM arrived (or SIGHUP, handled as SIGTERM): unwinds the stack so cleanups run."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:  # a failed job's reason
        return f"stopped by {signal.Signals(self.signum).name}"


def _raise(signum: int, _frame: FrameType | None) -> None:
    raise Signalled(signum)


def _as_sigterm(_signum: int, _frame: FrameType | None) -> None:
    # As SIGTERM, so that a server that stops gracefully on SIGTERM (uvicorn, while it serves)
    # does here too, rather than being unwound mid-request.
    signal.raise_signal(signal.SIGTERM)


@contextmanager
def cleanups_run_on_signals() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP unwind the stack like an exception, so `finally:` blocks stop
    the children. On leaving by such a signal, the process ends by SIGTERM, as it would have
    without this (its exit status still says it was signalled, which systemd counts as a clean
    stop)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, _raise),
        signal.SIGHUP: signal.signal(signal.SIGHUP, _as_sigterm),
    }
    try:
        yield
    except Signalled as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("stopped by signal %d", exc.signum)
        signal.raise_signal(exc.signum)
        raise  # the previous handler did not end the process
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_child(proc: subprocess.Popen, *, grace: float) -> None:
    """SIGTERM to `proc` (a warm shutdown: a worker drains its rows in flight first), then
    SIGKILL after `grace` seconds; returns once it has ended. Another signal interrupting the
    wait is passed on as a second SIGTERM (a worker cuts its drain short), and the child gets
    _CUT_SHORT_GRACE seconds more before SIGKILL."""
    try:
        # In the try: a signal landing right after the SIGTERM is sent is a second one too.
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log.warning("pid %d still running %.0f s after SIGTERM: killing it", proc.pid, grace)
        proc.kill()
        proc.wait()
    except BaseException:
        try:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=_CUT_SHORT_GRACE)
        except BaseException:  # a third signal, or still running: no more waiting
            proc.kill()
            proc.wait()
        raise


# After a second signal: enough to commit the finished rows and stop the engine.
_CUT_SHORT_GRACE = 15.0


# Set by a command that starts a worker (serve --worker) to its own pid: the worker stops when
# that process is gone, even when it was killed with SIGKILL and could not stop the worker.
PARENT_MARK = "BATCHLLM_STOP_WITH_PARENT"


def stop_with_parent() -> None:
    """If this process was started with PARENT_MARK, SIGTERM it (a warm shutdown: its shard goes
    back to the queue, its engine is shut down) once that parent is gone. The mark is taken out
    of the environment so the processes this one starts do not watch the wrong parent."""
    owner = os.environ.pop(PARENT_MARK, None)
    if not owner or not owner.isdigit():
        return
    parent = int(owner)

    def stop() -> None:
        log.warning("the process that started this worker (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    watch_parent(parent, stop, name="batchllm-stop-with-parent")


# Fits Kubernetes' default 30 s terminationGracePeriodSeconds with the engine's own shutdown.
DEFAULT_DRAIN_SECONDS = 20.0
# One stop can reach a process twice within moments (a terminal's Ctrl-C goes to the process
# group, systemd's SIGTERM to the cgroup, a supervisor forwards what it got): a signal this soon
# after the first is that same stop, not a second one.
ECHO_SECONDS = 1.0


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
        """Celery calls worker_shutting_down on every SIGTERM, so a second SIGTERM reaches the
        worker's handler as is; but a first SIGINT makes Celery arm a cold shutdown for the
        next one, so the next SIGINT is taken here to cut the drain short, and the one after
        is Celery's own again."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can be set from the main thread only
        celery_handler = signal.getsignal(signal.SIGINT)

        def next_sigint(signum, frame) -> None:
            self.received()
            if self.stop.cut_short.is_set():
                signal.signal(signal.SIGINT, celery_handler)

        signal.signal(signal.SIGINT, next_sigint)


@contextmanager
def stop_on_first_interrupt(interrupted: threading.Event) -> Iterator[None]:
    """`batchllm run`'s Ctrl-C or SIGTERM: the first one sets `interrupted` (the run stops in
    order: in-flight requests are aborted, finished rows committed, the job ends `failed`
    ("interrupted") with them, never `completed`); a second Ctrl-C raises KeyboardInterrupt at
    once, a second SIGTERM does what it did before (under cleanups_run_on_signals: unwinds)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def first(signum: int, _frame: FrameType | None) -> None:
        interrupted.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous_term)
        log.warning(
            "%s: committing finished rows and stopping (again to quit at once)",
            "interrupted" if signum == signal.SIGINT else f"signal {signum}",
        )

    previous = signal.signal(signal.SIGINT, first)
    previous_term = signal.signal(signal.SIGTERM, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
