"""`batchllm worker --concurrency N`: N single-process workers, each restarted when it dies.

A worker process can die without asking (an OOM kill, a GPU fault that takes its engine and
the process down); its shard comes back through the reconciler, but the GPU would sit idle
unless the process is started again. Restarts back off while a worker keeps dying young, so a
worker that cannot start (a model that does not fit) does not spin.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_POLL_SECONDS = 1.0
_YOUNG_SECONDS = 60.0  # a worker that dies younger than this counts towards the backoff
_MAX_BACKOFF_SECONDS = 60.0


@dataclass
class _Slot:
    index: int
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    early_deaths: int = 0
    restart_at: float = 0.0
    done: bool = False  # exited 0 on its own: not restarted

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env)
        self.started = time.monotonic()


def supervise(
    commands: list[tuple[list[str], dict[str, str]]], *, sleep: Callable[[float], None] = time.sleep
) -> int:
    """Run each (argv, env) as a child until SIGTERM, SIGINT or SIGHUP, restarting children
    that fail on their own (a child that exits 0 is done; when all are, returns 0); forwards
    the signal to the children (SIGHUP as SIGTERM: a Celery worker without a terminal takes
    SIGHUP for "restart") and returns the highest exit code."""
    slots = [_Slot(i, argv, env) for i, (argv, env) in enumerate(commands)]
    stopping: list[int] = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        for slot in slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, forward) for sig in stop_signals}
    try:
        for slot in slots:
            slot.start()
        while not stopping:
            now = time.monotonic()
            if all(slot.done for slot in slots):
                return 0
            for slot in slots:
                if slot.done:
                    continue
                if slot.proc is None:
                    if now >= slot.restart_at:
                        log.warning("worker %d: restarting", slot.index)
                        slot.start()
                    continue
                code = slot.proc.poll()
                if code is None or stopping:
                    continue
                if code == 0:  # it stopped on its own, cleanly (`worker --max-idle`): done
                    log.info(
                        "worker %d (pid %d) exited 0: not restarted", slot.index, slot.proc.pid
                    )
                    slot.proc, slot.done = None, True
                    continue
                slot.early_deaths = (
                    slot.early_deaths + 1 if now - slot.started < _YOUNG_SECONDS else 0
                )
                delay = min(2.0**slot.early_deaths, _MAX_BACKOFF_SECONDS)
                log.error(
                    "worker %d (pid %d) exited with %s; restarting it in %.0f s",
                    slot.index,
                    slot.proc.pid,
                    code,
                    delay,
                )
                slot.proc, slot.restart_at = None, now + delay
            sleep(_POLL_SECONDS)
        codes = [slot.proc.wait() for slot in slots if slot.proc is not None]
        return max(codes, default=0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def child_env(index: int) -> dict[str, str]:
    """Process i sees GPU i (of CUDA_VISIBLE_DEVICES when set)."""
    env = dict(os.environ)
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    env["CUDA_VISIBLE_DEVICES"] = visible[index % len(visible)] if visible else str(index)
    return env
