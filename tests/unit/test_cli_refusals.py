"""Hopeless commands are refused with one clear line, before any job exists."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from batchllm.cli.options import require_local_model
from batchllm.errors import JobNotFound
from batchllm.jobs.create import create_job
from batchllm.settings import get_settings
from batchllm.spec import JobSpec
from batchllm.store import service
from batchllm.store.db import session_scope
from tests.support.cli import invoke
from tests.support.inputs import source_of


def no_jobs(settings) -> bool:
    """No job row: the database was not even created, or it lists no job."""
    database = settings.home / "batchllm.db"
    return not database.exists() or invoke("jobs").output.strip() == "no jobs"


def test_run_output_that_is_a_file_is_refused_before_the_job(settings, prompts, model_dir):
    taken = prompts.parent / "taken"
    taken.write_text("x")

    result = invoke("run", str(prompts), "--model", str(model_dir), "--output", str(taken))

    assert result.exit_code == 1
    assert result.output.strip() == f"Error: --output {taken}: exists and is not a directory"
    assert no_jobs(settings)


def test_run_output_that_is_a_non_empty_directory_is_refused(settings, prompts, model_dir):
    earlier = prompts.parent / "earlier"
    earlier.mkdir()
    (earlier / "part-s00000-a001-00000.parquet").write_bytes(b"x")

    result = invoke("run", str(prompts), "--model", str(model_dir), "--output", str(earlier))

    assert result.exit_code == 1
    assert f"--output {earlier}: the directory is not empty" in result.output
    assert no_jobs(settings)


def test_run_output_under_a_file_is_refused(settings, prompts, model_dir):
    result = invoke(
        "run", str(prompts), "--model", str(model_dir), "--output", str(prompts / "out")
    )

    assert result.exit_code == 1
    assert result.output.strip() == (
        f"Error: --output {prompts / 'out'}: {prompts} is not a directory"
    )


@contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """Make `directory` refuse new entries to this process: permission bits for a regular
    user; for root, which ignores them, the immutable attribute (chattr +i). Skips when neither
    holds here (the probe must fail, or the test would prove nothing)."""
    directory.chmod(0o555)
    immutable = False
    try:
        if os.geteuid() == 0 and shutil.which("chattr"):
            immutable = subprocess.run(["chattr", "+i", str(directory)]).returncode == 0
        try:
            (directory / "probe").mkdir()
        except OSError:
            yield
            return
        (directory / "probe").rmdir()
        pytest.skip("cannot make a directory unwritable here (root without chattr +i)")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        directory.chmod(0o755)


def test_run_output_in_an_unwritable_directory_is_refused_before_the_job(
    settings, prompts, model_dir, tmp_path
):
    locked = tmp_path / "locked"
    locked.mkdir()
    output = locked / "new" / "out"

    with unwritable(locked):
        result = invoke("run", str(prompts), "--model", str(model_dir), "--output", str(output))

    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"Error: --output {output}: cannot write {locked / 'new'}: ")
    assert no_jobs(settings)
    assert list(locked.iterdir()) == []


def test_run_output_check_leaves_no_trace_of_its_probe(settings, prompts, model_dir, tmp_path):
    from batchllm.cli.run import _require_usable_output

    output = tmp_path / "new" / "out"
    _require_usable_output(output)

    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_named_pipe_as_file_is_refused_at_once(settings, tmp_path, model_dir, command):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    env["BATCHLLM_HOME"] = str(settings.home)

    # A subprocess with a deadline: before the fix the command blocked forever opening the pipe.
    result = subprocess.run(
        [sys.executable, "-m", "batchllm", command, str(fifo), "--model", str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 2
    assert f"{fifo} is not a regular file" in result.stderr
    assert "Traceback" not in result.stderr
    assert no_jobs(settings)


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_directory_as_file_is_called_a_directory(settings, tmp_path, model_dir, command):
    result = invoke(command, str(tmp_path), "--model", str(model_dir))

    assert result.exit_code == 2
    assert f"'{tmp_path}' is a directory" in result.output
    assert "Traceback" not in result.output
    assert no_jobs(settings)


@pytest.mark.parametrize("command", ["run", "submit"])
@pytest.mark.parametrize("content", [b"", b"\n \t\n\r\n", b"\xef\xbb\xbf\n"])
def test_a_file_without_requests_is_refused_and_leaves_no_job(
    settings, tmp_path, model_dir, command, content
):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(content)

    result = invoke(command, str(empty), "--model", str(model_dir))

    assert result.exit_code == 1
    assert result.output.strip() == (
        f"Error: {empty} has no requests (it is empty or has only blank lines)"
    )
    assert no_jobs(settings)


@pytest.mark.parametrize(
    "model",
    [
        "./no-such-model",
        "../no-such-model",
        "/no/such/model",
        "~/no-such-model",
        "models/llama/no-such",
    ],
)
def test_run_with_a_missing_model_path_names_it_and_leaves_no_job(settings, prompts, model):
    result = invoke("run", str(prompts), "--model", model)

    assert result.exit_code == 1
    assert result.output.strip() == (
        f"Error: --model {model}: no such directory, and not a Hugging Face repo id (org/name)"
    )
    assert no_jobs(settings)


@pytest.mark.parametrize("model", ["gpt2", "meta-llama/Llama-3.1-8B-Instruct"])
def test_hugging_face_repo_ids_and_existing_paths_pass_the_model_check(model, model_dir):
    require_local_model(model)
    require_local_model(str(model_dir))


def test_run_refuses_max_tokens_above_the_bound(settings, prompts, model_dir):
    result = invoke("run", str(prompts), "--model", str(model_dir), "--max-tokens", "1048577")

    assert result.exit_code == 2
    assert "1048577 is not in the range 1<=x<=1048576" in result.output


# -- job ids -------------------------------------------------------------------------------------


@pytest.fixture
def job_id(settings, prompts) -> str:
    return create_job(
        source_of(prompts, settings), JobSpec(model="m"), shard_size=10, settings=settings
    ).job.id


@pytest.mark.parametrize("pattern", ["%{tail}", "job_%{tail}", "_{middle}", "job__{middle}"])
def test_like_wildcards_in_a_job_id_prefix_match_only_themselves(settings, job_id, pattern):
    ref = pattern.format(tail=job_id[-6:], middle=job_id[5:12])

    with session_scope(settings) as session, pytest.raises(JobNotFound, match="no job"):
        service.get_job(session, ref)
    result = invoke("cancel", ref)

    assert result.exit_code == 1
    assert result.output.strip() == f"error: no job {ref!r}"
    assert invoke("status", job_id[:10]).exit_code == 0


@pytest.mark.parametrize("ref", ["", "   "])
def test_an_empty_job_id_says_it_is_empty(job_id, ref):
    result = invoke("cancel", ref)

    assert result.exit_code == 1
    assert result.output.strip() == "error: the job id is empty"
    assert "status     queued" in invoke("status", job_id).output


# -- an unreachable database ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["jobs"],
        ["status", "job_x"],
        ["cancel", "job_x"],
        ["submit", "{prompts}", "--model", "gpt2"],
    ],
)
def test_an_unreachable_database_is_one_line_without_the_password(
    settings, monkeypatch, prompts, args
):
    monkeypatch.setenv(
        "BATCHLLM_DATABASE_URL", "postgresql+psycopg://batch:s3cret@127.0.0.1:1/batchllm"
    )
    get_settings.cache_clear()

    result = invoke(*[a.format(prompts=prompts) for a in args])

    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert line.startswith(
        "error: cannot reach the database at postgresql+psycopg://batch:***@127.0.0.1:1/batchllm: "
    )
    assert "s3cret" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_an_error_that_is_not_the_databases_is_not_reworded(settings, monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(service, "list_jobs", broken)

    result = invoke("jobs")

    assert isinstance(result.exception, RuntimeError)
    assert "database" not in result.output
