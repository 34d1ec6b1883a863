"""Shard leases: a worker that lost its shard can no longer write, and dead workers' shards
are put back within a lease instead of waiting for the broker's visibility timeout."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from batchllm.errors import ShardBusy, ShardLost
from batchllm.execution.finalize import finalize_job
from batchllm.jobs.create import create_job
from batchllm.output import commit
from batchllm.output.parts import part_name
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store import leases, service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Checkpoint, Job, JobStatus, Shard, ShardStatus, utcnow
from tests.support import fake_runs
from tests.support.inputs import source_of
from tests.support.output_rows import OutputRow, record_part, write_part


def make_job(settings, tmp_path: Path, rows: int = 4) -> tuple[str, int]:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(rows)))
    created = create_job(
        source_of(source, settings), JobSpec(model="m"), shard_size=rows, settings=settings
    )
    with session_scope(settings) as session:
        return created.job.id, session.get(Job, created.job.id).shards[0].id


def age_heartbeat(settings, shard_id: int, seconds: float) -> None:
    fake_runs.age_heartbeat(settings, shard_id, timedelta(seconds=seconds))


def checkpoint(session, job_id: str, shard_id: int, seq: int, attempt: int) -> None:
    record_part(
        session,
        job_id,
        shard_id,
        seq,
        f"p{seq}",
        rows=(1, 0),
        tokens=(2, 3),
        seconds=0.1,
        attempt=attempt,
    )


def test_a_worker_whose_shard_was_taken_over_cannot_record_checkpoints(settings, tmp_path):
    job_id, shard_id = make_job(settings, tmp_path)
    with session_scope(settings) as session:
        first = leases.claim_shard(session, shard_id, "w1", lease_seconds=60).attempts
    age_heartbeat(settings, shard_id, 120)
    with session_scope(settings) as session:
        second = leases.claim_shard(session, shard_id, "w2", lease_seconds=60).attempts
    assert (first, second) == (1, 2)

    with pytest.raises(ShardLost), session_scope(settings) as session:
        checkpoint(session, job_id, shard_id, 0, attempt=first)
    with session_scope(settings) as session:
        checkpoint(session, job_id, shard_id, 0, attempt=second)
        assert leases.heartbeat(session, {shard_id: first}) == {shard_id}
        assert leases.heartbeat(session, {shard_id: second}) == set()
        # The stale attempt cannot end the shard either; the owner can.
        assert (
            state_machine.end_shard(session, shard_id, ShardStatus.COMPLETED, attempt=first) is None
        )
        assert session.get(Shard, shard_id).status is ShardStatus.RUNNING
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert (job.request_completed, job.completion_tokens) == (1, 3)
        assert len(commit.checkpoints_of(session, shard_id)) == 1


def test_a_fresh_heartbeat_keeps_a_redelivered_shard_with_its_worker(settings, tmp_path):
    _, shard_id = make_job(settings, tmp_path)
    with session_scope(settings) as session:
        leases.claim_shard(session, shard_id, "w1", lease_seconds=60)
    with pytest.raises(ShardBusy), session_scope(settings) as session:
        leases.claim_shard(session, shard_id, "w2", lease_seconds=60)


def test_stale_running_shards_are_queued_again_once(settings, tmp_path):
    _, shard_id = make_job(settings, tmp_path)
    with session_scope(settings) as session:
        leases.claim_shard(session, shard_id, "w1", lease_seconds=60)
    with session_scope(settings) as session:
        assert leases.requeue_stale_shards(session, lease_seconds=60) == []
    age_heartbeat(settings, shard_id, 120)
    with session_scope(settings) as session:
        moved = leases.requeue_stale_shards(session, lease_seconds=60)
        # With the job's spec: the caller sends the shard to the queue of the job's kind.
        assert [(moved_id, spec["model"]) for moved_id, spec in moved] == [(shard_id, "m")]
    with session_scope(settings) as session:
        assert leases.requeue_stale_shards(session, lease_seconds=60) == []
        assert session.get(Shard, shard_id).status is ShardStatus.QUEUED
        assert leases.claim_shard(session, shard_id, "w2", lease_seconds=60).attempts == 2


def test_finalizing_removes_part_files_no_checkpoint_records(settings, tmp_path):
    job_id, shard_id = make_job(settings, tmp_path, rows=2)
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job_id)
    rows = [
        OutputRow(
            custom_id=f"line-{n}",
            line=n,
            status="ok",
            text="x",
            prompt_tokens=2,
            completion_tokens=3,
        )
        for n in (1, 2)
    ]
    with session_scope(settings) as session:
        attempt = leases.claim_shard(session, shard_id, "w1").attempts
        kept = write_part(storage, out_dir, part_name(0, 0, attempt), rows)
        record_part(
            session,
            job_id,
            shard_id,
            0,
            kept,
            rows=(2, 0),
            tokens=(4, 6),
            seconds=0.1,
            attempt=attempt,
        )
        # A zombie's file with the same rows, never checkpointed.
        write_part(storage, out_dir, part_name(0, 0, attempt + 5), rows)
        assert (
            state_machine.end_shard(session, shard_id, ShardStatus.COMPLETED, attempt=attempt)
            is JobStatus.FINALIZING
        )

    finalize_job(job_id, settings=settings, hardware="test", vllm_version="0")

    assert [n for n in storage.listdir(out_dir) if n.startswith("part-")] == [
        part_name(0, 0, attempt)
    ]
    with session_scope(settings) as session:
        assert session.get(Job, job_id).status is JobStatus.COMPLETED
        assert session.query(Checkpoint).count() == 1


def _rows(lines: range) -> list[OutputRow]:
    return [
        OutputRow(custom_id=f"line-{n}", line=n, status="ok", text="x", prompt_tokens=2)
        for n in lines
    ]


def test_a_run_paused_since_its_claim_keeps_what_the_run_that_took_over_recorded(
    settings, tmp_path
):
    """The chaos long run's lost shard: a worker claims a shard and reads its checkpoints (none),
    is paused past its lease before it lists the shard's files; another worker takes the shard
    over, writes and records every part. The paused one, back, must not delete those files as
    unrecorded: its list of checkpoints is older than they are."""
    job_id, shard_id = make_job(settings, tmp_path, rows=4)
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job_id)
    with session_scope(settings) as session:
        first = leases.claim_shard(session, shard_id, "w1", lease_seconds=10).attempts
        read_at_claim = commit.checkpoints_of(session, shard_id)
    assert read_at_claim == []
    # w1 pauses; its shard goes back and w2 runs it to the end.
    age_heartbeat(settings, shard_id, 60)
    with session_scope(settings) as session:
        assert [moved for moved, _ in leases.requeue_stale_shards(session, 10)] == [shard_id]
    with session_scope(settings) as session:
        second = leases.claim_shard(session, shard_id, "w2", lease_seconds=10).attempts
    assert second == first + 1
    taken_over = write_part(storage, out_dir, part_name(0, 0, second), _rows(range(1, 5)))
    with session_scope(settings) as session:
        checkpoint(session, job_id, shard_id, 0, second)
    # An older attempt's file no checkpoint records (a worker that died before its commit).
    orphan = part_name(0, 0, first - 1 if first > 1 else 0)

    write_part(storage, out_dir, orphan, _rows(range(1, 3)))
    done = commit.resume_shard(storage, out_dir, 0, read_at_claim, first)

    names = [n for n in storage.listdir(out_dir) if n.startswith("part-")]
    assert names == [part_name(0, 0, second)], names
    assert Path(taken_over).exists()
    assert done == set()  # w1 resumes nothing: its next commit is fenced (ShardLost)


def test_a_resume_deletes_an_earlier_attempts_unrecorded_file(settings, tmp_path):
    job_id, shard_id = make_job(settings, tmp_path, rows=4)
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job_id)
    with session_scope(settings) as session:
        attempt = leases.claim_shard(session, shard_id, "w1", lease_seconds=10).attempts
    left = part_name(0, 0, attempt)  # written, then its worker died before the commit
    write_part(storage, out_dir, left, _rows(range(1, 5)))
    age_heartbeat(settings, shard_id, 60)
    with session_scope(settings) as session:
        again = leases.claim_shard(session, shard_id, "w2", lease_seconds=10).attempts
        committed = commit.checkpoints_of(session, shard_id)

    assert commit.resume_shard(storage, out_dir, 0, committed, again) == set()
    assert [n for n in storage.listdir(out_dir) if n.startswith("part-")] == []
