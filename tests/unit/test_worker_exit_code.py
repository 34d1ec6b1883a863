"""A Celery worker's exit code reaches the process's: after Celery's "Unrecoverable error" the
worker stops with 1, and a process that exited 0 instead was taken for a clean stop (`worker
--concurrency N`'s supervisor, systemd and Kubernetes do not restart it). Real Celery workers,
each in a process of its own (a worker installs signal handlers and logging), failing or
stopping through a bootstep, Celery's own extension point, before they reach the broker."""

from __future__ import annotations

import subprocess
import sys

import pytest

_WORKER = """
import sys
from celery import bootsteps
from celery.exceptions import WorkerShutdown
from batchllm.settings import Settings
from batchllm.worker.celery_app import create_app, run_worker

class Ends(bootsteps.StartStopStep):
    def start(self, worker):
        if sys.argv[1] == "fail":
            raise RuntimeError("an unrecoverable error, as kombu's on a Redis restart")
        raise WorkerShutdown(0)  # a warm shutdown, as on SIGTERM

app = create_app(Settings(broker_url="redis://127.0.0.1:1/0", home=sys.argv[2]))
app.steps["worker"].add(Ends)
sys.exit(run_worker(app, ["--pool=solo", "--without-gossip", "--without-mingle"]))
"""


@pytest.mark.parametrize(("how", "code"), [("fail", 1), ("stop", 0)])
def test_the_worker_process_exits_with_the_celery_workers_code(tmp_path, how, code):
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, how, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stderr[-2000:]
    if how == "fail":
        assert "Unrecoverable error" in done.stderr
