"""A shard taken over mid-run: another worker claims it after the first one's lease ran out
(the first one was paused, not dead). The first runner stops at its next heartbeat or commit,
aborts its requests and records nothing more; the new owner finishes the shard, every line
exactly once."""

from __future__ import annotations

import collections
import posixpath
from datetime import timedelta

import pytest
from sqlalchemy import update

from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.jobs.create import create_job
from batchllm.output import commit
from batchllm.output.parts import part_name
from batchllm.storage import Storage
from batchllm.store import leases, service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus, utcnow
from tests.support.fake_runs import (
    FakeEngine,
    age_heartbeat,
    make_spec,
    output_rows,
    part_files,
    small_commits,
    write_items,
)
from tests.support.file_jobs import create_from_file
from tests.support.inputs import source_of

ROWS = 40
# A commit follows step 1 (a job's first rows at once), then every 5 rows: step 10 is the next
# commit after the takeover.
TAKEOVER_STEP = 9


def recorded_paths(settings, shard_id: int) -> list[str]:
    with session_scope(settings) as session:
        return [c.path for c in commit.checkpoints_of(session, shard_id)]


def take_over(settings, shard_id: int, worker: str) -> int:
    """Another worker's claim after this shard's lease ran out; returns its attempt."""
    age_heartbeat(settings, shard_id, timedelta(hours=1))
    with session_scope(settings) as session:
        claimed = leases.claim_shard(session, shard_id, worker, settings.lease_seconds)
        assert claimed is not None
        return claimed.attempts


# The first runner notices at its next heartbeat (checked after every step here), or, with
# heartbeats far apart, when its next commit (after the next step) is refused by the fence.
@pytest.mark.parametrize(
    ("control_interval", "steps_after", "noticed"),
    [
        (0.0, 0, "its lease ran out and another worker took it over"),
        (3600.0, 1, "is no longer run by attempt 1"),
    ],
    ids=["heartbeat", "commit-fence"],
)
def test_a_runner_whose_shard_was_taken_over_stops_and_the_new_owner_finishes_it_exactly_once(
    control_interval, steps_after, noticed, small_commits, tmp_path, monkeypatch, caplog
):
    settings = small_commits
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", control_interval)
    created = create_from_file(
        write_items(tmp_path / "in.jsonl", ROWS), make_spec(), settings, shard_size=ROWS
    )
    job_id = created.job.id
    with session_scope(settings) as session:
        (shard_id,) = [s.id for s in session.get(Job, job_id).shards]
    at_takeover: dict = {}

    def takeover_at_step(step: int) -> None:
        if step == TAKEOVER_STEP:
            at_takeover["paths"] = recorded_paths(settings, shard_id)
            at_takeover["parts"] = sorted(part_files(settings, job_id))
            at_takeover["attempt"] = take_over(settings, shard_id, "w2")

    first = FakeEngine(on_step=takeover_at_step)

    outcomes = ShardRunner(first, worker="w1", settings=settings).run([shard_id])

    assert outcomes == {shard_id: Outcome.LOST}
    assert at_takeover["attempt"] == 2
    assert first.aborted
    assert not first.has_unfinished()
    assert first.step_count == TAKEOVER_STEP + steps_after
    assert any(noticed in r.getMessage() for r in caplog.records)
    kept = recorded_paths(settings, shard_id)
    assert kept == at_takeover["paths"]
    assert [posixpath.basename(p) for p in kept] == [
        part_name(0, seq, 1) for seq in range(len(kept))
    ]
    # w1 wrote no part file after the takeover (a refused commit deletes its file).
    assert sorted(part_files(settings, job_id)) == at_takeover["parts"]
    committed_rows = output_rows(settings, job_id)
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_id)
        assert (shard.status, shard.worker, shard.attempts) == (ShardStatus.RUNNING, "w2", 2)
        assert shard.rows_ok == len(committed_rows)
        job = session.get(Job, job_id)
        assert job.status is JobStatus.IN_PROGRESS
        assert job.request_completed == len(committed_rows)
    assert 0 < len(committed_rows) < ROWS

    second = FakeEngine()
    outcomes = ShardRunner(second, worker="w2", settings=settings).run([shard_id])

    assert outcomes == {shard_id: Outcome.COMPLETED}
    assert len(second.prompts_added) == ROWS - len(committed_rows)
    rows = output_rows(settings, job_id)
    assert collections.Counter(r["line"] for r in rows) == collections.Counter(range(1, ROWS + 1))
    assert sorted(r["custom_id"] for r in rows) == sorted(f"item-{i}" for i in range(ROWS))
    assert all(r["status"] == "ok" for r in rows)
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_id)
        assert (shard.status, shard.worker) == (ShardStatus.COMPLETED, "w2")
        assert shard.rows_ok == ROWS
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED
        assert (job.request_completed, job.request_failed) == (ROWS, 0)
        assert job.completion_tokens == sum(r["completion_tokens"] for r in rows)
    storage = Storage.of(settings)
    on_disk = {posixpath.join(storage.output_dir(job_id), n) for n in part_files(settings, job_id)}
    assert on_disk == set(recorded_paths(settings, shard_id))
