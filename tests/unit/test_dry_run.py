"""--dry-run (jobs/estimate.py): prompt tokens counted with the model's own tokenizer, the
output bounded by max_tokens, the time from this model's recorded jobs on this hardware; no job
and no engine. And the jobs' `usage` in OpenAI's Batch.usage shape."""

from __future__ import annotations

import json
from datetime import timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchllm import Client
from batchllm.api.objects import batch_object
from batchllm.cli import cli
from batchllm.engine.hardware import machine_label
from batchllm.store.db import session_scope
from batchllm.store.job_view import job_view
from batchllm.store.models import Batch, Job, JobStatus, utcnow


def record_job(settings, model: str, *, hardware: str, tokens: tuple[int, int], wall: float):
    now = utcnow()
    with session_scope(settings) as session:
        session.add(
            Job(
                id=f"job_{abs(hash((hardware, tokens, wall))):016x}"[:20],
                status=JobStatus.COMPLETED,
                model=model,
                spec={},
                input_file="x",
                storage_root="x",
                output_dir="x",
                prompt_tokens=tokens[0],
                completion_tokens=tokens[1],
                wall_seconds=wall,
                hardware=hardware,
                started_at=now - timedelta(seconds=wall),
                finished_at=now,
            )
        )


def test_prompt_tokens_equal_the_tokenizers_and_output_is_bounded_by_max_tokens(
    tiny_model, tokenizer, settings, tmp_path
):
    lines = [
        {"prompt": "the farmer found a stone"},
        {"prompt": "one two three", "max_tokens": 5, "n": 2},
        {"messages": [{"role": "user", "content": "hello there, model"}]},
        {"prompt": ""},  # invalid: an error row, no tokens
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    chat = tokenizer.apply_chat_template(
        lines[2]["messages"], tokenize=False, add_generation_prompt=True
    )
    expected = (
        len(tokenizer.encode(lines[0]["prompt"]))
        + len(tokenizer.encode(lines[1]["prompt"]))
        + len(tokenizer.encode(chat, add_special_tokens=False))
    )

    estimate = Client(settings).dry_run(path, model=str(tiny_model), max_tokens=16)

    assert (estimate.requests, estimate.invalid, estimate.too_long) == (4, 1, 0)
    assert estimate.prompt_tokens == expected
    assert estimate.max_output_tokens == 16 + 5 * 2 + 16
    assert estimate.history is None and estimate.max_wall_seconds is None
    with session_scope(settings) as session:
        assert session.query(Job).count() == 0


def test_a_table_dry_run_counts_its_system_prompt_through_the_chat_template(
    tiny_model, tokenizer, settings, tmp_path
):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a short one", "and another prompt"]}), path)
    expected = sum(
        len(
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": t}],
                    tokenize=False,
                    add_generation_prompt=True,
                ),
                add_special_tokens=False,
            )
        )
        for t in ("a short one", "and another prompt")
    )

    estimate = Client(settings).dry_run(
        path, model=str(tiny_model), prompt_column="text", system="Be brief.", max_tokens=4
    )

    assert (estimate.requests, estimate.prompt_tokens) == (2, expected)
    assert estimate.max_output_tokens == 8


def test_the_time_comes_from_this_models_recorded_jobs_on_this_hardware(
    tiny_model, settings, tmp_path
):
    model, here = str(tiny_model), machine_label()
    record_job(settings, model, hardware=f"{here}, bfloat16", tokens=(3_000, 1_000), wall=10.0)
    record_job(settings, model, hardware=here, tokens=(500, 500), wall=5.0)
    record_job(settings, model, hardware="NVIDIA H100 80GB HBM3", tokens=(10**9, 0), wall=1.0)
    record_job(settings, "other-model", hardware=here, tokens=(10**9, 0), wall=1.0)
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a b c"}\n' * 3)

    estimate = Client(settings).dry_run(path, model=model, max_tokens=10)

    assert estimate.history is not None
    assert (estimate.history.jobs, estimate.history.tokens) == (2, 5_000)
    rate = 5_000 / 15.0
    assert estimate.max_wall_seconds == pytest.approx((estimate.prompt_tokens + 30) / rate)


def test_cli_dry_run_prints_the_figures_and_creates_no_job(tiny_model, settings, tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("id,text\n1,hello world\n2,\n")

    for command in ("run", "submit"):
        result = CliRunner().invoke(
            cli,
            [
                command,
                str(path),
                "--model",
                str(tiny_model),
                "--prompt-column",
                "text",
                "--id-column",
                "id",
                "--max-tokens",
                "7",
                "--dry-run",
            ],
        )
        assert result.exit_code == 0, result.output
        assert "requests       2 (1 invalid, 0 over the model's context" in result.output
        assert "output tokens  at most 7 (every request's max_tokens" in result.output
        assert "time           unknown: no completed job of" in result.output
    with session_scope(settings) as session:
        assert session.query(Job).count() == 0


def test_usage_has_openais_batch_usage_shape_in_the_job_view_and_the_batch_object(settings):
    from openai.types import Batch as OpenAIBatch

    record_job(settings, "m", hardware="x", tokens=(120, 30), wall=2.0)
    with session_scope(settings) as session:
        job = session.query(Job).one()
        view = job_view(job)
        batch = Batch(
            job_id=job.id,
            endpoint="/v1/chat/completions",
            input_file_id="file-1",
            completion_window="24h",
            created_at=utcnow(),
        )
        parsed = OpenAIBatch.model_validate(batch_object(batch, job))

    assert view["usage"] == {
        "input_tokens": 120,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 30,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 150,
    }
    assert parsed.usage is not None
    assert parsed.usage.model_dump() == view["usage"]
