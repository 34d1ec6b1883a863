"""GPU settings refused before an engine starts, each with one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchllm.engine.hardware import Gpu, auto_dtype, visible_gpus
from batchllm.engine.preflight import (
    check_engine_options,
    check_quantization,
    check_worker_concurrency,
)
from batchllm.errors import EngineSettingsError
from batchllm.spec import EngineOptions


def gpu(index: int, capability: int = 90, name: str = "NVIDIA H100") -> Gpu:
    return Gpu(index, f"GPU-{index:04d}", name, 81_559, 80_000, capability)


TWO = [gpu(0), gpu(1)]


def test_tensor_parallel_beyond_the_visible_gpus_is_refused():
    check_engine_options(EngineOptions(tensor_parallel_size=2), is_cpu=False, gpus=TWO)
    with pytest.raises(EngineSettingsError, match=r"--tensor-parallel-size 4 needs 4 GPUs; .* 2"):
        check_engine_options(EngineOptions(tensor_parallel_size=4), is_cpu=False, gpus=TWO)


def test_the_cpu_backend_needs_no_gpu():
    check_engine_options(EngineOptions(tensor_parallel_size=1), is_cpu=True, gpus=[])


def test_memory_share_outside_zero_one_is_refused_even_past_the_schema():
    options = EngineOptions().model_copy(update={"gpu_memory_utilization": 1.5})
    with pytest.raises(EngineSettingsError, match=r"--gpu-memory-utilization 1.5"):
        check_engine_options(options, is_cpu=False, gpus=TWO)


def test_quantization_checks():
    known, supported = ["awq", "fp8", "gptq"], []

    def check(name: str, min_capability: int | None, gpus, platform=supported, device="cuda"):
        check_quantization(
            name,
            known=known,
            platform_supported=platform,
            device=device,
            min_capability=min_capability,
            gpus=gpus,
        )

    check("fp8", 75, TWO)
    with pytest.raises(EngineSettingsError, match=r"--quantization fp9: vLLM does not know it"):
        check("fp9", None, TWO)
    with pytest.raises(EngineSettingsError, match=r"needs compute capability 7\.5\+; GPU 1 \(T4"):
        check("fp8", 75, [gpu(0), gpu(1, 70, "T4-ish")])
    with pytest.raises(EngineSettingsError, match=r"does not run on tpu; it runs: awq"):
        check("gptq", None, [], platform=["awq"], device="tpu")


def test_worker_concurrency_beyond_the_gpus_is_refused():
    check_worker_concurrency(2, is_cpu=False, gpus=TWO)
    check_worker_concurrency(4, is_cpu=True, gpus=[])  # CPU engines need no GPU each
    with pytest.raises(EngineSettingsError, match=r"--concurrency 3: .* 2 GPUs"):
        check_worker_concurrency(3, is_cpu=False, gpus=TWO)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    four = [gpu(i) for i in range(4)]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(four) == four
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-0003")
    assert [g.index for g in visible_gpus(four)] == [2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus(four) == []


def test_auto_dtype_reasons():
    assert auto_dtype(is_cpu=False, gpus=[gpu(0, 75, "T4")], checkpoint_dtype="bfloat16")[0] == (
        "float16"
    )
    assert auto_dtype(is_cpu=False, gpus=TWO, checkpoint_dtype="bfloat16")[0] == "bfloat16"
    assert auto_dtype(is_cpu=False, gpus=TWO, checkpoint_dtype="float16")[0] == "float16"


def test_the_run_command_refuses_a_memory_share_above_one_in_one_line(tmp_path):
    """The flag's range stops it before any job or engine exists (exit 2, click's usage
    error), with no traceback."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchllm",
            "run",
            str(prompts),
            "--model",
            str(tmp_path),
            "--gpu-memory-utilization",
            "1.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"BATCHLLM_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert "--gpu-memory-utilization" in done.stderr and "Traceback" not in done.stderr


def test_a_workers_lora_rank_floor_raises_only_lora_engines():
    from batchllm.execution.engines import with_min_lora_rank
    from batchllm.spec import JobSpec

    plain = JobSpec(model="m")
    assert with_min_lora_rank(plain, 64) is plain
    lora = JobSpec(model="m", adapters={"a": "/x"})
    assert lora.engine.enable_lora and lora.engine.max_loras == 1
    assert with_min_lora_rank(lora, 64).engine.max_lora_rank == 64
    ranked = JobSpec(model="m", adapters={"a": "/x"}, engine=EngineOptions(max_lora_rank=128))
    assert with_min_lora_rank(ranked, 64).engine.max_lora_rank == 128
    assert with_min_lora_rank(lora, None) is lora
