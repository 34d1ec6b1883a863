"""Engine settings checked against this machine before an engine starts, so a setting the
hardware cannot honour is one clear line, not a vLLM traceback minutes later (after the
job's rows were sized and the model's weights loaded)."""

from __future__ import annotations

from batchllm.engine.hardware import Gpu, visible_gpus
from batchllm.errors import EngineSettingsError
from batchllm.spec import EngineOptions


def _gpu_word(count: int) -> str:
    return f"{count} GPU" + ("" if count == 1 else "s")


def check_engine_options(options: EngineOptions, *, is_cpu: bool, gpus: list[Gpu]) -> None:
    """Tensor parallelism and GPU memory share against the visible GPUs. The CPU backend runs
    without GPUs (its tensor parallelism spans NUMA nodes, which vLLM checks itself)."""
    if not 0 < options.gpu_memory_utilization <= 1:
        raise EngineSettingsError(
            f"--gpu-memory-utilization {options.gpu_memory_utilization}: must be in (0, 1]"
        )
    if is_cpu:
        return
    if options.tensor_parallel_size > len(gpus):
        raise EngineSettingsError(
            f"--tensor-parallel-size {options.tensor_parallel_size} needs "
            f"{_gpu_word(options.tensor_parallel_size)}; this process sees "
            f"{_gpu_word(len(gpus))} (CUDA_VISIBLE_DEVICES limits what it sees)"
        )


def check_quantization(
    quantization: str | None,
    *,
    known: list[str],
    platform_supported: list[str],
    device: str,
    min_capability: int | None,
    gpus: list[Gpu],
) -> None:
    """A quantization method vLLM knows, this platform runs, and every visible GPU can run.
    The caller reads `known`, `platform_supported` and `min_capability` from the installed
    vLLM (engine/vllm_engine.py), so the check follows the version that runs."""
    if quantization is None:
        return
    if quantization not in known:
        raise EngineSettingsError(
            f"--quantization {quantization}: vLLM does not know it; one of: "
            + ", ".join(sorted(known))
        )
    if platform_supported and quantization not in platform_supported:
        raise EngineSettingsError(
            f"--quantization {quantization} does not run on {device}; it runs: "
            + ", ".join(platform_supported)
        )
    if min_capability is None:
        return
    for gpu in gpus:
        if gpu.compute_capability is not None and gpu.compute_capability < min_capability:
            raise EngineSettingsError(
                f"--quantization {quantization} needs compute capability "
                f"{min_capability / 10:.1f}+; GPU {gpu.index} ({gpu.name}) has "
                f"{gpu.compute_capability / 10:.1f}"
            )


def check_worker_concurrency(concurrency: int, *, is_cpu: bool, gpus: list[Gpu]) -> None:
    """`worker --concurrency N` gives each process one GPU: more processes than GPUs would
    stack engines on one GPU, each sized for the whole of its memory."""
    if is_cpu or concurrency <= 1:
        return
    if concurrency > len(gpus):
        raise EngineSettingsError(
            f"--concurrency {concurrency}: one engine process per GPU, and this machine shows "
            f"{_gpu_word(len(gpus))} (CUDA_VISIBLE_DEVICES limits what it shows)"
        )


def preflight(options: EngineOptions, *, is_cpu: bool, device: str) -> None:
    """Refuse settings this machine cannot honour before vLLM starts (EngineSettingsError),
    asking the installed vLLM which quantizations exist, run here, and need which GPUs."""
    gpus = [] if is_cpu else visible_gpus()
    check_engine_options(options, is_cpu=is_cpu, gpus=gpus)
    if options.quantization is None:
        return
    from vllm.model_executor.layers import quantization
    from vllm.platforms import current_platform

    known = list(quantization.QUANTIZATION_METHODS)
    min_capability = None
    if options.quantization in known and not is_cpu:
        try:
            config = quantization.get_quantization_config(options.quantization)
            min_capability = config.get_min_capability()
        except (ValueError, NotImplementedError, ImportError):
            min_capability = None  # vLLM checks it itself when it loads the model
    check_quantization(
        options.quantization,
        known=known,
        platform_supported=list(current_platform.supported_quantization),
        device=device,
        min_capability=min_capability,
        gpus=gpus,
    )
