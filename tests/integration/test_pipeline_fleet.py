"""Pipelines on the fleet (issue 35): `submit --from` on a completed job and `pipeline submit`,
through real Redis, PostgreSQL (the pipeline's stage labels are read with PostgreSQL's JSON
operators) and a Celery worker process on the instant engine. The subject is orchestration
and the joins on custom_id, not generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobParent, JobStatus
from tests.support.fleet import INSTANT_ARGS, start_workers, stop_workers
from tests.support.job_checks import output_rows, wait_until_final

pytestmark = pytest.mark.integration


def test_submit_from_and_a_pipeline_file_run_on_the_fleet_joined_on_custom_id(
    fleet_env, tiny_model, tmp_path
):
    (worker,) = start_workers(
        ["pipeline1"],
        fleet_env=fleet_env,
        model=tiny_model,
        log_dir=tmp_path,
        engine_args=INSTANT_ARGS,
        ready_timeout=120,
    )
    try:
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
    finally:
        stop_workers([worker])
