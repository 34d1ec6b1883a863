"""Warm runs (batchllm/warm_runner.py, kept_engine/handoff.py): once a kept engine has served
its first run, it starts a warm runner, and the next `batchllm run`s of this checkout are handed
to it: a forked child runs the command with the caller's terminal, directory and environment.
Real `batchllm` processes in a test's own home, the instant engine (the runner's subject is the
process around the engine, not the engine).

What a test reads to know a run was handed over: the runner's line "run handed over: child N"
in the kept engine's log (the runner writes there), one per handed run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchllm.settings import Settings
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus
from tests.support.kept_engines import (
    KeptHome,
    Running,
    job_id_of,
    pid_alive,
    wait_for,
    write_prompts,
)

pytestmark = pytest.mark.integration

INSTANT = ("--engine", "instant")
KEEP = ("--keep-alive", "5m")
RUN_DEADLINE = 180.0
RUNNER_DEADLINE = 120.0  # the runner imports batchllm, pyarrow and SQLAlchemy: 1-2 s, 30 s busy
HANDED = re.compile(r"run handed over: child (\d+)")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's tokenizer and config, no weights: all the instant engine loads."""
    from batchllm.engine.models.demo_model import build_demo_tokenizer

    return build_demo_tokenizer(tmp_path_factory.mktemp("model") / "tiny-tokenizer")


@pytest.fixture
def kept(settings: Settings, tmp_path: Path) -> Iterator[KeptHome]:
    home = KeptHome.of(settings, tmp_path / "logs")
    try:
        yield home
    finally:
        home.stop_all()


def run_args(source: Path | str, model: Path, *extra: str) -> tuple[str, ...]:
    return ("run", str(source), "--model", str(model), *INSTANT, *KEEP, *extra)


def warm_engine(kept: KeptHome, model: Path, tmp_path: Path) -> tuple[dict, dict]:
    """A kept engine that has served one run, and its warm runner's state file once ready."""
    first = kept.cli(*run_args(write_prompts(tmp_path / "first.jsonl", "first", 3), model))
    assert first.returncode == 0, str(first)
    (engine,) = kept.ready()
    state = kept.engines_dir / f"runner-{engine['id']}.json"

    def runner() -> dict | None:
        try:
            return json.loads(state.read_text())
        except (OSError, ValueError):
            return None

    found = wait_for(
        runner,
        timeout=RUNNER_DEADLINE,
        what=lambda: f"the warm runner of {engine['id']}\n{kept.tail(engine['id'])}",
    )
    assert pid_alive(found["pid"])
    return engine, found


def handed_children(kept: KeptHome, engine: dict) -> list[int]:
    log = (kept.engines_dir / f"{engine['id']}.log").read_text(errors="replace")
    return [int(pid) for pid in HANDED.findall(log)]


def call(kept: KeptHome, args: tuple[str, ...], cwd: Path, **env: str):
    """`batchllm ARGS` from `cwd`, as a user types it there, with `env` added."""
    return subprocess.run(
        [sys.executable, "-m", "batchllm", *args],
        env={**kept.env, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=RUN_DEADLINE,
        stdin=subprocess.DEVNULL,
    )


def job_row(settings: Settings, job_id: str) -> Job:
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job is not None, job_id
        session.expunge(job)
        return job


@pytest.mark.timeout(400)
def test_a_warm_run_runs_in_the_runner_with_the_caller_s_directory_environment_and_output(
    kept: KeptHome, settings: Settings, model: Path, tmp_path: Path
) -> None:
    engine, _ = warm_engine(kept, model, tmp_path)
    before = handed_children(kept, engine)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_prompts(elsewhere / "prompts.jsonl", "w", 12)
    storage = tmp_path / "caller-storage"  # read from the caller's environment, not the runner's

    ran = call(
        kept,
        run_args("prompts.jsonl", model, "--max-tokens", "5", "--output", "copy"),
        elsewhere,
        BATCHLLM_STORAGE=str(storage),
    )

    assert ran.returncode == 0, ran.stderr
    children = handed_children(kept, engine)
    assert len(children) == len(before) + 1, children
    job_id = job_id_of(ran.stderr)
    assert f"job        {job_id}" in ran.stdout and "completed" in ran.stdout, ran.stdout
    assert "copied the output to copy" in ran.stderr
    job = job_row(settings, job_id)
    assert job.status is JobStatus.COMPLETED and job.request_completed == 12
    assert str(job.output_dir).startswith(str(storage)), job.output_dir
    table = pq.read_table(elsewhere / "copy")  # --output, relative to the caller's directory
    assert sorted(table.column("custom_id").to_pylist()) == sorted(f"w-{i}" for i in range(12))
    assert set(table.column("completion_tokens").to_pylist()) == {5}

    # Another checkout's import path (PYTHONPATH) is not the runner's: not handed over.
    other = call(kept, run_args("prompts.jsonl", model), elsewhere, PYTHONPATH=str(tmp_path))
    assert other.returncode == 0, other.stderr
    assert handed_children(kept, engine) == children


@pytest.mark.timeout(400)
def test_a_handed_run_s_errors_and_exit_codes_are_those_of_a_run_in_its_own_process(
    kept: KeptHome, model: Path, tmp_path: Path
) -> None:
    engine, _ = warm_engine(kept, model, tmp_path)
    cases = [
        run_args(tmp_path / "missing.jsonl", model),  # click's usage error: 2
        run_args(write_prompts(tmp_path / "ok.jsonl", "ok", 2), model, "--output", __file__),
    ]
    for args in cases:
        before = handed_children(kept, engine)
        handed = call(kept, args, tmp_path)
        assert len(handed_children(kept, engine)) == len(before) + 1
        alone = call(kept, args, tmp_path, BATCHLLM_WARM_RUNS="false")
        assert len(handed_children(kept, engine)) == len(before) + 1  # not handed over
        assert handed.returncode == alone.returncode != 0, (handed.stderr, alone.stderr)
        assert handed.stderr == alone.stderr and handed.stdout == alone.stdout


def slow_handed_run(
    kept: KeptHome, settings: Settings, engine: dict, model: Path, tmp_path: Path
) -> tuple[Running, int, str]:
    """A paced 200-line run in the background (25 s), once it is handed over and its job has
    rows: the run, the runner's child running it, and its job's id."""
    before = handed_children(kept, engine)
    source = write_prompts(tmp_path / "slow.jsonl", "slow", 200)
    pace = ("--instant-step-seconds", "0.05", "--max-num-seqs", "8", "--max-tokens", "20")
    run = kept.start(*run_args(source, model, *pace))
    child = wait_for(
        lambda: (handed_children(kept, engine)[len(before) :] or [None])[0],
        timeout=RUN_DEADLINE,
        what=lambda: f"the run handed over\n{run.ran()}",
    )
    job_id = wait_for(
        lambda: _progressed(settings, run),
        timeout=RUN_DEADLINE,
        what=lambda: f"progress\n{run.ran()}",
    )
    return run, child, job_id


@pytest.mark.timeout(400)
def test_ctrl_c_reaches_a_handed_run_which_fails_its_job_as_interrupted(
    kept: KeptHome, settings: Settings, model: Path, tmp_path: Path
) -> None:
    engine, _ = warm_engine(kept, model, tmp_path)
    run, child, job_id = slow_handed_run(kept, settings, engine, model, tmp_path)

    os.killpg(run.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the caller's process group
    ran = run.wait(timeout=60)

    assert ran.returncode == 130, str(ran)
    job = job_row(settings, job_id)
    assert job.status is JobStatus.FAILED and job.error == "interrupted", (job.status, job.error)
    wait_for(lambda: not pid_alive(child), timeout=30, what=f"the run's child {child} to end")


@pytest.mark.timeout(400)
def test_a_killed_caller_takes_its_handed_run_with_it_and_engine_stop_ends_the_runner(
    kept: KeptHome, settings: Settings, model: Path, tmp_path: Path
) -> None:
    engine, runner = warm_engine(kept, model, tmp_path)
    run, child, job_id = slow_handed_run(kept, settings, engine, model, tmp_path)

    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(timeout=30)

    wait_for(lambda: not pid_alive(child), timeout=30, what=f"the run's child {child} to end")
    job = job_row(settings, job_id)
    assert job.status is JobStatus.IN_PROGRESS  # as a killed run leaves it (test_run_killed)
    assert pid_alive(runner["pid"]) and pid_alive(engine["pid"])  # they serve the next run

    # `engine stop` ends the runner with its engine, and their files go with them.
    stopped = kept.cli("engine", "stop", "--all")
    assert stopped.returncode == 0, str(stopped)
    wait_for(lambda: not pid_alive(runner["pid"]), timeout=30, what="the runner to end")
    assert not list(kept.engines_dir.glob("runner-*")), list(kept.engines_dir.iterdir())
    assert not Path(runner["socket"]).exists()


def _progressed(settings: Settings, run) -> str | None:
    assert run.proc.poll() is None, f"the run ended early:\n{run.ran()}"
    with session_scope(settings) as session:
        job = session.query(Job).filter(Job.status == JobStatus.IN_PROGRESS).first()
        return job.id if job is not None and job.request_completed else None
