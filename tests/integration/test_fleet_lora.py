"""A LoRA job on the worker fleet: real Redis and PostgreSQL, real `batchllm worker` processes:
the LoRA worker builds a real vLLM engine (the adapter's effect on the text is the subject); the
plain worker, which must leave the job alone, runs the instant engine (its queues and its
profile, not its generation, keep the job off it).

Workers own their engines, and jobs adapt to them. The job is submitted with `--lora a=PATH`
while only a worker without LoRA is up: it waits (its queue is the LoRA one, `status` says
why) and that worker neither takes it nor rebuilds its engine for it. A worker started with
`--enable-lora` (before the adapter directory existed; no adapter flags) then runs it. The
original directory is deleted right after submission, so the worker can only have loaded the
copy `batchllm submit` stored under the job.

The LoRA worker is also the fleet suite's real-engine case of the worker's quiet console (its
instant-engine cases, JSON and `-v`, are test_worker_console.py's): started with
VLLM_LOGGING_LEVEL=INFO, its console holds batchllm's and Celery's lines only, and vLLM's
output and its engine processes' are in the log file the console names. One engine build
serves both subjects.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass

import pytest

from batchllm.output.parts import read_output
from batchllm.storage import Storage
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus

# The fixtures' helpers (a module of its own here: the Worker log tails of a failure are added
# by this test, not by conftest's report hook).
from tests.support.fleet import (
    INSTANT_ARGS,
    WORKER_ENGINE_ARGS,
    Worker,
    start_workers,
    stop_workers,
    tails,
)
from tests.support.job_checks import load_job, wait_for
from tests.support.worker_logs import assert_quiet_vllm_console

WORKER = "lora@test"
PLAIN_WORKER = "plain@test"
MAX_TOKENS = 12
PROMPTS = [
    "The farmer found a wooden table near the river.",
    "Why is the sky blue?",
]


def job_lines() -> list[dict]:
    lines = []
    for i, prompt in enumerate(PROMPTS):
        messages = [{"role": "user", "content": prompt}]
        lines += [
            {"custom_id": f"base-prompt-{i}", "prompt": prompt},
            {"custom_id": f"a-prompt-{i}", "prompt": prompt, "adapter": "a"},
            {"custom_id": f"base-chat-{i}", "messages": messages},
            {"custom_id": f"a-chat-{i}", "messages": messages, "adapter": "a"},
        ]
    return lines


def wait_until_final(fleet_env, job_id: str, timeout: float, workers) -> Job:
    deadline = time.monotonic() + timeout
    while True:
        job, _ = load_job(fleet_env, job_id)
        if job.status.is_final:
            return job
        for worker in workers:
            assert worker.proc.poll() is None, f"{worker.name} exited" + tails(workers)
        if time.monotonic() > deadline:
            raise AssertionError(
                f"job {job_id} still {job.status.value} after {timeout:.0f}s" + tails(workers)
            )
        time.sleep(0.5)


def wait_for_status_line(fleet_env, job_id: str, text: str, workers, timeout: float = 60) -> str:
    """`batchllm status JOB` until its output holds `text` (workers register within seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        shown = fleet_env.cli("status", job_id)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        if text in shown.stdout:
            return shown.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"status never said {text!r}:\n{shown.stdout}" + tails(workers))
        time.sleep(1)


@dataclass
class LoraFleet:
    job_id: str
    waiting: str  # `batchllm status JOB` while only the plain worker was up
    queued: tuple[Job, list[Shard]]  # the job and its shards then
    job: Job  # ... and once it ended
    shards: list[Shard]
    plain: Worker
    worker: Worker  # the LoRA worker (stopped, as the plain one, when the job had ended)
    pid: int  # the LoRA worker's process, as started
    served_alive: bool  # that process was still up when the job ended
    finished: str  # batchllm's line for the job's end


@pytest.fixture(scope="module")
def lora_fleet(fleet_env, tiny_model, tmp_path_factory) -> LoraFleet:
    from batchllm.engine.models.demo_model import build_demo_adapters

    tmp_path = tmp_path_factory.mktemp("fleet-lora")
    workers = start_workers(
        [PLAIN_WORKER],
        fleet_env=fleet_env,
        model=tiny_model,
        log_dir=tmp_path,
        engine_args=INSTANT_ARGS,
    )
    (plain,) = workers
    try:
        # The adapter exists only now, outside the fleet's storage.
        original = tmp_path / "adapters" / "a"
        shutil.copytree(build_demo_adapters(tiny_model, 1)[0], original)
        source = tmp_path / "lora.jsonl"
        source.write_text("".join(json.dumps(line) + "\n" for line in job_lines()))

        submitted = fleet_env.cli(
            "submit",
            str(source),
            *("--model", str(tiny_model)),
            *("--lora", f"a={original}"),
            *("--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--temperature", "0"),
            *("--max-model-len", "512", "--enforce-eager"),
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        job_id = submitted.stdout.split()[0]
        shutil.rmtree(original)  # the job runs from its stored copy

        # Not "none of the 1 live": a worker an earlier test killed stays listed as live until
        # its registry key expires (tests/integration/test_fleet.py kills one just before).
        waiting = wait_for_status_line(
            fleet_env, job_id, f"{PLAIN_WORKER}: needs LoRA adapters", workers
        )
        queued = load_job(fleet_env, job_id)

        # VLLM_LOGGING_LEVEL=INFO: vLLM has much to say (its engine processes too), all of
        # which must reach the worker's log file and none its console.
        workers += start_workers(
            [WORKER],
            fleet_env=fleet_env,
            model=tiny_model,
            log_dir=tmp_path,
            engine_args=(*WORKER_ENGINE_ARGS, "--enable-lora"),
            env={"VLLM_LOGGING_LEVEL": "INFO"},
        )
        worker = workers[-1]
        pid = worker.proc.pid
        wait_until_final(fleet_env, job_id, timeout=420, workers=workers)
        job, shards = load_job(fleet_env, job_id)
        served_alive = worker.proc.poll() is None and worker.proc.pid == pid
        finished = (
            f"batchllm.execution.finalize: job {job_id} completed: {len(job_lines())} ok, 0 failed"
        )
        if job.status is JobStatus.COMPLETED:
            wait_for(
                lambda: finished in worker.log(),
                timeout=30,
                what=lambda: "the job's line on the console" + tails(workers),
            )
    except AssertionError as exc:
        raise AssertionError(f"{exc}{tails(workers)}") from None
    finally:
        stop_workers(workers)
    return LoraFleet(
        job_id, waiting, queued, job, shards, plain, worker, pid, served_alive, finished
    )


def test_a_lora_job_waits_for_a_lora_worker_and_runs_on_it(lora_fleet: LoraFleet, fleet_env):
    run = lora_fleet
    job, shards, job_id, worker = run.job, run.shards, run.job_id, run.worker
    try:
        assert "waiting: none of the" in run.waiting, run.waiting
        queued_job, queued_shards = run.queued
        assert queued_job.status is JobStatus.QUEUED
        assert {(s.status, s.worker) for s in queued_shards} == {(ShardStatus.QUEUED, None)}

        assert job.status is JobStatus.COMPLETED, job.error
        assert (job.request_completed, job.request_failed) == (len(job_lines()), 0)
        assert [(s.status, s.worker) for s in shards] == [(ShardStatus.COMPLETED, WORKER)] * len(
            shards
        )
        storage = Storage.of(fleet_env.settings)
        stored = f"{storage.job_dir(job_id)}/adapters/a"
        assert job.spec["adapters"] == {"a": stored}
        assert storage.exists(f"{stored}/adapter_config.json")
        rows = {
            r["custom_id"]: r for r in read_output(storage, storage.output_dir(job_id)).to_pylist()
        }
        assert set(rows) == {line["custom_id"] for line in job_lines()}
        for key, row in rows.items():
            assert row["status"] == "ok", row
            assert row["completion_tokens"] == MAX_TOKENS, row
            assert row["adapter"] == ("a" if key.startswith("a-") else None), row
        for i in range(len(PROMPTS)):
            for form in ("prompt", "chat"):
                adapted, base = rows[f"a-{form}-{i}"], rows[f"base-{form}-{i}"]
                assert adapted["text"] != base["text"], (adapted, base)
                assert adapted["prompt_tokens"] == base["prompt_tokens"]
        # The same worker process served the job: no restart to take on the adapter. The
        # plain worker never took the job, and no engine was rebuilt for it.
        assert run.served_alive
        assert worker.log().count(f"{WORKER} ready.") == 1
        assert job_id not in run.plain.log()
        assert "rebuilding" not in run.plain.log() + worker.log()
        print(
            f"\nLoRA job on the fleet: {job.request_total} rows, job wall "
            f"{job.wall_seconds:.1f} s on {WORKER} (pid {run.pid}, not restarted)"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}{tails([run.plain, worker])}") from None


def test_the_vllm_workers_console_shows_batchllm_and_celery_lines_and_the_file_has_vllms_output(
    lora_fleet: LoraFleet, fleet_env
):
    """The text console of a worker with a real engine (test_worker_console.py checks the JSON
    console and `-v` on instant workers): batchllm's and Celery's lines only, from start-up to
    shutdown; vLLM's, its engine processes' and the interpreter's output in the log file the
    console names, where batchllm's lines are too, in order with vLLM's."""
    console = lora_fleet.worker.log()
    assert lora_fleet.finished in console
    log_text = assert_quiet_vllm_console(
        console, name=WORKER, home=fleet_env.settings.home, pid=lora_fleet.pid
    )
    assert lora_fleet.finished in log_text
