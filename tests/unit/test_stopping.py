"""SIGTERM and SIGHUP run a command's cleanups, so the children it started end with it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

# A parent that starts a long-lived child inside cleanups_run_on_signals, prints the child's
# pid and waits; its `finally` stops the child. Without the context manager, SIGTERM or SIGHUP
# would end the parent at once and leave the child under PID 1.
PARENT = """
import subprocess, sys, time
from batchllm.process.stopping import cleanups_run_on_signals, stop_child

with cleanups_run_on_signals():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        print(child.pid, flush=True)
        time.sleep(600)
    finally:
        stop_child(child, grace=30)
        print("stopped", child.returncode, flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_ends_the_child_and_then_the_process_by_sigterm(sig):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = None
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))

        parent.send_signal(sig)

        assert parent.wait(timeout=60) == -signal.SIGTERM  # systemd counts that a clean stop
        assert parent.stdout.read().split() == ["stopped", str(-signal.SIGTERM)]
        deadline = time.monotonic() + 30
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None:
            try:
                child.kill()  # psutil refuses a pid that now names another process
            except psutil.NoSuchProcess:
                pass


def test_outside_the_block_the_previous_handlers_are_back():
    from batchllm.process.stopping import cleanups_run_on_signals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    with cleanups_run_on_signals():
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in before} == before
