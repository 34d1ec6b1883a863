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


def _kill_left(parent: subprocess.Popen, child: psutil.Process | None) -> None:
    """Kill what a failed test left running of the parent and its child."""
    if parent.poll() is None:
        parent.kill()
        parent.wait()
    if child is not None:
        try:
            child.kill()  # psutil refuses a pid that now names another process
        except psutil.NoSuchProcess:
            pass


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
        _kill_left(parent, child)


def test_outside_the_block_the_previous_handlers_are_back():
    from batchllm.process.stopping import cleanups_run_on_signals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    with cleanups_run_on_signals():
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in before} == before


# A child that drains on its first SIGTERM (notes it in a file, goes on) and ends, exit 0, on
# the second: what `batchllm worker` does. Its parent stops it with a long grace.
DRAINING_CHILD = """
import signal, sys, time
terms = 0
def on_term(signum, frame):
    global terms
    terms += 1
    with open(sys.argv[1], "a") as notes:
        notes.write(f"term {terms}\\n")
    if terms == 2:
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""

PATIENT_PARENT = """
import subprocess, sys, time
from batchllm.process.stopping import cleanups_run_on_signals, stop_child

with cleanups_run_on_signals():
    child = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True
    )
    try:
        child.stdout.readline()
        print(child.pid, flush=True)
        time.sleep(600)
    finally:
        stop_child(child, grace=600)
        print("stopped", child.returncode, flush=True)
"""


def test_a_second_signal_is_passed_on_and_cuts_the_childs_drain_short(tmp_path):
    notes = tmp_path / "notes"
    parent = subprocess.Popen(
        [sys.executable, "-c", PATIENT_PARENT, DRAINING_CHILD, str(notes)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child = None
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))

        parent.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not (notes.exists() and notes.read_text() == "term 1\n"):
            assert time.monotonic() < deadline, "the child never got the first SIGTERM"
            time.sleep(0.1)
        assert parent.poll() is None  # waiting out the child's drain (grace 600 s)

        parent.send_signal(signal.SIGTERM)

        # Long before the 600 s grace: the second signal reached the child, which ended by it
        # (its handler ran), not by SIGKILL; the parent waited for that, then ended itself.
        assert parent.wait(timeout=60) == -signal.SIGTERM
        assert notes.read_text() == "term 1\nterm 2\n"
        assert not psutil.pid_exists(child.pid) or (
            psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
        )
    finally:
        _kill_left(parent, child)
