"""`batchllm retry` of a fleet job on real services: real Redis and PostgreSQL, a real
`batchllm worker` on the instant engine (the retry is the subject, not generation).

A job `batchllm submit` created is cancelled while no worker is up, so none of its lines has a
row and its shard tasks are still in the broker. A worker then starts and drains those stale
tasks (their shards are cancelled: nothing runs), and `batchllm retry JOB --wait` sends the
shards back to the fleet as the job's second attempt, which the worker runs to completion.
"""

from __future__ import annotations

import re
import subprocess

from batchllm.demo.workload import write_workload
from batchllm.spec import JobSpec
from batchllm.store.models import JobStatus, ShardStatus
from batchllm.worker.broker_tasks import shard_ids_in_broker
from batchllm.worker.celery_app import TASK_RUN_SHARD, queue_for_job
from tests.support.fleet import INSTANT_ARGS, start_workers, stop_workers, tails
from tests.support.job_checks import (
    assert_exactly_once,
    expected_rows,
    load_job,
    output_rows,
    wait_for,
)

WORKER = "retry@test"
LINES = 16  # one of them invalid: it becomes an error row, which a default retry leaves be
SHARD_SIZE = 4
MAX_TOKENS = 8


def test_a_cancelled_fleet_job_is_retried_on_the_fleet_with_one_row_per_line(
    fleet_env, tiny_model, tmp_path
):
    source = write_workload(
        tmp_path / "retry.jsonl",
        requests=LINES,
        max_tokens=(MAX_TOKENS, MAX_TOKENS),
        forms=("prompt", "chat"),
        bad_lines=1,
        seed=7,
    )
    expected = expected_rows(source)
    invalid = sorted(n for n, (_, status) in expected.items() if status == "error")
    assert len(invalid) == 1
    job = fleet_env.submit(source, tiny_model, shard_size=SHARD_SIZE, max_tokens=MAX_TOKENS)
    job_id, shards_total = job.id, job.shards_total
    assert shards_total == LINES // SHARD_SIZE

    # Attempt 1: cancelled before any worker took a shard.
    cancelled = fleet_env.cli("cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert f"{job_id}: cancelled" in cancelled.stdout
    job, shards = load_job(fleet_env, job_id)
    assert job.status is JobStatus.CANCELLED
    assert {s.status for s in shards} == {ShardStatus.CANCELLED}
    assert output_rows(fleet_env, job_id) == []
    broker_url, queue = fleet_env.settings.broker_url, queue_for_job(JobSpec(**job.spec))
    shard_ids = {s.id for s in shards}
    assert shard_ids_in_broker(broker_url, {queue}, TASK_RUN_SHARD) >= shard_ids

    workers = start_workers(
        [WORKER], fleet_env=fleet_env, model=tiny_model, log_dir=tmp_path, engine_args=INSTANT_ARGS
    )
    try:
        # The cancelled shards' tasks are drained first, so the retry's own tasks are the only
        # ones left (the worker skips the stale ones: their shards ended).
        wait_for(
            lambda: not shard_ids & shard_ids_in_broker(broker_url, {queue}, TASK_RUN_SHARD),
            timeout=120,
            what=lambda: "the worker to drain the cancelled shards' tasks" + tails(workers),
            interval=0.5,
        )
        job, shards = load_job(fleet_env, job_id)
        assert job.status is JobStatus.CANCELLED
        assert {(s.status, s.worker) for s in shards} == {(ShardStatus.CANCELLED, None)}

        # Attempt 2: every line back to the fleet, followed to its end.
        try:
            retried = fleet_env.cli("retry", job_id, "--wait", timeout=300)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"retry --wait still running after 300 s{tails(workers)}") from exc
        assert retried.returncode == 0, retried.stdout + retried.stderr + tails(workers)
        assert f"retrying {LINES} line(s) of {job_id} ({LINES} never answered)" in retried.stderr
        # The retry prints the attempt's state as it reads it just after queuing: a free worker
        # may have taken a shard by then (a fresh-clone run saw `in_progress`).
        assert re.search(
            rf"{job_id}: attempt 2 (queued|in_progress) on the fleet", retried.stderr
        ), retried.stderr

        job, shards = load_job(fleet_env, job_id)
        assert job.status is JobStatus.COMPLETED, job.error
        assert [(s.status, s.worker) for s in shards] == [
            (ShardStatus.COMPLETED, WORKER)
        ] * shards_total
        assert job.shards_done == shards_total
        assert all(s.rows_ok + s.rows_failed == s.rows for s in shards)

        rows = output_rows(fleet_env, job_id)
        assert_exactly_once(rows, expected)
        ok = [r for r in rows if r["status"] == "ok"]
        errors = [r for r in rows if r["status"] == "error"]
        assert len(ok) == LINES - 1
        assert all(0 < r["completion_tokens"] <= MAX_TOKENS for r in ok), ok
        assert [(r["line"], r["error_code"]) for r in errors] == [(invalid[0], "invalid_request")]
        assert (job.request_total, job.request_completed, job.request_failed) == (
            LINES,
            len(ok),
            len(errors),
        )
        assert job.prompt_tokens == sum(r["prompt_tokens"] or 0 for r in rows)
        assert job.completion_tokens == sum(r["completion_tokens"] or 0 for r in rows) > 0

        runs = [(run["attempt"], run["status"], run["lines"]) for run in job.attempts]
        assert runs == [(1, "cancelled", LINES), (2, "completed", LINES)]
        assert all(run["wall_seconds"] is not None for run in job.attempts)
        assert job.wall_seconds > 0

        shown = fleet_env.cli("status", job_id)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert re.search(rf"attempt 1 +{LINES} lines, cancelled, wall", shown.stdout), shown.stdout
        assert re.search(rf"attempt 2 +{LINES} lines, completed, wall", shown.stdout), shown.stdout

        # The invalid line's error row would fail the same way again: nothing left to retry.
        again = fleet_env.cli("retry", job_id)
        assert again.returncode != 0, again.stdout + again.stderr
        assert "nothing to retry" in again.stderr
        assert load_job(fleet_env, job_id)[0].status is JobStatus.COMPLETED
    finally:
        stop_workers(workers)
