"""One warm engine per process, rebuilt only when a shard needs other engine settings."""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING

from batchllm.jobs import service
from batchllm.jobs.db import get_one, session_scope
from batchllm.jobs.inputs import iter_shard_rows
from batchllm.jobs.models import Job
from batchllm.jobs.schemas import JobSpec
from batchllm.jobs.storage import Storage
from batchllm.settings import Settings, get_settings
from batchllm.worker import metrics

if TYPE_CHECKING:  # vllm is imported only when an engine is built
    from batchllm.engine.vllm_engine import VllmEngine

log = logging.getLogger(__name__)


def resolve_max_model_len(job_id: str, *, storage: Storage, settings: Settings) -> int:
    """The job's max_model_len: as given, or sized once from its rows and stored on the job."""
    with session_scope(settings) as session:
        job = get_one(session, Job, job_id)
        if job.max_model_len:
            return job.max_model_len
        spec = JobSpec.model_validate(job.spec)
        paths = [s.input_path for s in job.shards]
    from batchllm.engine.sizing import size_max_model_len

    rows = itertools.chain.from_iterable(iter_shard_rows(storage, p) for p in paths)
    sized = size_max_model_len(spec.model, rows, spec.sampling, spec.chat_template)
    with session_scope(settings) as session:
        return service.set_max_model_len(session, job_id, sized)


# vLLM's default max_lora_rank, which a job without --max-lora-rank gets.
_VLLM_LORA_RANK = 16


def with_min_lora_rank(spec: JobSpec, floor: int | None) -> JobSpec:
    """A LoRA job's spec with its engine's max_lora_rank raised to the worker's floor."""
    if floor is None or not spec.engine.enable_lora:
        return spec
    rank = max(spec.engine.max_lora_rank or _VLLM_LORA_RANK, floor)
    engine = spec.engine.model_copy(update={"max_lora_rank": rank})
    return spec.model_copy(update={"engine": engine})


class EngineCache:
    """The warm engine of this process (an EngineSource)."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._model: str | None = None
        self.engine: VllmEngine | None = None

    def get(self, spec: JobSpec, max_model_len: int) -> VllmEngine:
        spec = with_min_lora_rank(spec, get_settings().min_lora_rank)
        key = spec.engine.engine_key(spec.model) + f"|{max_model_len}"
        if self.engine is not None and key == self._key:
            return self.engine
        self.close()
        from batchllm.engine.vllm_engine import VllmEngine

        started = time.monotonic()
        try:
            engine = VllmEngine(model=spec.model, options=spec.engine, max_model_len=max_model_len)
        except Exception:
            metrics.engine_start_failed(spec.model)
            raise
        metrics.engine_started(spec.model, time.monotonic() - started)
        self.engine, self._key, self._model = engine, key, spec.model
        return engine

    def close(self) -> None:
        engine, self.engine, self._key = self.engine, None, None
        model, self._model = self._model, None
        if model is not None:
            metrics.engine_stopped(model)
        if engine is not None:
            engine.shutdown()
