"""process/parent_watch.py `watch_parent`: the one parent-death loop (the engine plugin and
`serve --worker`'s worker both stop with it) calls back once its parent is gone, and not before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# A parent that starts a child and exits once the child has said it watches; the child writes
# `gone` when the watch calls back, then exits.
CHILD = """
import os, sys, time
from pathlib import Path
from batchllm.process.parent_watch import watch_parent
marker = Path(sys.argv[1])
watch_parent(os.getppid(), lambda: (marker.write_text("gone"), os._exit(0)), name="t", poll=0.05)
print("watching", flush=True)
time.sleep(60)
"""
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE)
assert child.stdout.readline().strip() == b"watching"
print(child.pid, flush=True)
sys.stdin.readline()  # lives until the test closes its stdin
"""


def test_the_callback_runs_once_the_parent_is_gone_and_not_before(tmp_path: Path) -> None:
    marker = tmp_path / "gone"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, str(marker)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert parent.stdout is not None and parent.stdin is not None
    child_pid = int(parent.stdout.readline())
    try:
        time.sleep(0.5)  # ten polls with the parent alive: no callback
        assert not marker.exists()
        parent.stdin.close()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.read_text() == "gone"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        try:  # the child exits by itself after its callback; ended here only if it did not
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
