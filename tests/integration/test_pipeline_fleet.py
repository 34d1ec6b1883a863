"""Pipelines on the fleet (issue 35): `submit --from` on a completed job, `pipeline submit`, and
`submit --after` (a job held `waiting` until its parent completes, failed when the parent is
cancelled), through real Redis, PostgreSQL (the pipeline's stage labels are read with
PostgreSQL's JSON operators) and a Celery worker process on the paced instant engine, whose
reconciler releases waiting jobs. The subject is orchestration and the joins on custom_id,
not generation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from batchllm import Client
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobParent, JobStatus
from tests.support.fleet import PACED_INSTANT_ARGS, Worker, start_workers, stop_workers
from tests.support.job_checks import load_job, output_rows, wait_for, wait_until_final

pytestmark = pytest.mark.integration

RECONCILE_SECONDS = 1.0  # the worker's reconciler: how soon a waiting job is looked at


@pytest.fixture(scope="module")
def worker(fleet_env, tiny_model, tmp_path_factory) -> Iterator[Worker]:
    (started,) = start_workers(
        ["pipeline1"],
        fleet_env=fleet_env,
        model=tiny_model,
        log_dir=tmp_path_factory.mktemp("pipeline-worker"),
        engine_args=PACED_INSTANT_ARGS,
        ready_timeout=120,
        env={"BATCHLLM_RECONCILE_SECONDS": str(RECONCILE_SECONDS)},
    )
    try:
        yield started
    finally:
        stop_workers([started])


def _submit(fleet_env, *args: str) -> str:
    done = fleet_env.cli("submit", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_submit_from_and_a_pipeline_file_run_on_the_fleet_joined_on_custom_id(
    fleet_env, tiny_model, tmp_path, worker
):
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "".join(f'{{"custom_id": "q{i}", "question": "Question {i}?"}}\n' for i in range(40))
        + '{"custom_id": "bad"}\n'
    )
    parent = fleet_env.cli(
        "submit", str(questions), "--model", str(tiny_model),
        "--prompt-template", "Q: {question}", "--max-tokens", "4", "--shard-size", "16",
    )  # fmt: skip
    assert parent.returncode == 0, parent.stderr
    parent_id = parent.stdout.strip()
    assert wait_until_final(fleet_env, parent_id, timeout=180).status is JobStatus.COMPLETED

    child = fleet_env.cli(
        "submit", "--from", parent_id, "--model", str(tiny_model),
        "--prompt-template", "{prompt} -> {text}", "--max-tokens", "2", "--wait",
        timeout=240,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    child_id = child.stdout.strip().splitlines()[0]
    parent_ok = sorted(
        r["custom_id"] for r in output_rows(fleet_env, parent_id) if r["status"] == "ok"
    )
    assert len(parent_ok) == 40
    child_rows = output_rows(fleet_env, child_id)
    assert sorted(r["custom_id"] for r in child_rows) == parent_ok
    assert {r["status"] for r in child_rows} == {"ok"}
    with session_scope(fleet_env.settings) as session:
        (link,) = session.query(JobParent).filter_by(child_id=child_id).all()
        assert link.parent_id == parent_id
    status = fleet_env.cli("status", parent_id)
    assert f"children   {child_id}" in status.stdout

    pipeline = tmp_path / "qa.toml"
    pipeline.write_text(
        f"""
[[stage]]
name = "answer"
input = "q.jsonl"
model = "{tiny_model}"
prompt_template = "Q: {{question}}"
max_tokens = 3

[[stage]]
name = "judge"
from = "answer"
model = "{tiny_model}"
prompt_template = "{{prompt}} / {{text}}: right?"
max_tokens = 2
"""
    )
    first = fleet_env.cli("pipeline", "submit", str(pipeline), "--poll", "0.5", timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("submitted") == 2
    again = fleet_env.cli("pipeline", "submit", str(pipeline), timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("completed before: not run again") == 2
    with session_scope(fleet_env.settings) as session:
        stages = {
            j.job_metadata["stage"]: j.id
            for j in session.query(Job).all()
            if j.job_metadata.get("pipeline") == "qa"
        }
    assert set(stages) == {"answer", "judge"}
    judged = sorted(r["custom_id"] for r in output_rows(fleet_env, stages["judge"]))
    assert judged == parent_ok


def _lines(path: Path, count: int) -> Path:
    path.write_text(
        "".join(f'{{"custom_id": "r{i}", "prompt": "row {i}"}}\n' for i in range(count))
    )
    return path


def test_a_job_submitted_after_another_waits_and_starts_once_it_completed(
    fleet_env, tiny_model, tmp_path, worker
):
    # Submitted from this process (no CLI start-up between the two): paced at 20 ms a token,
    # a shard of 20 rows of 64 tokens takes at least 1.3 s on any machine and the one worker
    # runs the 5 shards one after the other, so the parent runs 6 s or more, long past the
    # child's submission. (`submit --after` through the CLI: the cancel test below.)
    client = Client(fleet_env.settings)
    parent = client.submit(
        _lines(tmp_path / "p.jsonl", 100), model=str(tiny_model), max_tokens=64, shard_size=20
    ).id
    child_job = client.submit(
        _lines(tmp_path / "c.jsonl", 5), model=str(tiny_model), max_tokens=4, after=[parent]
    )
    child = child_job.id
    assert child_job.status == "waiting"
    job, shards = load_job(fleet_env, child)
    assert load_job(fleet_env, parent)[0].status in (JobStatus.QUEUED, JobStatus.IN_PROGRESS)
    assert job.status is JobStatus.WAITING
    assert {s.dispatched_at for s in shards} == {None}  # no task sent for a waiting job
    status = fleet_env.cli("status", child)
    assert f"after      {parent}" in status.stdout

    child_job = wait_until_final(fleet_env, child, timeout=180)
    parent_job, _ = load_job(fleet_env, parent)
    assert (parent_job.status, child_job.status) == (JobStatus.COMPLETED, JobStatus.COMPLETED)
    assert child_job.started_at >= parent_job.finished_at
    assert len(output_rows(fleet_env, child)) == 5
    assert f"children   {child}" in fleet_env.cli("status", parent).stdout


def test_a_job_after_a_cancelled_parent_fails_naming_it(fleet_env, tiny_model, tmp_path, worker):
    model = ("--model", str(tiny_model))
    # 2,000 rows of 64 tokens in shards of 100: 25 s or more at this pace, so the cancel
    # comes while it runs.
    parent = _submit(fleet_env, str(_lines(tmp_path / "p.jsonl", 2000)), *model,
                     "--max-tokens", "64", "--shard-size", "100")  # fmt: skip
    child = _submit(fleet_env, str(_lines(tmp_path / "c.jsonl", 5)), *model, "--after", parent)
    wait_for(
        lambda: load_job(fleet_env, parent)[0].status is JobStatus.IN_PROGRESS or None,
        timeout=120,
        what=f"job {parent} to start",
    )
    assert load_job(fleet_env, child)[0].status is JobStatus.WAITING
    cancelled = fleet_env.cli("cancel", parent)
    assert cancelled.returncode == 0, cancelled.stderr

    child_job = wait_until_final(fleet_env, child, timeout=180)
    assert child_job.status is JobStatus.FAILED
    assert child_job.error.startswith(f"parent job {parent} cancelled")
    _, shards = load_job(fleet_env, child)
    assert {s.status.value for s in shards} == {"cancelled"}
    assert output_rows(fleet_env, child) == []

    refused = fleet_env.cli("submit", str(tmp_path / "c.jsonl"), *model, "--after", parent)
    assert refused.returncode == 1
    assert f"--after {parent}: the job cancelled" in refused.stderr
