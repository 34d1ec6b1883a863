"""The engines of a process: a fleet worker's own engine (WorkerEngine: the operator's settings,
built at start-up, never rebuilt by a job unless the operator allows it), and `batchllm run`'s
engine sized from its job (EngineCache: rebuilt when a job needs other settings or a longer
context than the warm one has)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from batchllm.errors import EngineMismatch
from batchllm.execution import metrics
from batchllm.execution.profile import VLLM_LORA_RANK, EngineProfile, ProfiledEngine
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec

if TYPE_CHECKING:  # vllm is imported only when an engine is built
    from batchllm.engine.vllm_engine import VllmEngine

log = logging.getLogger(__name__)


def with_min_lora_rank(spec: JobSpec, floor: int | None) -> JobSpec:
    """A LoRA job's spec with its engine's max_lora_rank raised to the worker's floor."""
    if floor is None or not spec.engine.enable_lora:
        return spec
    rank = max(spec.engine.max_lora_rank or VLLM_LORA_RANK, floor)
    engine = spec.engine.model_copy(update={"max_lora_rank": rank})
    return spec.model_copy(update={"engine": engine})


def context_free_key(spec: JobSpec) -> str:
    """The engine key without the context length, which a longer warm engine covers."""
    return spec.engine.model_copy(update={"max_model_len": None}).engine_key(spec.model)


def _differences(old: JobSpec, new: JobSpec) -> str:
    """The engine settings that make `new` need another engine than `old`, for the log."""
    changes = [f"model {old.model} -> {new.model}"] if old.model != new.model else []
    before, after = old.engine.model_dump(), new.engine.model_dump()
    changes += [
        f"{name} {before[name]!r} -> {after[name]!r}"
        for name in after
        if name not in ("max_model_len", "group_prefixes") and before[name] != after[name]
    ]
    return ", ".join(changes)


def build_vllm_engine(
    model: str, options: EngineOptions, max_model_len: int, settings: Settings, **named: Any
) -> tuple[VllmEngine, float]:
    """A new vLLM engine and the seconds it took, counted in the process's metrics."""
    from batchllm.engine.vllm_engine import VllmEngine

    started = time.monotonic()
    try:
        engine = VllmEngine(
            model=model, options=options, max_model_len=max_model_len, settings=settings, **named
        )
    except Exception:
        metrics.engine_start_failed(model)
        raise
    seconds = time.monotonic() - started
    metrics.engine_started(model, seconds)
    return engine, seconds


class EngineCache:
    """The warm engine of this process (an EngineSource).

    A warm engine serves every job with its settings whose context fits in its own: the
    runner checks rows against the engine's max_model_len, so a longer-context engine runs a
    shorter job's rows exactly as one sized for it would, and rebuilding it (tens of seconds
    here, minutes on a GPU) would only delay the job. It is rebuilt when a job needs other
    settings or a longer context than it has. `settings`: the process's (the LoRA rank floor,
    whether an untested vLLM may run, where rows' images are read from).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._key: str | None = None
        self._spec: JobSpec | None = None  # what the warm engine was built for
        self.engine: VllmEngine | None = None

    def get(self, spec: JobSpec, max_model_len: int) -> VllmEngine:
        spec = with_min_lora_rank(spec, self.settings.min_lora_rank)
        key = context_free_key(spec)
        warm, built_for = self.engine, self._spec
        if warm is not None and key == self._key:
            if max_model_len <= warm.max_model_len:
                if max_model_len < warm.max_model_len:
                    log.info(
                        "reusing the warm engine (max_model_len %d) for a job that needs "
                        "max_model_len %d",
                        warm.max_model_len,
                        max_model_len,
                    )
                return warm
            log.info(
                "rebuilding the engine: the job needs max_model_len %d, the warm engine has %d",
                max_model_len,
                warm.max_model_len,
            )
        elif warm is not None and built_for is not None:
            log.info(
                "rebuilding the engine: the job needs other engine settings (%s)",
                _differences(built_for, spec),
            )
        self.close()

        engine, _ = build_vllm_engine(spec.model, spec.engine, max_model_len, self.settings)
        self.engine, self._key, self._spec = engine, key, spec
        return engine

    def close(self) -> None:
        engine, self.engine, self._key = self.engine, None, None
        built_for, self._spec = self._spec, None
        if built_for is not None:
            metrics.engine_stopped(built_for.model)
        if engine is not None:
            engine.shutdown()


class WorkerEngine(ProfiledEngine):
    """A fleet worker's engine (an EngineSource): the operator's model and settings, built by
    `start` before the worker takes its first task and kept for every job it serves.

    A job adapts to it: `get` hands out this engine for every job whose requirements it meets
    (execution/profile.py) and raises EngineMismatch for the others, which wait for a worker
    that serves them. Only with `allow_rebuild` does such a job get an engine built for it
    (the EngineCache way); the next job that fits the operator's settings gets them back.
    After the engine died, the next job rebuilds the operator's engine, as it was.
    """

    def __init__(
        self,
        model: str,
        options: EngineOptions,
        *,
        settings: Settings,
        allow_rebuild: bool = False,
    ):
        self.model, self.options, self.allow_rebuild = model, options, allow_rebuild
        self.settings = settings
        self.profile: EngineProfile | None = None
        self._own: VllmEngine | None = None
        self._rebuilt = EngineCache(settings)  # a job's own engine, under allow_rebuild only

    @property
    def engine(self) -> VllmEngine | None:
        return self._own or self._rebuilt.engine

    def start(self) -> EngineProfile:
        """Build the operator's engine (again, after it died or a rebuild replaced it)."""
        self._rebuilt.close()

        engine, seconds = build_vllm_engine(
            self.model,
            self.options,
            # -1: vLLM's auto-fit, the model's context or the longest its KV cache holds.
            self.options.max_model_len or -1,
            self.settings,
            context_name="this worker's max_model_len",
        )
        self._own = engine
        self.profile = EngineProfile.of(
            self.model, self.options, max_model_len=engine.max_model_len, dtype=engine.dtype
        )
        metrics.engine_profile(self.profile.as_dict())
        log.info("engine ready in %.1f s: %s", seconds, self.profile.describe())
        return self.profile

    def get(self, spec: JobSpec, max_model_len: int) -> VllmEngine:
        unmet = self.unmet(spec)
        if not unmet:
            if self._own is None:  # it died, or a job's own engine replaced it
                self.start()
            assert self._own is not None
            return self._own
        if not self.allow_rebuild:
            raise EngineMismatch(unmet)
        log.info(
            "rebuilding the engine for a job that needs %s (--allow-rebuild)", "; ".join(unmet)
        )
        self._close_own()
        return self._rebuilt.get(spec, max_model_len)

    def _close_own(self) -> None:
        engine, self._own = self._own, None
        if engine is not None:
            metrics.engine_stopped(self.model)
            engine.shutdown()

    def close(self) -> None:
        self._close_own()
        self._rebuilt.close()
