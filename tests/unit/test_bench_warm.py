"""The warm part's figures and report, from made-up job timings (the real worker runs in
tests/integration/test_warm_start.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchllm.bench.report import draw_chart, summary_text
from batchllm.bench.suite import DEFAULT_PARTS, PARTS
from batchllm.bench.warm import LONGER, SHORTER, WARM_UP, plan, summarize


def job(kind: str, max_model_len: int, starts: int, pickup_to_first: float) -> dict:
    return {
        "job_id": f"job_{kind}_{max_model_len}",
        "kind": kind,
        "max_tokens": 16,
        "prompt_words": [4, 8],
        "max_model_len": max_model_len,
        "rows_ok": 50,
        "rows_failed": 0,
        "hardware": "CPU (x86_64, 2 cores), float32",
        "vllm_version": "0.32.0",
        "submit_call_seconds": 0.1,
        "submit_to_pickup_seconds": 30.0 if starts else 0.05,
        "pickup_to_first_row_seconds": pickup_to_first,
        "submit_to_first_row_seconds": (30.0 if starts else 0.05) + pickup_to_first,
        "submit_to_done_seconds": 31.0 if starts else 1.0,
        "engine_starts": starts,
    }


def test_the_plan_is_a_warm_up_the_shorter_jobs_and_one_longer():
    assert plan(7, rebuild=True) == [WARM_UP, *SHORTER, *SHORTER[:2], LONGER]
    assert plan(2, rebuild=False) == [WARM_UP, *SHORTER[:2]]


def test_warm_figures_count_only_shorter_jobs_that_kept_the_warm_engine():
    result = summarize(
        [
            job("warm-up", 576, 1, 0.1),
            job("shorter", 64, 0, 0.02),
            job("shorter", 192, 0, 0.4),
            job("shorter", 256, 1, 0.03),  # a rebuild where none was due: counted, not timed
            job("longer", 832, 1, 0.01),
        ],
        lines=50,
    )
    assert result["shorter_jobs_rebuilt"] == 1
    pickup = result["warm_pickup_to_first_row_seconds"]
    assert (pickup["min"], pickup["max"]) == (0.02, 0.4)
    assert pickup["median"] == pytest.approx(0.21)
    assert result["target_met"] is True
    assert [j["engine_max_model_len"] for j in result["jobs"]] == [576, 576, 576, 256, 832]


def test_a_slow_warm_start_misses_the_target():
    result = summarize([job("warm-up", 576, 1, 0.1), job("shorter", 64, 0, 1.5)], lines=50)
    assert result["target_met"] is False


def test_the_warm_part_is_opt_in_and_reported_with_its_table_and_chart(tmp_path: Path):
    assert "warm" in PARTS and "warm" not in DEFAULT_PARTS
    warm = summarize(
        [job("warm-up", 576, 1, 0.1), job("shorter", 64, 0, 0.02), job("longer", 832, 1, 0.01)],
        lines=50,
    )
    result = {"config": {"model": "/m", "requests": 1}, "contenders": {}, "warm": warm}
    text = summary_text(result)
    assert "3 jobs of 50 lines" in text
    assert "1: shorter" in text and "2: longer" in text
    assert "pickup to first row median 0.02 s, max 0.02 s (target 1 s: met)" in text
    chart = draw_chart(result, tmp_path / "bench.png")
    assert chart.stat().st_size > 10_000
