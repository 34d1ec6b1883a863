"""`batchllm retry` on SQLite with the fake engine: which lines run again, the new rows replacing
the old ones (one row per line, also through a crash), counts and the attempts history."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from batchllm import Client, row_errors
from batchllm.engine.protocol import Finished
from batchllm.errors import JobInterrupted, JobStateError
from batchllm.jobs.create import create_job
from batchllm.output.parts import list_parts, read_lines
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Checkpoint, Job, Shard
from tests.support.fake_runs import (
    FakeEngine,
    FakeEngines,
    engine_error,
    item_of,
    make_spec,
    output_rows,
    small_commits,
)
from tests.support.inputs import source_of

__all__ = ["small_commits"]

FAILING = {"item-2", "item-5", "item-9"}


class FlakyEngine(FakeEngine):
    """Ends the requests of the FAILING items with finish reason "error" (the engine's fault,
    as vLLM reports a request it could not finish)."""

    def step(self) -> list[Finished]:
        finished = super().step()
        for i, out in enumerate(finished):
            if out.text.split()[1] in FAILING:
                finished[i] = engine_error(out)
        return finished


def write_requests(path, count: int) -> None:
    """`count` items whose prompts start with their name, then an invalid line and a prompt
    longer than the fake engine's context (64 tokens)."""
    with path.open("w") as out:
        for i in range(count):
            out.write(json.dumps({"custom_id": f"item-{i}", "prompt": f"item-{i} x"}) + "\n")
        out.write('{"custom_id": "bad", "prompt": 3}\n')
        out.write(json.dumps({"custom_id": "long", "prompt": "word " * 80}) + "\n")


def run_flaky(settings, tmp_path, count: int = 12):
    path = tmp_path / "in.jsonl"
    write_requests(path, count)
    client = Client(settings)
    job = client.run(
        path,
        model="/models/fake",
        max_model_len=64,
        max_tokens=3,
        engines=FakeEngines(FlakyEngine()),
    )
    return client, job


def rows_by_id(settings, job_id: str) -> dict[str, dict]:
    rows = output_rows(settings, job_id)
    assert sorted(r["line"] for r in rows) == list(range(1, len(rows) + 1))  # one row a line
    return {r["custom_id"]: r for r in rows}


def recorded_rows(settings, job_id: str) -> list[int]:
    """The lines the job's checkpoints record (what counts, whatever files lie around)."""
    storage = Storage.of(settings)
    with session_scope(settings) as session:
        paths = session.scalars(select(Checkpoint.path).join(Shard).where(Shard.job_id == job_id))
        return sorted(line for path in paths for line in read_lines(storage, path))


def test_a_retry_runs_only_the_engines_failures_and_its_rows_replace_the_old_ones(
    small_commits, tmp_path
):
    client, job = run_flaky(small_commits, tmp_path)
    first = rows_by_id(small_commits, job.id)
    assert (job.status, job.completed, job.failed) == ("completed", 9, 5)
    assert {k for k, r in first.items() if r["error_code"] == row_errors.ENGINE_ERROR} == FAILING
    assert first["bad"]["error_code"] == row_errors.INVALID_REQUEST
    assert first["long"]["error_code"] == row_errors.CONTEXT_LENGTH_EXCEEDED

    healthy = FakeEngine()
    retried = client.retry(job, engines=FakeEngines(healthy))

    # Only the failed lines ran, once each.
    assert sorted(item_of(p) for p in healthy.prompts_added) == sorted(FAILING)
    rows = rows_by_id(small_commits, job.id)
    assert len(rows) == 14
    assert all(rows[k]["status"] == "ok" and rows[k]["text"] == f"echo {k} x" for k in FAILING)
    assert rows["bad"]["status"] == rows["long"]["status"] == "error"
    assert {k: r for k, r in rows.items() if k not in FAILING} == {
        k: r for k, r in first.items() if k not in FAILING
    }
    assert (retried.status, retried.completed, retried.failed) == ("completed", 12, 2)
    assert recorded_rows(small_commits, job.id) == list(range(1, 15))
    assert [(a["attempt"], a["lines"], a["status"]) for a in retried.attempts] == [
        (1, 14, "completed"),
        (2, 3, "completed"),
    ]
    with session_scope(small_commits) as session:
        row = session.get(Job, job.id)
        assert row.completion_tokens == 12 * 3  # the replaced rows' tokens were taken off
        assert sum(s.rows_ok for s in row.shards) == 12
        assert sum(s.rows_failed for s in row.shards) == 2
        assert row.wall_seconds == pytest.approx(
            sum(a["wall_seconds"] for a in row.attempts), rel=1e-6
        )
        assert row.requests_per_s == pytest.approx(14 / row.wall_seconds)

    # Nothing retryable is left; --all-errors runs the two that fail again by themselves.
    with pytest.raises(JobStateError, match=r"nothing to retry.*--all-errors"):
        client.retry(job, engines=FakeEngines(FakeEngine()))
    again = FakeEngine()
    third = client.retry(job, all_errors=True, engines=FakeEngines(again))
    # Neither reaches the engine (refused at validation, over the context): both are error
    # rows again, each replacing its old row.
    assert again.prompts_added == []
    assert (third.completed, third.failed, len(third.attempts)) == (12, 2, 3)
    assert third.attempts[-1]["lines"] == 2 and third.attempts[-1]["all_errors"] is True
    assert len(rows_by_id(small_commits, job.id)) == 14


def test_a_cancelled_job_is_retried_into_the_same_job_to_one_ok_row_per_line(
    small_commits, tmp_path
):
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"item-{i} x", "max_tokens": 2}) + "\n" for i in range(30))
    )

    def cancel_at(step: int) -> None:
        if step == 6:
            with session_scope(small_commits) as session:
                (job_id,) = session.scalars(select(Job.id))
                service.cancel_job(session, job_id)

    client = Client(small_commits)
    job = client.run(
        path,
        model="/models/fake",
        max_model_len=64,
        engines=FakeEngines(FakeEngine(on_step=cancel_at)),
    )
    assert job.status == "cancelled" and 0 < job.completed < 30
    kept = {r["line"]: r for r in output_rows(small_commits, job.id)}

    healthy = FakeEngine()
    retried = client.retry(job, engines=FakeEngines(healthy))

    rows = {r["line"]: r for r in output_rows(small_commits, job.id)}
    assert sorted(rows) == list(range(1, 31))
    assert all(r["status"] == "ok" for r in rows.values())
    assert all(rows[line] == row for line, row in kept.items())  # finished rows untouched
    assert len(healthy.prompts_added) == 30 - len(kept)  # only the lines never answered
    assert (retried.status, retried.completed, retried.failed) == ("completed", 30, 0)
    assert [(a["attempt"], a["lines"], a["status"]) for a in retried.attempts] == [
        (1, 30, "cancelled"),
        (2, 30 - len(kept), "completed"),
    ]


def test_a_job_still_running_is_refused_with_a_clear_message(settings, tmp_path):
    path = tmp_path / "in.jsonl"
    write_requests(path, 2)
    created = create_job(source_of(path, settings), make_spec(), shard_size=10, settings=settings)
    with pytest.raises(JobStateError, match="is still queued: a job is retried once it ended"):
        Client(settings).retry(created.job.id, engines=FakeEngines(FakeEngine()))


def test_a_crash_after_the_new_rows_commit_leaves_the_new_rows_and_the_old_file_goes(
    small_commits, tmp_path, monkeypatch
):
    client, job = run_flaky(small_commits, tmp_path)
    storage = Storage.of(small_commits)
    out_dir = storage.output_dir(job.id)
    before = set(list_parts(storage, out_dir))
    real_delete = Storage.delete
    died = []

    def die_retiring_an_old_part(self, path):
        # Once: a process dies once; what runs after it here is the run's own failure path.
        if path.rsplit("/", 1)[-1] in before and not died:
            died.append(path)
            raise KeyboardInterrupt("simulated death between the commit and the old file")
        real_delete(self, path)

    monkeypatch.setattr(Storage, "delete", die_retiring_an_old_part)
    with pytest.raises(JobInterrupted):
        client.retry(job, engines=FakeEngines(FakeEngine()))
    monkeypatch.setattr(Storage, "delete", real_delete)

    # Committed: each line recorded once, a retried line with its new row; the old file, no
    # longer recorded, still lies there until the shard resumes or the job ends.
    assert recorded_rows(small_commits, job.id) == list(range(1, 15))
    assert before & set(list_parts(storage, out_dir))
    crashed = client.status(job)
    assert crashed.status == "failed"

    finished = client.retry(job, engines=FakeEngines(FakeEngine()))

    rows = rows_by_id(small_commits, job.id)
    assert len(rows) == 14 and all(rows[k]["status"] == "ok" for k in FAILING)
    assert (finished.status, finished.completed, finished.failed) == ("completed", 12, 2)


def test_a_crash_before_the_new_rows_commit_leaves_the_old_rows(
    small_commits, tmp_path, monkeypatch
):
    from batchllm.output import commit

    client, job = run_flaky(small_commits, tmp_path)
    real = commit.record_checkpoint

    def die(session, **kwargs):
        raise KeyboardInterrupt("simulated death before the checkpoint")

    monkeypatch.setattr(commit, "record_checkpoint", die)
    with pytest.raises(JobInterrupted):
        client.retry(job, engines=FakeEngines(FakeEngine()))
    monkeypatch.setattr(commit, "record_checkpoint", real)

    rows = rows_by_id(small_commits, job.id)
    assert len(rows) == 14 and all(rows[k]["status"] == "error" for k in FAILING)
    assert client.status(job).failed == 5

    finished = client.retry(job, engines=FakeEngines(FakeEngine()))
    rows = rows_by_id(small_commits, job.id)
    assert all(rows[k]["status"] == "ok" for k in FAILING)
    assert (finished.completed, finished.failed, len(finished.attempts)) == (12, 2, 3)
