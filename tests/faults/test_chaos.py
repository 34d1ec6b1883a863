"""The quick chaos run (issue 52, benchmarks/chaos.py) end to end: two tenants' jobs and a
poison tenant's through two instant-engine workers on a private Redis, PostgreSQL and S3
server (moto), reached through the harness's proxies, while a worker is killed -9, the S3
endpoint fails (resets and 503s), a worker's wall clock jumps 30 s and the network to a service
is cut (and more, as the jobs last);
the checker (benchmarks/chaos_check.py) finds every line exactly once in its job's Parquet
output and no process left. Then exactly-once is broken on purpose (a committed part file
written twice) and the same checker says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from batchllm.output.parts import list_parts, part_name, shard_of_part
from batchllm.storage import Storage
from benchmarks import chaos, chaos_check
from benchmarks.chaos_faults import available_kinds
from tests.support.faults import require_private_services
from tests.support.skips import require

pytestmark = pytest.mark.faults

LINES = 2000


@pytest.fixture(scope="module")
def quick_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    require_private_services()
    require(importlib.util.find_spec("moto") is not None, "moto[server] (the test extra)")
    output = tmp_path_factory.mktemp("chaos")
    # Seed 763 draws kill9, s3-errors, clock-step, net-partition first (each kind once per
    # round), one every 5 s, the S3 and network faults 3 s each. At 80 ms a token step, 2,000 lines of
    # 16-64 tokens in shards of 100 take two workers at least ~34 s whatever the machine's
    # speed (~40 rows/s at most here): long enough for those three before the last 10%
    # drains without faults.
    config = chaos.Config(
        lines=LINES,
        workers=2,
        every=5,
        step_seconds=0.08,
        tenants=2,
        seed=763,
        output=output,
        faults=available_kinds("s3"),
        storage="s3",
        net_seconds=3,
        s3_seconds=3,
        timeout=240,
        model=str(tiny_model),
    )
    report = chaos.run(config, say=print)
    print(chaos_check.summary(report))
    return output, report


@pytest.mark.timeout(420)
def test_a_quick_chaos_run_keeps_every_line_exactly_once_under_four_kinds_of_fault(quick_run):
    output, report = quick_run
    assert report["passed"], "\n".join(report["problems"])
    drawn = {"kill9", "s3-errors", "clock-step", "net-partition"}
    assert drawn <= set(report["faults_by_kind"]), report["faults_by_kind"]
    totals = report["totals"]
    poison_lines = chaos.Config(lines=LINES).resolved_poison_lines()
    assert totals["expected"] == totals["rows"] == LINES + poison_lines
    assert totals["lost_count"] == totals["duplicated_count"] == totals["unexpected_count"] == 0
    jobs = {job["tenant"]: job for job in report["jobs"]}
    assert set(jobs) == {"tenant-1", "tenant-2", "poison"}
    assert {job["status"] for job in jobs.values()} == {"completed"}
    for tenant in ("tenant-1", "tenant-2"):
        assert jobs[tenant]["ok_rows"] == jobs[tenant]["expected"] == LINES // 2
    # Every other poison line is bad: each comes out an error row (a line naming another
    # model may run on the job's), beside the good ones, all `ok`.
    recorded = json.loads((output / "run.json").read_text())
    poison = next(j for j in recorded["jobs"] if j["tenant"] == "poison")
    not_errors = poison["expect"]["lines"]
    must_fail = poison_lines - len(not_errors)
    assert must_fail >= poison_lines // 2 - poison_lines // 10
    assert jobs["poison"]["wrong_status_count"] == 0
    assert jobs["poison"]["error_rows"] >= must_fail
    assert jobs["poison"]["ok_rows"] >= list(not_errors.values()).count("ok")
    assert report["orphans"] == []
    assert all(w["exit"] is not None for w in report["workers"])
    for fault in report["faults"]:
        assert fault["rows_again_s"] is not None, fault
    s3_faults = [f for f in report["faults"] if f["kind"] == "s3-errors"]
    # The first (drawn second, while every job runs) meets S3 traffic; a later one can land
    # in a lull between commits with nothing to reset (it did once: 0 and 0).
    assert s3_faults[0]["resets"] + s3_faults[0]["answered_503"] > 0, s3_faults
    for fault in report["faults"]:
        if fault["kind"] in ("s3-errors", "net-partition", "net-delay"):
            assert fault["after_heal_s"] is not None, fault
    assert len(recorded["faults"]) == len(report["faults"])
    assert json.loads((output / "report.json").read_text())["passed"] is True
    if importlib.util.find_spec("matplotlib") is not None:
        assert (output / "rows.png").stat().st_size > 0


@pytest.mark.timeout(60)
def test_a_part_file_committed_twice_after_the_run_is_caught_as_duplicated_lines(quick_run):
    output, _ = quick_run
    run = json.loads((output / "run.json").read_text())
    job = next(j for j in run["jobs"] if j["tenant"] == "tenant-1")
    # The bucket's files as the run copied them before its S3 server ended.
    root, output_dir = chaos_check.checked_output(job)
    storage = Storage(root)
    first = list_parts(storage, output_dir)[0]
    # The same rows again under a part name of the same shard that no commit ever wrote.
    again = part_name(shard_of_part(first), 99_999, attempt=999)
    src = Path(storage.root) / output_dir / first
    shutil.copyfile(src, src.with_name(again))
    copied = len(chaos_check.job_rows(root, output_dir)) - job["request_total"]
    assert copied > 0

    report = chaos_check.write_report(output)

    assert not report["passed"]
    checked = next(j for j in report["jobs"] if j["id"] == job["id"])
    assert (checked["duplicated_count"], checked["lost_count"]) == (copied, 0)
    assert any("duplicated" in problem for problem in report["problems"])
    assert all(j["duplicated_count"] == 0 for j in report["jobs"] if j["id"] != job["id"])
