"""The console script's exit (batchllm/launcher.py exit_now): a command that has ended leaves
without the teardown of its modules, but with what Python's exit does that has an effect: the
program's non-daemon threads joined, its atexit handlers run, the standard streams flushed, and
the command's exit status. Real processes: what a user's shell sees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.cli import REPO


def launch(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`code` then the launcher's main(), in a process of its own."""
    program = f"import sys\nfrom batchllm import launcher\n{code}\nlauncher.main()\n"
    return subprocess.run(
        [sys.executable, "-c", program],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "BATCHLLM_HOME": str(tmp_path / "home")},
    )


def test_an_ended_command_runs_exit_handlers_joins_threads_and_flushes(tmp_path: Path) -> None:
    marker = tmp_path / "joined"
    done = launch(
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('exit handler ran'))\n"
        f"threading.Thread(target=lambda: (time.sleep(0.5), open({str(marker)!r}, 'w'))).start()\n"
        "sys.stdout.write('buffered, not flushed')\n"
        "sys.argv = ['batchllm', '--version']",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "batchllm, version" in done.stdout
    assert "buffered, not flushed" in done.stdout and "exit handler ran" in done.stdout
    assert marker.exists()  # the non-daemon thread finished before the process ended


def test_exit_statuses_are_those_of_the_command(tmp_path: Path) -> None:
    usage = launch("sys.argv = ['batchllm', 'no-such-command']", tmp_path)
    assert usage.returncode == 2 and "No such command" in usage.stderr
    message = launch(
        "import batchllm.cli\n"
        "def main(): raise SystemExit('stopped: a message')\n"
        "batchllm.cli.main = main\n"
        "sys.argv = ['batchllm', 'jobs']",
        tmp_path,
    )
    assert message.returncode == 1 and "stopped: a message" in message.stderr
