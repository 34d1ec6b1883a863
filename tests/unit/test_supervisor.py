"""`worker --concurrency N`'s supervisor restarts a worker process that dies on its own."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from batchllm.process.supervisor import supervise


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_child_that_dies_is_started_again_and_a_stop_signal_ends_all(tmp_path, stop):
    starts = tmp_path / "starts"
    # Each start appends a line; the first run dies at once (as if OOM-killed), later ones
    # stay up until the supervisor forwards SIGTERM.
    script = (
        "import pathlib, sys, time\n"
        f"p = pathlib.Path({str(starts)!r})\n"
        "n = len(p.read_text().splitlines()) if p.exists() else 0\n"
        "p.write_text(p.read_text() + 'start\\n' if p.exists() else 'start\\n')\n"
        "sys.exit(3) if n == 0 else time.sleep(120)\n"
    )
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        threading.Event().wait(0.05)
        if starts.exists() and len(starts.read_text().splitlines()) >= 2 and len(sleeps) > 3:
            os.kill(os.getpid(), stop)  # what `kill <supervisor>` or a closed terminal does

    previous = signal.getsignal(stop)
    code = supervise([([sys.executable, "-c", script], dict(os.environ))], sleep=sleep)
    assert starts.read_text().splitlines() == ["start", "start"]
    # The restarted child ended by the forwarded signal; SIGHUP goes on as SIGTERM.
    assert code == -signal.SIGTERM
    assert signal.getsignal(stop) is previous


def test_children_that_exit_0_on_their_own_are_done_and_then_so_is_the_supervisor(tmp_path):
    """`worker --concurrency N --max-idle S`: each process stops cleanly when idle; none is
    started again, and the command ends with 0 once all have."""
    starts = tmp_path / "starts"
    script = (
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(starts)!r})\n"
        "with p.open('a') as f: f.write('start\\n')\n"
        "sys.exit(0)\n"
    )
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        assert len(sleeps) < 400, "the supervisor did not end after its children exited 0"
        threading.Event().wait(0.05)

    command = ([sys.executable, "-c", script], dict(os.environ))
    assert supervise([command, command], sleep=sleep) == 0
    assert starts.read_text().splitlines() == ["start", "start"]
