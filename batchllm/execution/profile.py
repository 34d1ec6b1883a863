"""A fleet worker's engine profile: what its engine serves, and which jobs it can run.

A worker owns its engine (the operator's settings, built at start-up); a job adapts to it. Of
a job's engine settings, those that change what the engine can run are requirements a worker
must meet (its model, embeddings, LoRA and adapter rank, an explicit context length, dtype,
quantization, compact JSON); the rest (memory share, batch sizes, eager mode, prefix caching,
tensor parallelism) are the worker's to choose, and a job's values for them are ignored on a
fleet. A context the job was merely sized to is no requirement: its rows longer than the
worker's context become error rows naming both lengths.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from batchllm.spec import EngineOptions, JobSpec

# vLLM's default max_lora_rank, which an engine built without --max-lora-rank has.
VLLM_LORA_RANK = 16
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _dtype(name: str) -> str:
    return _DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True)
class EngineProfile:
    """What a built engine serves. `max_model_len` and `dtype` are the engine's own (resolved
    by vLLM), not the flags it was given."""

    model: str
    task: str  # generate or embed
    max_model_len: int
    dtype: str
    quantization: str | None
    enable_lora: bool
    max_lora_rank: int | None
    compact_json: bool

    @classmethod
    def of(
        cls, model: str, options: EngineOptions, *, max_model_len: int, dtype: str
    ) -> EngineProfile:
        return cls(
            model=model,
            task=options.task,
            max_model_len=max_model_len,
            dtype=_dtype(dtype),
            quantization=options.quantization,
            enable_lora=options.enable_lora,
            max_lora_rank=(options.max_lora_rank or VLLM_LORA_RANK)
            if options.enable_lora
            else None,
            compact_json=options.compact_json,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineProfile:
        return cls(**{name: data.get(name) for name in cls.__dataclass_fields__})  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line for logs, `doctor --fleet` and `status`."""
        parts = [self.model, self.task, f"max_model_len {self.max_model_len}", self.dtype]
        if self.quantization:
            parts.append(f"quantization {self.quantization}")
        if self.enable_lora:
            parts.append(f"LoRA up to rank {self.max_lora_rank}")
        if self.compact_json:
            parts.append("compact JSON")
        return ", ".join(parts)


def unmet_requirements(spec: JobSpec, profile: EngineProfile) -> list[str]:
    """What `spec` needs that an engine of `profile` does not serve, one phrase each
    ([] when it can run the job)."""
    engine = spec.engine
    unmet = []
    if spec.model != profile.model:
        unmet.append(f"model {spec.model} (this worker serves {profile.model})")
    if engine.task != profile.task:
        unmet.append(f"task {engine.task} (this worker's engine is for {profile.task})")
    if engine.enable_lora and not profile.enable_lora:
        unmet.append("LoRA adapters (this worker runs without --enable-lora)")
    # Only an explicit rank is a requirement: without one, an adapter of a higher rank than the
    # engine's is refused by vLLM alone, as an error row.
    elif (
        engine.enable_lora
        and engine.max_lora_rank
        and profile.max_lora_rank is not None
        and engine.max_lora_rank > profile.max_lora_rank
    ):
        unmet.append(
            f"max_lora_rank {engine.max_lora_rank} (this worker serves adapters up to "
            f"rank {profile.max_lora_rank})"
        )
    if engine.max_model_len is not None and engine.max_model_len > profile.max_model_len:
        unmet.append(
            f"max_model_len {engine.max_model_len} (this worker's context is "
            f"{profile.max_model_len})"
        )
    if engine.dtype != "auto" and _dtype(engine.dtype) != profile.dtype:
        unmet.append(f"dtype {engine.dtype} (this worker runs {profile.dtype})")
    if engine.quantization and engine.quantization != profile.quantization:
        unmet.append(
            f"quantization {engine.quantization} (this worker runs "
            f"{profile.quantization or 'unquantized'})"
        )
    if engine.compact_json and not profile.compact_json:
        unmet.append("compact JSON (this worker runs without --compact-json)")
    return unmet


class ProfiledEngine:
    """What a fleet worker's engine source (WorkerEngine, InstantWorkerEngine) shares: its
    `start` builds the operator's engine and describes it in `profile`, and `unmet` says what a
    job needs that this engine does not serve."""

    profile: EngineProfile | None

    def unmet(self, spec: JobSpec) -> list[str]:
        assert self.profile is not None, "start() builds the engine first"
        return unmet_requirements(spec, self.profile)
