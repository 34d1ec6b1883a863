"""`batchllm worker`'s quiet console: a real worker process (real Redis and PostgreSQL, the
instant engine on the tiny model) runs a job; its console (stdout and stderr together, as a
terminal shows them) in the JSON format holds one object per line from batchllm's and Celery's
loggers, while Celery's banner and the interpreter's warnings are in the log file the console
names. `-v` keeps everything on the console.

The text console of a worker with a real vLLM engine (vLLM's output and its engine processes'
in the file, none on the console) is checked on test_fleet_lora.py's LoRA worker, which builds
that engine anyway: the same redirection (cli/fleet.py _quiet_console, whatever the format)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from batchllm.demo.workload import write_workload
from batchllm.store.models import JobStatus
from tests.support.fleet import INSTANT_ARGS, REPO, Worker
from tests.support.job_checks import (
    assert_exactly_once,
    expected_rows,
    output_rows,
    wait_for,
    wait_until_final,
)
from tests.support.worker_logs import NOTICE, assert_celery_output_in, named_log

pytestmark = pytest.mark.integration

JOB_SECONDS = 420  # generous on two loaded cores; the job takes seconds


@pytest.fixture
def own_queue_model(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny model under a path of its own: the worker under test gets its own queue, so no
    other test's worker can take its job."""
    link = tmp_path / "console-model"
    link.symlink_to(tiny_model, target_is_directory=True)
    return link


def run_job_through(worker: Worker, fleet_env, model: Path, tmp_path: Path):
    source = write_workload(tmp_path / "prompts.jsonl", requests=6, bad_lines=1, seed=11)
    submitted = fleet_env.submit(source, model, shard_size=10, max_tokens=8)
    job = wait_until_final(fleet_env, submitted.id, timeout=JOB_SECONDS)
    assert job.status is JobStatus.COMPLETED, f"{job.status.value}: {job.error}\n{worker.tail()}"
    assert (job.request_completed, job.request_failed) == (5, 1)
    assert_exactly_once(output_rows(fleet_env, job.id), expected_rows(source))
    return job


def test_log_format_json_keeps_the_console_one_object_per_line(
    fleet_env, own_queue_model: Path, tmp_path: Path
):
    worker = Worker(
        "quiet-json@test",
        model=own_queue_model,
        env=fleet_env.worker_env(BATCHLLM_LOG_FORMAT="json"),
        log_path=tmp_path / "console.txt",
        engine_args=INSTANT_ARGS,
    )
    try:
        worker.wait_ready()
        job = run_job_through(worker, fleet_env, own_queue_model, tmp_path)
        wait_for(
            lambda: f"job {job.id} completed" in worker.log(),
            timeout=30,
            what="the job's line on the console",
        )
    finally:
        worker.stop()
    entries = [json.loads(line) for line in worker.log().splitlines()]
    assert {e["logger"].split(".")[0] for e in entries} == {"batchllm", "celery"}
    finished = [e for e in entries if e["logger"] == "batchllm.execution.finalize"]
    assert [(e["job_id"], e["level"]) for e in finished] == [(job.id, "INFO")]
    assert finished[0]["message"].startswith(f"job {job.id} completed: 5 ok, 1 failed")
    notice = next(e["message"] for e in entries if NOTICE.search(e["message"]))
    assert_celery_output_in(named_log(notice, home=fleet_env.settings.home, pid=worker.proc.pid))


def test_verbose_keeps_everything_on_the_console_and_writes_no_log_file(
    fleet_env, own_queue_model: Path, tmp_path: Path
):
    """`batchllm -v worker`: today's console (Celery's banner, warnings), no file. Ends at
    `ready.`, which comes once the worker's own (instant) engine is built."""
    console_path = tmp_path / "console.txt"
    with console_path.open("wb") as console:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchllm", "-v", "worker", "--model", str(own_queue_model)]
            + ["--name", "loud@test", *INSTANT_ARGS],
            env=fleet_env.worker_env(),
            cwd=REPO,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for(
                lambda: (
                    "loud@test ready." in console_path.read_text(errors="replace")
                    or proc.poll() is not None
                ),
                timeout=120,
                what="the verbose worker to be ready",
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = console_path.read_text(errors="replace")
    assert "loud@test ready." in text, text
    assert "[queues]" in text  # Celery's banner
    if os.geteuid() == 0:
        assert "SecurityWarning" in text  # an interpreter warning
    assert NOTICE.search(text) is None
    logs = fleet_env.settings.home / "logs"
    assert not list(logs.glob(f"worker-*-{proc.pid}.log"))
