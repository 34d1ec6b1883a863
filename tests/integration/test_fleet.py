"""The Celery worker fleet end to end: real Redis and PostgreSQL, real `batchllm worker`
processes on the paced instant engine (tests/support/fleet.py PACED_INSTANT_ARGS: the tiny
model's tokenizer and chat template, one token per running request every 20 ms), so a job lasts
long enough to be cancelled or to lose a worker part-way on any machine. The fleet, not
generation, is the subject; each test class has its own pair of workers.
"""

from __future__ import annotations

import time

import pytest

from batchllm.demo.workload import write_workload
from batchllm.output.parts import SUCCESS_NAME
from batchllm.storage import Storage
from batchllm.store.models import JobStatus, ShardStatus
from batchllm.worker.celery_app import queue_for_model
from tests.support.job_checks import (
    assert_each_line_at_most_once,
    assert_exactly_once,
    checkpoints_of,
    expected_rows,
    load_job,
    output_rows,
    wait_for,
    wait_until_final,
)

# -- tests ---------------------------------------------------------------------------------


class TestSharedFleet:
    """Two warm workers for several jobs in turn."""

    def test_two_workers_share_a_job_and_write_every_row_exactly_once(
        self, pair, fleet_env, tiny_model, tmp_path
    ):
        source = write_workload(
            tmp_path / "prompts.jsonl",
            requests=3000,
            max_tokens=(8, 48),
            forms=("prompt", "chat", "openai_chat"),
            bad_lines=4,
            seed=1,
        )
        expected = expected_rows(source)
        started = time.monotonic()
        job = fleet_env.submit(source, tiny_model, shard_size=500)
        assert (job.shards_total, job.request_total) == (6, 3000)

        job = wait_until_final(fleet_env, job.id, timeout=300)
        elapsed = time.monotonic() - started
        job, shards = load_job(fleet_env, job.id)

        assert job.status is JobStatus.COMPLETED, job.error
        rows = output_rows(fleet_env, job.id)
        assert_exactly_once(rows, expected)
        errors = sorted(n for n, (_, status) in expected.items() if status == "error")
        assert sorted(r["line"] for r in rows if r["status"] == "error") == errors
        assert (job.request_completed, job.request_failed) == (3000 - len(errors), len(errors))
        assert job.shards_done == 6
        assert [s.status for s in shards] == [ShardStatus.COMPLETED] * 6
        assert all(s.rows_ok + s.rows_failed == s.rows for s in shards)
        assert {s.worker for s in shards} == {"w1@test", "w2@test"}, "one worker took every shard"
        # Checkpoints mid-shard (COMMIT_ROWS is 100), each counted once.
        for shard in shards:
            committed = checkpoints_of(fleet_env, shard.id)
            assert len(committed) >= 2 and sum(c.rows for c in committed) == shard.rows

        assert job.prompt_tokens == sum(r["prompt_tokens"] or 0 for r in rows)
        assert job.completion_tokens == sum(r["completion_tokens"] or 0 for r in rows) > 0
        assert 0 < job.wall_seconds < elapsed
        assert job.engine_seconds > 0
        assert job.requests_per_s == pytest.approx(3000 / job.wall_seconds)
        assert job.output_tokens_per_s == pytest.approx(job.completion_tokens / job.wall_seconds)
        assert job.total_tokens_per_s > job.output_tokens_per_s > 0
        assert job.hardware and job.vllm_version and job.finished_at is not None
        storage = Storage.of(fleet_env.settings)
        assert storage.exists(f"{storage.output_dir(job.id)}/{SUCCESS_NAME}")
        print(
            f"\ntwo workers: {job.request_total} rows in {job.shards_total} shards, "
            f"submit-to-end {elapsed:.1f} s, job wall "
            f"{job.wall_seconds:.1f} s, {job.requests_per_s:.1f} req/s, "
            f"{job.output_tokens_per_s:.0f} output tok/s, engine {job.engine_seconds:.1f} s; "
            f"shards per worker: "
            f"{ {w.name: sum(s.worker == w.name for s in shards) for w in pair} }"
        )

    def test_cancelling_a_running_job_ends_it_within_seconds_and_keeps_its_finished_rows(
        self, pair, fleet_env, tiny_model, tmp_path
    ):
        source = write_workload(
            tmp_path / "prompts.jsonl", requests=3000, max_tokens=(96, 160), seed=2
        )
        expected = expected_rows(source)
        job = fleet_env.submit(source, tiny_model, shard_size=500, max_tokens=160)

        def some_rows_committed():
            current, _ = load_job(fleet_env, job.id)
            assert not current.status.is_final, current.status
            return current.request_completed >= 100

        wait_for(some_rows_committed, timeout=120, what="the first checkpoints")
        cancelled_at = time.monotonic()
        result = fleet_env.cli("cancel", job.id)
        command_took = time.monotonic() - cancelled_at
        assert result.returncode == 0, result.stderr
        assert f"{job.id}: cancelling" in result.stdout

        job = wait_until_final(fleet_env, job.id, timeout=30)
        took = time.monotonic() - cancelled_at
        job, shards = load_job(fleet_env, job.id)

        assert job.status is JobStatus.CANCELLED
        # Measured from the command's return: its own start-up is slow on two busy cores.
        assert took - command_took < 5, f"the job ended {took - command_took:.1f}s after cancel"
        rows = output_rows(fleet_env, job.id)
        assert_each_line_at_most_once(rows, expected)
        assert len(rows) == job.request_completed + job.request_failed
        assert 100 <= len(rows) < 3000
        assert {s.status for s in shards} <= {ShardStatus.COMPLETED, ShardStatus.CANCELLED}
        assert sum(s.status is ShardStatus.CANCELLED for s in shards) >= 4
        assert sum(s.rows_ok + s.rows_failed for s in shards) == len(rows)
        assert job.shards_done == job.shards_total == 6
        storage = Storage.of(fleet_env.settings)
        assert not storage.exists(f"{storage.output_dir(job.id)}/{SUCCESS_NAME}")
        print(
            f"\ncancel: job ended cancelled {took:.1f}s after `batchllm cancel` started "
            f"({took - command_took:.1f}s after it returned), kept {len(rows)} of 3000 rows"
        )

    def test_a_job_for_a_model_no_worker_serves_stays_queued_and_blocks_nothing(
        self, pair, fleet_env, tiny_model, tmp_path
    ):
        unserved_model = tmp_path / "a-model-no-worker-serves"
        source = write_workload(
            tmp_path / "prompts.jsonl", requests=400, max_tokens=(8, 32), seed=3
        )
        unserved = fleet_env.submit(source, unserved_model, shard_size=200)
        served = fleet_env.submit(source, tiny_model, shard_size=200)

        served = wait_until_final(fleet_env, served.id, timeout=120)
        assert served.status is JobStatus.COMPLETED, served.error
        assert_exactly_once(output_rows(fleet_env, served.id), expected_rows(source))

        job, shards = load_job(fleet_env, unserved.id)
        assert job.status is JobStatus.QUEUED
        assert (job.request_completed, job.started_at) == (0, None)
        assert [(s.status, s.attempts, s.worker) for s in shards] == [
            (ShardStatus.QUEUED, 0, None)
        ] * 2
        assert fleet_env.redis.llen(queue_for_model(str(unserved_model))) == 2
        assert output_rows(fleet_env, unserved.id) == []

        result = fleet_env.cli("cancel", unserved.id)
        assert result.returncode == 0, result.stderr
        assert load_job(fleet_env, unserved.id)[0].status is JobStatus.CANCELLED


class TestWorkerCrash:
    """Its own pair of workers: one of them is killed."""

    def test_a_job_survives_kill_9_of_a_worker_mid_shard_with_every_row_exactly_once(
        self, pair, fleet_env, tiny_model, tmp_path
    ):
        source = write_workload(
            tmp_path / "prompts.jsonl", requests=2400, max_tokens=(32, 96), seed=4
        )
        expected = expected_rows(source)
        job = fleet_env.submit(source, tiny_model, shard_size=600, max_tokens=96)
        workers = {w.name: w for w in pair}

        def shard_mid_way():
            # Running, past a few checkpoints, with plenty left to lose.
            for shard in load_job(fleet_env, job.id)[1]:
                if (
                    shard.status is ShardStatus.RUNNING
                    and shard.worker in workers
                    and 100 <= shard.rows_ok + shard.rows_failed <= shard.rows - 200
                ):
                    return shard
            return None

        victim_shard = wait_for(
            shard_mid_way, timeout=180, what="a shard past its checkpoints", interval=0.1
        )
        victim = workers[victim_shard.worker]
        victim.kill()
        killed_at = time.monotonic()
        survivor = next(w for w in pair if w is not victim)
        committed = checkpoints_of(fleet_env, victim_shard.id)
        committed_rows = sum(c.rows for c in committed)
        assert committed and committed_rows < victim_shard.rows

        def taken_over():
            shard = next(s for s in load_job(fleet_env, job.id)[1] if s.id == victim_shard.id)
            return shard.attempts >= 2

        wait_for(
            taken_over, timeout=240, what="the killed worker's shard to be taken over", interval=0.5
        )
        recovered = time.monotonic() - killed_at
        job = wait_until_final(fleet_env, job.id, timeout=240)
        finished = time.monotonic() - killed_at
        job, shards = load_job(fleet_env, job.id)

        assert job.status is JobStatus.COMPLETED, job.error
        rows = output_rows(fleet_env, job.id)
        assert_exactly_once(rows, expected)
        assert job.request_completed == 2400 and job.request_failed == 0
        assert [s.status for s in shards] == [ShardStatus.COMPLETED] * 4
        shard = next(s for s in shards if s.id == victim_shard.id)
        assert shard.attempts >= 2
        assert shard.worker == survivor.name
        assert shard.rows_ok == shard.rows
        after = checkpoints_of(fleet_env, shard.id)
        assert [c.seq for c in after] == list(range(len(after)))
        assert [c.path for c in after[: len(committed)]] == [c.path for c in committed]
        assert sum(c.rows for c in after) == shard.rows
        assert survivor.proc.poll() is None
        print(
            f"\nkill -9: {victim.name} killed on shard {shard.index} after {committed_rows} of "
            f"{shard.rows} rows were committed ({len(committed)} checkpoints); {survivor.name} "
            f"took it over {recovered:.0f}s later (attempts {shard.attempts}) and ran the other "
            f"{shard.rows - committed_rows} rows; job completed {finished:.0f}s after the kill"
        )
