"""The chaos run's fault kinds (benchmarks/chaos_faults.py) without services: the schedule
draws every kind, the network and S3 ones included, once per round; the S3 kind needs the S3
output; the injector heals a proxy it delayed, cut off or failed and records the fault; the
checker reports how soon rows came again after a fault healed."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.chaos import Config
from benchmarks.chaos_check import fault_recoveries
from benchmarks.chaos_faults import FAULT_KINDS, Injector, Schedule
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
        Config(faults=["disk-full"]).resolved_faults()


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
