"""`batchllm worker --engine instant`: a fleet worker whose engine answers at once, for
simulating a fleet without GPUs or vLLM (`python -m benchmarks.fleet`).

Everything but generation is the real thing: the Celery worker, fair share, holds, leases and
heartbeats, the runner's continuous feed with the model's real tokenizer and chat template,
Parquet parts, checkpoints, finalization and the reconciler. The InstantEngine
(execution/stand_in_engines.py) finishes every request at its max_tokens with filler text, so such a
worker's rows are not model output: its jobs record the hardware "none (instant engine)" and
its profile the dtype "instant", and it logs a warning saying so at start-up.
"""

from __future__ import annotations

import logging
import time

from batchllm.engine.sizing import light_tokenizer
from batchllm.errors import BatchLLMError, EngineMismatch
from batchllm.execution import metrics
from batchllm.execution.profile import EngineProfile, ProfiledEngine
from batchllm.execution.stand_in_engines import InstantEngine
from batchllm.spec import EngineOptions, JobSpec

log = logging.getLogger(__name__)

INSTANT_DTYPE = "instant"  # the profile's dtype: `status` and `doctor --fleet` show it
# The context an instant worker serves when the operator gives none (no KV cache to fit).
DEFAULT_MAX_MODEL_LEN = 4096


class InstantWorkerEngine(ProfiledEngine):
    """A WorkerEngine (an EngineSource) over an InstantEngine: same start/unmet/get/close, no
    vLLM imported, ~100 MB a process (the tokenizer and the worker itself)."""

    def __init__(
        self,
        model: str,
        options: EngineOptions,
        *,
        step_seconds: float = 0.0,
        token_seconds: float = 0.0,
    ) -> None:
        self.model, self.options = model, options
        self.step_seconds = step_seconds  # InstantEngine's pace: 0 answers at once
        self.token_seconds = token_seconds  # its cost per token served (0: none)
        self.profile: EngineProfile | None = None
        self.engine: InstantEngine | None = None

    def start(self) -> EngineProfile:
        if self.options.task != "generate":
            # As `run --engine instant` refuses such a job: its rows would otherwise complete
            # with no embedding, score or class at all, a wrong answer given silently.
            raise BatchLLMError(
                f"--engine instant simulates text generation only: --task {self.options.task} "
                "needs --engine vllm"
            )
        started = time.monotonic()
        max_model_len = self.options.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.engine = InstantEngine(
            tokenizer=light_tokenizer(self.model),
            max_model_len=max_model_len,
            max_num_seqs=self.options.max_num_seqs or 256,
            step_seconds=self.step_seconds,
            token_seconds=self.token_seconds,
        )
        self.profile = EngineProfile.of(
            self.model, self.options, max_model_len=max_model_len, dtype=INSTANT_DTYPE
        )
        metrics.engine_profile(self.profile.as_dict())
        # Counted as a vLLM worker counts its engine: a simulated fleet's metrics read the same.
        metrics.engine_started(self.model, time.monotonic() - started)
        log.warning(
            "INSTANT ENGINE (simulation): no generation, every request answers at once with "
            "filler text; jobs record hardware %r. Never use for real jobs.",
            InstantEngine.hardware,
        )
        log.info("engine ready in %.1f s: %s", time.monotonic() - started, self.profile.describe())
        return self.profile

    def get(self, spec: JobSpec, max_model_len: int) -> InstantEngine:
        unmet = self.unmet(spec)
        if unmet:
            raise EngineMismatch(unmet)
        if self.engine is None:
            self.start()
        assert self.engine is not None
        return self.engine

    def close(self) -> None:
        self.engine = None


class InstantEngines:
    """The EngineSource of `batchllm run --engine instant`: an InstantEngine for each job's model
    and context, built in a second with no vLLM. For checking a job's input, options and output
    end to end on any machine, and for tests whose subject is the job, not the model."""

    def __init__(self, *, step_seconds: float = 0.0) -> None:
        self.step_seconds = step_seconds
        self._engine: InstantEngine | None = None
        self._built_for: tuple[str, int] | None = None

    @property
    def engine(self) -> InstantEngine | None:
        return self._engine

    def get(self, spec: JobSpec, max_model_len: int) -> InstantEngine:
        if spec.engine.task != "generate":
            raise BatchLLMError(
                f"--engine instant simulates text generation only; a {spec.engine.task} job "
                "needs --engine vllm"
            )
        if self._engine is None or self._built_for != (spec.model, max_model_len):
            log.warning(
                "INSTANT ENGINE (simulation): no generation, every request answers with filler "
                "text; the job records hardware %r.",
                InstantEngine.hardware,
            )
            self._engine = InstantEngine(
                tokenizer=light_tokenizer(spec.model),
                max_model_len=max_model_len,
                max_num_seqs=spec.engine.max_num_seqs or 256,
                step_seconds=self.step_seconds,
            )
            self._built_for = (spec.model, max_model_len)
        return self._engine

    def close(self) -> None:
        self._engine = None
