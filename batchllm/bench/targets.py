"""Ratios to raw vLLM, and the project's performance targets checked against one run's figures."""

from __future__ import annotations

from typing import Any


def add_ratios_and_targets(result: dict[str, Any]) -> None:
    """Ratios to raw vLLM, and the performance targets checked against this run's figures."""
    contenders = result["contenders"]
    raw = contenders.get("vllm_generate")
    targets: dict[str, Any] = {}
    if raw:
        base = raw["output_tokens_per_s"]["median"]
        for figures in contenders.values():
            figures["ratio_to_raw"] = figures["output_tokens_per_s"]["median"] / base
            if "generation_output_tokens_per_s" in figures:
                figures["generation_ratio_to_raw"] = (
                    figures["generation_output_tokens_per_s"]["median"] / base
                )
        if "batchllm_engine" in contenders:
            targets["engine_phase_vs_raw"] = _target(
                contenders["batchllm_engine"]["ratio_to_raw"], 0.97
            )
            if "vllm_batches_32" in contenders:
                targets["engine_phase_vs_batches_32"] = _target(
                    contenders["batchllm_engine"]["output_tokens_per_s"]["median"]
                    / contenders["vllm_batches_32"]["output_tokens_per_s"]["median"],
                    2.0,
                )
    if "batchllm_run" in contenders and "vllm_run_batch" in contenders:
        targets["run_speedup_over_run_batch"] = _target(
            contenders["vllm_run_batch"]["wall_seconds"]["median"]
            / contenders["batchllm_run"]["wall_seconds"]["median"],
            1.0,
            strict=True,
        )
    prefix = result.get("prefix")
    if prefix:
        prefix["gain"] = (
            prefix["grouped"]["output_tokens_per_s"]["median"]
            / prefix["file_order"]["output_tokens_per_s"]["median"]
        )
    overhead = result.get("overhead")
    if overhead:
        # Issue 13's pipeline targets, at the largest size run (1M lines in the README).
        largest = overhead["sizes"][-1]
        targets["overhead_own_rows_per_s"] = _target(largest["own_rows_per_s"], 50_000.0)
        if "vs_tokenization" in largest:
            targets["overhead_vs_tokenization"] = _target(largest["vs_tokenization"], 0.6)
    if overhead and raw:
        engine_per_row = raw["wall_seconds"]["median"] / raw["requests"]
        overhead["engine_seconds_per_row"] = engine_per_row
        for size in overhead["sizes"]:
            size["share_of_engine_time"] = size["seconds_per_row"] / engine_per_row
            size["own_share_of_engine_time"] = size["own_seconds_per_row"] / engine_per_row
        targets["overhead_share_of_engine"] = _target(
            overhead["sizes"][-1]["own_share_of_engine_time"], 0.01, lower_is_better=True
        )
    result["targets"] = targets


def _target(
    value: float, target: float, *, strict: bool = False, lower_is_better: bool = False
) -> dict[str, Any]:
    if lower_is_better:
        met = value < target
    elif strict:
        met = value > target
    else:
        met = value >= target
    return {"value": value, "target": target, "met": met}
