"""Prefix grouping measured: the same job path with and without `group_prefixes`.

The workload has long system prompts shared by many requests, in random order. vLLM's prefix
cache serves a shared prefix either way while it stays cached; grouping pays when the distinct
prefixes do not all stay cached (many of them, a KV cache full of running requests): in file
order a prefix is evicted and recomputed between its uses, grouped it is computed about once.
Each run gets its own system prompts, so no run is served from an earlier run's cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from batchllm.bench.contenders import job_spec, run_job_phase
from batchllm.bench.figures import Contender
from batchllm.bench.workload import Workload, write_openai_chat
from batchllm.settings import Settings


def run_prefix(
    engines,
    *,
    model: str,
    workload: Workload,
    max_model_len: int,
    settings: Settings,
    workdir: Path,
    repeats: int,
    variants: Iterator[int],
    kv_cache_bytes: int | None,
    say,
    enforce_eager: bool = False,
) -> dict[str, Contender]:
    """Both sides on one engine: the shared one, or with `kv_cache_bytes` an engine of its own
    whose small KV cache puts the prefix cache under the pressure a GPU's has."""
    sides = {
        "file_order": (Contender("file_order", "file order (--no-group-prefixes)"), False),
        "grouped": (Contender("grouped", "prefix-grouped (default)"), True),
    }
    for repeat in range(repeats):
        for contender, grouped in sides.values():
            variant = next(variants)
            source = write_openai_chat(
                workdir / f"prefix-{variant}.jsonl", workload, variant, model=model
            )
            spec = job_spec(
                model,
                workload,
                max_model_len,
                group_prefixes=grouped,
                kv_cache_bytes=kv_cache_bytes,
                enforce_eager=enforce_eager,
            )
            run = run_job_phase(engines, spec, source, settings)
            source.unlink()
            contender.runs.append(run)
            say(
                f"[prefix] {contender.label}, repeat {repeat + 1}/{repeats}: "
                f"{run.output_tokens_per_s:,.0f} output tokens/s ({run.seconds:.1f} s)"
            )
    return {key: contender for key, (contender, _) in sides.items()}
