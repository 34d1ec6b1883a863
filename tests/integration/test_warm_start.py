"""The bench's warm part at a small size: a real `batchllm worker` (Redis on 127.0.0.1, a
private SQLite database, vLLM on the tiny model) builds its engine from its flags before it says
ready and runs five different jobs in a row without an engine start (the bench's side-by-side
file, which builds two more engines for `vllm run-batch` and `batchllm run`, is left out here:
tests/engine/test_bench.py runs those contenders)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import psutil
import pytest
import redis

from batchllm.bench.contenders import bench_settings
from batchllm.bench.parts.warm import JOBS, run_warm
from batchllm.bench.processes import EngineLimits
from batchllm.bench.report import warm_text
from batchllm.client import Client
from tests.support.skips import require

pytestmark = pytest.mark.integration

LINES = 20
MAX_TOKENS = 16
LIMITS = EngineLimits(
    max_model_len=512,
    max_num_seqs=64,
    max_num_batched_tokens=4096,
    dtype="auto",
    enforce_eager=True,
)


def test_a_warm_worker_runs_five_jobs_and_a_file_without_an_engine_start(
    tiny_model: Path, tmp_path: Path
):
    require(importlib.util.find_spec("vllm") is not None, "vllm is not installed")
    try:
        redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        require(False, f"Redis is not reachable at 127.0.0.1:6379: {exc}")

    workdir = tmp_path / "warm"
    result = run_warm(
        model=str(tiny_model),
        workdir=workdir,
        limits=LIMITS,
        lines=LINES,
        file_lines=0,
        max_tokens=MAX_TOKENS,
        say=print,
    )
    print(warm_text(result))

    # The worker built its engine from its flags, once, before Celery said ready.
    worker = result["worker"]
    engine = worker["engine"]
    assert engine["max_model_len"] == 512 and engine["task"] == "generate"
    assert 0 < engine["start_seconds"] < worker["ready_seconds"]
    assert worker["engine_starts"] == 1
    log = Path(worker["log"]).read_text()
    name = worker["command"][worker["command"].index("--name") + 1]
    assert log.index("engine ready") < log.index(f"{name} ready.")

    # Five jobs in a row, every row served, none starting an engine.
    jobs = result["jobs"]
    assert [job["label"] for job in jobs] == [job.label for job in JOBS]
    for job in jobs:
        assert (job["rows_ok"], job["rows_failed"]) == (LINES, 0), job
        assert job["engine_starts"] == 0, job
        assert 0 <= job["submit_to_first_row_seconds"] <= job["submit_to_completed_seconds"]
    assert result["jobs_with_engine_starts"] == 0
    assert jobs[4]["explicit_max_model_len"] == 384
    client = Client(bench_settings(workdir / "home"))
    outputs = [client.results(job["job_id"]).to_table().to_pylist() for job in jobs]
    assert all(len(rows) == LINES and {r["status"] for r in rows} == {"ok"} for rows in outputs)
    assert {row["text"] for row in outputs[2]} <= {"yes", "no", "maybe"}  # the choice job
    assert all(len(row["choices"]) == 2 for row in outputs[3])  # the n=2 job

    # No side-by-side file here (file_lines=0): run-batch and run each build an engine, and
    # the bench's own parts test them (tests/engine/test_bench.py).
    assert "side_by_side" not in result

    # The worker and its engine processes are gone.
    pids = worker["pids"]
    assert pids  # the worker (its engine core runs in it: engine/start_settings.py), and any child
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
