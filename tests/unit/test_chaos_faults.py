"""The chaos run's fault kinds (benchmarks/chaos_faults.py) without services: the schedule
draws every kind, the network and S3 ones included, once per round; the S3 kind needs the S3
output; the injector heals a proxy it delayed, cut off or failed and records the fault; the
checker reports how soon rows came again after a fault healed."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.chaos import Config
from benchmarks.chaos_check import fault_recoveries
from benchmarks.chaos_disk import SmallDisk, can_mount
from benchmarks.chaos_faults import CLOCK_SITE, FAULT_KINDS, Injector, Schedule
from benchmarks.chaos_proxy import ProxyStats


class _Proxy:
    """What the injector asks of a TcpProxy, recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.stats = ProxyStats()

    def delay(self, low: float, high: float, *, seed: int = 0) -> None:
        self.calls.append(f"delay {low}-{high}")

    def partition(self) -> None:
        self.calls.append("partition")

    def fail_http(self, *, seed: int = 0) -> None:
        self.calls.append("fail_http")
        self.stats.reset += 2
        self.stats.answered_503 += 3

    def heal(self) -> None:
        self.calls.append("heal")


def _injector(proxies: dict[str, _Proxy]) -> Injector:
    return Injector(
        workers=None,  # type: ignore[arg-type]  (no worker fault here)
        redis=None,  # type: ignore[arg-type]
        postgres=None,  # type: ignore[arg-type]
        rng=random.Random(1),
        held=lambda worker: [],
        stop_seconds=0,
        outage_seconds=0,
        proxies=proxies,  # type: ignore[arg-type]
        net_seconds=0.05,
        s3_seconds=0.05,
    )


def test_the_schedule_draws_every_kind_once_per_round_network_and_s3_ones_included():
    schedule = Schedule(list(FAULT_KINDS), random.Random(7))
    drawn = [schedule.next() for _ in range(3 * len(FAULT_KINDS))]
    assert {"net-delay", "net-partition", "s3-errors"} <= set(FAULT_KINDS)
    for round_ in range(3):
        chunk = drawn[round_ * len(FAULT_KINDS) : (round_ + 1) * len(FAULT_KINDS)]
        assert sorted(chunk) == sorted(FAULT_KINDS)
    assert set(Counter(drawn).values()) == {3}


def test_s3_errors_are_drawn_only_with_the_s3_output_and_refused_without_it():
    assert "s3-errors" in Config(storage="s3").resolved_faults()
    assert "s3-errors" not in Config(storage="dir").resolved_faults()
    assert "net-partition" in Config(storage="dir").resolved_faults()
    with pytest.raises(ValueError, match="S3 output"):
        Config(storage="dir", faults=["s3-errors"]).resolved_faults()
    with pytest.raises(ValueError, match="unknown fault kinds"):
        Config(faults=["disk-flood"]).resolved_faults()


@pytest.mark.parametrize(
    ("kind", "action"), [("net-delay", "delay"), ("net-partition", "partition")]
)
def test_a_network_fault_acts_on_the_drawn_proxies_and_heals_them(kind, action):
    proxies = {"redis": _Proxy(), "postgres": _Proxy()}
    record = _injector(proxies).inject(kind)
    touched = [name for name, proxy in proxies.items() if proxy.calls]
    assert record["target"] in ("redis", "postgres", "all")
    assert touched == (["redis", "postgres"] if record["target"] == "all" else [record["target"]])
    for name in touched:
        assert [c.split()[0] for c in proxies[name].calls] == [action, "heal"]
    assert record["restored"] - record["began"] >= 0.05
    assert record["kind"] == kind and record["note"]


def test_s3_errors_fail_the_s3_proxy_for_a_while_and_record_what_it_did():
    proxies = {"redis": _Proxy(), "s3": _Proxy()}
    record = _injector(proxies).inject("s3-errors")
    assert proxies["s3"].calls == ["fail_http", "heal"]
    assert proxies["redis"].calls == []
    assert (record["target"], record["resets"], record["answered_503"]) == ("s3", 2, 3)
    with pytest.raises(ValueError, match="S3 output"):
        _injector({"redis": _Proxy()}).inject("s3-errors")


def test_a_fault_that_lasts_a_while_reports_how_soon_rows_came_again_after_it_healed():
    run = {
        "faults": [
            {"kind": "net-partition", "began": 10.0, "restored": 16.0},
            {"kind": "redis-restart", "began": 30.0, "restored": 30.4},
        ],
        # Rows stall during the partition, come again 1.5 s after it heals.
        "timeline": [[9.5, 100], [12.0, 100], [16.0, 100], [17.5, 140], [31.0, 150]],
    }
    partition, restart = fault_recoveries(run)
    assert (partition["rows_again_s"], partition["after_heal_s"]) == (7.5, 1.5)
    assert restart["after_heal_s"] is None  # over at once: rows_again_s says it all
    assert restart["rows_again_s"] == 1.0


def test_the_run_writes_nothing_when_its_fault_kinds_are_wrong(tmp_path: Path):
    from benchmarks.chaos import run

    with pytest.raises(ValueError):
        run(Config(storage="dir", faults=["s3-errors"], output=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_engine_kill_is_drawn_only_with_a_vllm_worker_and_refused_without_one():
    assert "engine-kill" not in Config().resolved_faults()
    assert "engine-kill" in Config(vllm_workers=1).resolved_faults()
    assert "clock-step" in Config().resolved_faults()
    with pytest.raises(ValueError, match="vLLM worker"):
        Config(faults=["engine-kill"]).resolved_faults()


def test_a_stepped_worker_clock_moves_python_time_and_batchllms_utcnow_only(tmp_path: Path):
    """What the clock-step fault changes in a worker (benchmarks/chaos_clock/sitecustomize.py):
    time.time and batchllm's utcnow by the file's offset, read again once it changes; the
    monotonic clock and the threads' timed waits as they were."""
    clock_file = tmp_path / "w.clock"
    clock_file.write_text("-30\n")
    probe = """
import json, sys, threading, time
from datetime import datetime, timezone
from batchllm.store import models
def offsets():
    return [round(time.time() - datetime.now(timezone.utc).timestamp()),
            round((models.utcnow() - datetime.now(timezone.utc)).total_seconds())]
first = offsets()
open(sys.argv[1], "w").write("45\\n")
t0 = time.monotonic()
threading.Event().wait(1.2)  # past the once-a-second read
time.sleep(0.1)
waited = time.monotonic() - t0
print(json.dumps({"first": first, "then": offsets(), "waited": waited}))
"""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(CLOCK_SITE), str(Path.cwd())]),
        "BATCHLLM_CHAOS_CLOCK_FILE": str(clock_file),
    }
    done = subprocess.run(
        [sys.executable, "-c", probe, str(clock_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["first"] == [-30, -30]
    assert seen["then"] == [45, 45]
    assert 1.2 <= seen["waited"] < 10


@pytest.mark.skipif(not can_mount(), reason="mounting the small disk (a tmpfs) needs root")
def test_the_small_disk_fills_to_enospc_and_takes_writes_again_once_freed(tmp_path: Path):
    disk = SmallDisk(tmp_path / "disk", size_mb=4)
    disk.mount()
    try:
        (disk.path / "before.txt").write_bytes(b"x" * 1000)
        taken = disk.fill()
        assert 3_000_000 < taken <= 4 * (1 << 20)
        with pytest.raises(OSError) as full:
            (disk.path / "part.parquet").write_bytes(b"y" * 8192)
        assert full.value.errno == errno.ENOSPC
        disk.free()
        (disk.path / "after.txt").write_bytes(b"z" * 8192)
        assert (disk.path / "before.txt").read_bytes() == b"x" * 1000
        assert disk.free_bytes() > 3_000_000
    finally:
        disk.unmount()
    assert not (tmp_path / "disk" / "before.txt").exists()  # unmounted: the tmpfs is gone


def test_disk_full_is_drawn_only_on_the_small_disk():
    assert "disk-full" not in Config(storage="s3").resolved_faults()
    assert ("disk-full" in Config(storage="dir").resolved_faults()) == can_mount()
    with pytest.raises(ValueError, match="--storage dir"):
        Config(storage="s3", faults=["disk-full"]).resolved_faults()
