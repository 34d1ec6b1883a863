"""The `batchllm` command over a real (SQLite) database, without an engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from batchllm.cli import cli
from batchllm.execution.finalize import finalize_job
from batchllm.jobs.create import create_job
from batchllm.output.parts import part_name
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store import leases, service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, ShardStatus
from tests.support.cli import invoke
from tests.support.file_jobs import create_from_file
from tests.support.inputs import source_of
from tests.support.output_rows import OutputRow, record_part, write_part

REPO = Path(__file__).resolve().parents[2]


def command_paths(group: click.Group = cli, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            paths += command_paths(command, prefix + (name,))
        else:
            paths.append(prefix + (name,))
    return paths


@pytest.mark.parametrize("path", command_paths(), ids=lambda p: " ".join(p) or "batchllm")
def test_help_of_every_command_works(path):
    result = invoke(*path, "--help")

    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: batchllm {' '.join(path)}".rstrip())


def test_the_expected_commands_exist():
    assert {
        ("run",),
        ("status",),
        ("jobs",),
        ("results",),
        ("cancel",),
        ("db", "upgrade"),
        ("demo-model",),
    } <= set(command_paths())


def test_version_option_prints_the_version():
    from batchllm import __version__

    result = invoke("--version")

    assert result.exit_code == 0
    assert __version__ in result.output


@pytest.fixture
def finished_job(settings, tmp_path) -> str:
    """A job taken through the real service path by hand: two ok rows, one error row."""
    source = tmp_path / "prompts.jsonl"
    source.write_text(
        '{"custom_id": "a", "prompt": "hello"}\n'
        '{"prompt": ""}\n'
        '{"custom_id": "c", "messages": [{"role": "user", "content": "hi"}]}\n'
    )
    job_id = create_from_file(
        source, JobSpec(model="/models/fake", metadata={"team": "cli"}), settings, shard_size=10
    ).job.id
    storage = Storage.of(settings)
    rows = [
        OutputRow("a", 1, "ok", "first answer", "length", 2, 7),
        OutputRow.failed("line-2", 2, "field 'prompt': prompt is blank"),
        OutputRow("c", 3, "ok", "second answer", "stop", 5, 3),
    ]
    with session_scope(settings) as session:
        (shard,) = session.get(Job, job_id).shards
        leases.claim_shard(session, shard.id, "test-worker")
        service.mark_generation_started(session, job_id)
        path = write_part(storage, storage.output_dir(job_id), part_name(0, 0), rows)
        record_part(session, job_id, shard.id, 0, path, rows=(2, 1), tokens=(7, 10), seconds=0.5)
        assert (
            state_machine.end_shard(session, shard.id, ShardStatus.COMPLETED)
            is JobStatus.FINALIZING
        )
    finalize_job(job_id, settings=settings, hardware="fake CPU", vllm_version="0.0-test")
    return job_id


def test_status_shows_a_finished_job_by_id_prefix(finished_job):
    result = invoke("status", finished_job[:12])

    assert result.exit_code == 0, result.output
    assert f"job        {finished_job}" in result.output
    assert "status     completed" in result.output
    assert "requests   3/3 done: 2 ok, 1 error" in result.output
    assert "tokens     7 prompt, 10 completion" in result.output
    assert "hardware   fake CPU, vLLM 0.0-test" in result.output


def test_status_json_carries_counts_throughput_and_shards(finished_job, settings):
    result = invoke("status", finished_job, "--json")

    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["id"] == finished_job
    assert data["status"] == "completed"
    assert data["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert data["progress"] == 1.0
    assert data["metadata"] == {"team": "cli"}
    throughput = data["throughput"]
    assert throughput["requests_per_s"] > 0
    assert throughput["output_tokens_per_s"] > 0
    assert (throughput["prompt_tokens"], throughput["completion_tokens"]) == (7, 10)
    assert (throughput["hardware"], throughput["vllm_version"]) == ("fake CPU", "0.0-test")
    assert [
        (s["index"], s["status"], s["ok"], s["failed"], s["worker"]) for s in data["shards"]
    ] == [(0, "completed", 2, 1, "test-worker")]
    assert data["output_dir"] == Storage.of(settings).output_dir(finished_job)


def test_jobs_lists_the_finished_job_and_filters_by_status(finished_job):
    listed = invoke("jobs")
    failed_only = invoke("jobs", "--status", "failed")

    assert listed.exit_code == 0, listed.output
    header, row = listed.output.splitlines()
    assert header.split()[:5] == ["job", "status", "created", "done", "errors"]
    assert row.split()[0] == finished_job
    assert row.split()[1] == "completed"
    assert "3/3" in row.split()
    assert failed_only.output.strip() == "no jobs"


def test_results_prints_the_output_directory_or_the_first_rows(finished_job, settings):
    where = invoke("results", finished_job)
    head = invoke("results", finished_job, "--head", "2")

    assert where.output.strip() == Storage.of(settings).output_dir(finished_job)
    lines = head.output.splitlines()
    assert len(lines) == 3
    assert lines[1].split()[:4] == ["1", "a", "ok", "7"]
    assert lines[2].split()[:3] == ["2", "line-2", "error"]
    assert "prompt is blank" in lines[2]


def test_status_of_an_unknown_job_exits_1_with_one_error_line(settings):
    result = invoke("status", "job_nothere")

    assert result.exit_code == 1
    assert result.output.strip() == "error: no job 'job_nothere'"


def test_cancel_of_a_finished_job_is_refused(finished_job):
    result = invoke("cancel", finished_job)

    assert result.exit_code == 1
    assert f"job {finished_job} is already completed" in result.output


def test_run_on_a_missing_file_exits_nonzero_naming_the_file_and_creates_no_job(settings, tmp_path):
    missing = tmp_path / "no-such-prompts.jsonl"

    result = invoke("run", str(missing), "--model", "/models/fake")

    assert result.exit_code != 0
    assert str(missing) in result.output
    assert "Traceback" not in result.output
    assert invoke("jobs").output.strip() == "no jobs"


def test_run_rejects_metadata_that_is_not_key_value(settings, tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_text('{"prompt": "x"}\n')

    result = invoke("run", str(source), "--model", "/models/fake", "--metadata", "novalue")

    assert result.exit_code == 2
    assert "'novalue' is not KEY=VALUE" in result.output


def run_python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


HEAVY = "sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))"


def test_importing_the_cli_loads_neither_vllm_nor_torch():
    out = run_python(f"import sys, json, batchllm.cli\nprint(json.dumps({HEAVY}))")

    assert json.loads(out) == []


def test_help_of_every_command_loads_neither_vllm_nor_torch():
    code = (
        "import sys, json\n"
        "from click.testing import CliRunner\n"
        "from batchllm.cli import cli\n"
        "for name in list(cli.commands):\n"
        "    assert CliRunner().invoke(cli, [name, '--help']).exit_code == 0, name\n"
        f"print(json.dumps({HEAVY}))\n"
    )

    assert json.loads(run_python(code)) == []


def test_the_progress_line_shows_a_rate_only_after_a_second_of_rows(monkeypatch, capsys):
    from batchllm.cli import progress as progress_module

    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    bar = progress_module.Progress(1000)
    bar.advance(10, 500)
    bar.draw(force=True)
    clock[0] += 2.0
    bar.advance(90, 9_500)
    bar.draw(force=True)

    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[-2].strip() == "10/1,000 rows (  1.0%)"
    assert lines[-1].strip() == "100/1,000 rows ( 10.0%)  5,000 out tok/s  eta 18s"


def test_run_with_the_instant_engine_completes_a_job_with_filler_text(
    settings, tokenizer, tmp_path
):
    """`run --engine instant`: the whole job (validation, error rows, Parquet, the summary)
    with no vLLM; every row says its hardware was the instant engine."""
    model = Path(tokenizer.name_or_path)
    source = tmp_path / "p.jsonl"
    source.write_text('{"prompt": "hello"}\n{"prompt": "hi", "max_tokens": 3}\nnot json\n')
    result = invoke(
        "run", str(source), "--model", str(model), "--engine", "instant", "--max-tokens", "5"
    )
    assert result.exit_code == 0, result.output
    assert "requests   3/3 done: 2 ok, 1 error" in result.output
    assert "hardware   none (instant engine)" in result.output
    with session_scope(settings) as session:
        job = session.query(Job).one()
        assert (job.status, job.completion_tokens) == (JobStatus.COMPLETED, 5 + 3)


def test_run_with_the_instant_engine_refuses_an_embedding_job(settings, tokenizer, tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_text('{"input": "hello"}\n')
    result = invoke("run", str(source), "--model", tokenizer.name_or_path, "--engine", "instant")
    assert result.exit_code != 0
    assert "--engine instant simulates text generation only" in result.output
