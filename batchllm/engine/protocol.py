"""What the shard runner needs of an engine, as types: the vLLM engine, the bench's instant
engine and the tests' fake engines all satisfy these Protocols (checked by mypy). No vLLM here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from batchllm.engine.prompts import Prepared
from batchllm.input.formats.rows import InputRow
from batchllm.spec import JobSpec

# The finish reason of a request the engine refused when it was added, for an engine that
# reports refusals with its finished requests rather than from `add` (a kept engine in another
# process, which takes a run's requests in batches): `text` holds the engine's reason.
REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter a request runs through: its name in the job and where it is stored."""

    name: str
    path: str
    # A base-model row of a job with adapters: `path` is one of the job's adapters, whose
    # shapes an engine may need for a zero-weight stand-in (see VllmEngine._lora_request).
    base: bool = False


@dataclass(slots=True)
class Finished:
    """One finished request as the runner needs it."""

    request_id: str
    text: str  # the first sample's, as are finish_reason, completion_tokens and logprobs
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens served from the engine's prefix cache (vLLM's num_cached_tokens).
    cached_tokens: int = 0
    # One {token, logprob, top_logprobs} per generated token, when the request asked for them.
    logprobs: list[dict[str, Any]] | None = None
    # Every sample {index, text, finish_reason, completion_tokens, logprobs} when n > 1.
    choices: list[dict[str, Any]] | None = None
    # An embedding request's vector (one input), or its vectors (a list input).
    embedding: list[float] | None = None
    embeddings: list[list[float]] | None = None
    # A classification request's class probabilities and its most likely class's name.
    probs: list[float] | None = None
    label: str | None = None
    # A score row's score per pair, from a cross-encoder (a bi-encoder's come as embeddings).
    scores: list[float] | None = None
    # With a reasoning parser: the thinking (`text` holds the answer alone) and its tokens.
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    # Parsed tool calls {name, arguments, arguments_valid} (engine/outputs.py).
    tool_calls: list[dict[str, Any]] | None = None
    # The generated text before the above were split off it (None: nothing was split).
    raw_text: str | None = None

    @property
    def is_embedding(self) -> bool:
        return self.embedding is not None or self.embeddings is not None

    @property
    def is_classification(self) -> bool:
        return self.probs is not None

    @property
    def generated_tokens(self) -> int:
        """Tokens generated over all samples (throughput counts every one)."""
        if self.choices:
            return sum(c["completion_tokens"] for c in self.choices)
        return self.completion_tokens


class Engine(Protocol):
    """A continuous-batching engine driven request by request."""

    version: str  # recorded per job, e.g. vLLM's version
    hardware: str  # recorded per job: throughput depends on it
    max_num_seqs: int  # requests per step; the runner keeps a few times this many in flight
    max_model_len: int  # the context `prepare` checks rows against

    def prepare(self, rows: list[InputRow], chat_template: str | None = None) -> list[Prepared]:
        """Token ids per stored input row, or the reason the row cannot run. `chat_template`
        (the job's) replaces the model's own for chat rows."""

    def sampling_params(self, merged: dict[str, Any]) -> Any:
        """The engine's sampling parameters for merged job and line settings."""

    def add(
        self, request_id: str, token_ids: Any, params: Any, adapter: Adapter | None = None
    ) -> None:
        """Queue one request (`token_ids` as `prepare` gave them: a list of ids, or a list of
        them for a list embedding input), through a LoRA adapter when given; a
        BatchLLMError when the engine refuses this request alone, EngineDied when the
        engine is gone."""

    def step(self) -> list[Finished]:
        """Run one step; the requests that finished in it. EngineDied when the engine is gone."""

    def has_unfinished(self) -> bool: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def shutdown(self) -> None: ...


class EngineSource(Protocol):
    """Hands out the engine for a job's settings (the warm-engine cache, or a test's fake)."""

    @property
    def engine(self) -> Engine | None:
        """The engine handed out last, if it is still up."""

    def get(self, spec: JobSpec, max_model_len: int) -> Engine: ...

    def close(self) -> None: ...
