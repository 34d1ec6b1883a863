"""What a finished engine request becomes in its shard's output buffer: an answer, an
embedding, scores, a class or an error row. The output layer cannot see the engine's types
(it sits below it), so the mapping from one to the other lives here, beside the runner."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from batchllm.engine.protocol import REJECTED, Adapter, Finished
from batchllm.input.formats.rows import InputRow
from batchllm.input.formats.scoring import ScoreShape, pair_scores
from batchllm.input.formats.structured import field_of, satisfies
from batchllm.output.parts import OutputBuffer
from batchllm.row_errors import ENGINE_ERROR, REQUEST_REJECTED

# Only these end a request with its full answer. vLLM reports "abort" for a request it dropped
# (the engine stopping, e.g. on a Ctrl-C that reached it): such a request must run again.
RESULT_REASONS = ("stop", "length")


@dataclass(frozen=True, slots=True)
class Sampling:
    """What rows with the same job and per-line override text run under (built once)."""

    params: Any  # the engine's sampling parameters
    constraint: dict[str, Any] | None  # the structured output constraint
    adapter: Adapter | None  # what the engine runs the row through
    adapter_name: str | None  # the LoRA adapter the output names; None for the base model


def record_finished(buffer: OutputBuffer, row: InputRow, sampling: Sampling, out: Finished) -> None:
    """Add a finished request's row to the buffer (an "abort" is the caller's to handle)."""
    if out.finish_reason == REJECTED:  # refused when added (a kept engine's way)
        record_refused(buffer, row, out.prompt_tokens, sampling, out.text)
    elif out.scores is not None:  # a cross-encoder's
        buffer.scored(row.custom_id, row.line, out.prompt_tokens, out.scores)
    elif out.is_classification:
        buffer.classified(row.custom_id, row.line, out.prompt_tokens, out.label, out.probs or [])
    elif out.is_embedding and row.kind == "score":
        scores = pair_scores(ScoreShape.of(row.overrides()), out.embeddings or [])
        buffer.scored(row.custom_id, row.line, out.prompt_tokens, scores)
    elif out.is_embedding:
        buffer.embedding(row.custom_id, row.line, out.prompt_tokens, out.embedding, out.embeddings)
    elif out.finish_reason in RESULT_REASONS:
        _record_answer(buffer, row, sampling, out, out.finish_reason)
    else:
        buffer.failed(
            row.custom_id,
            row.line,
            f"vLLM ended the request with finish reason {out.finish_reason!r}",
            ENGINE_ERROR,
            prompt_tokens=out.prompt_tokens,
        )


def _record_answer(
    buffer: OutputBuffer, row: InputRow, sampling: Sampling, out: Finished, finish_reason: str
) -> None:
    constraint = sampling.constraint
    calls = out.tool_calls
    if calls:
        calls = with_call_ids(row.custom_id, calls)
        if finish_reason == "stop":  # OpenAI's reason for an answer that calls
            finish_reason = "tool_calls"
    buffer.answer(
        row.custom_id,
        row.line,
        out.text,
        finish_reason,
        out.prompt_tokens,
        out.completion_tokens,
        satisfied(constraint, out) if constraint else None,
        out.logprobs,
        out.choices,
        sampling.adapter_name,
        out.reasoning,
        out.reasoning_tokens,
        calls,
    )


def record_refused(
    buffer: OutputBuffer,
    row: InputRow,
    prompt_tokens: int,
    sampling: Sampling,
    exc: Exception | str,
) -> None:
    """The error row of a request the engine refused. A constraint the engine cannot compile,
    embedding dimensions the model does not have, or a logit_bias token id past its vocabulary
    is the usual cause: name the field."""
    constraint = sampling.constraint
    where = f"field '{field_of(constraint)}': " if constraint else ""
    if not where and getattr(sampling.params, "dimensions", None) is not None:
        where = "field 'dimensions': "
    if not where and getattr(sampling.params, "logit_bias", None) and "logit_bias" in str(exc):
        where = "field 'logit_bias': "  # a token id past the model's vocabulary
    buffer.failed(
        row.custom_id,
        row.line,
        f"{where}rejected by vLLM: {exc}",
        REQUEST_REJECTED,
        prompt_tokens=prompt_tokens,
    )


def satisfied(constraint: dict[str, Any], out: Finished) -> bool | None:
    """Whether the generated text meets its constraint: the whole text the constraint ran
    over, before thinking and tool calls were split off it."""
    return satisfies(constraint, out.raw_text if out.raw_text is not None else out.text)


def with_call_ids(custom_id: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls with OpenAI-style ids, derived from the row so a rerun gives the same."""
    return [
        {
            "id": "call_"
            + hashlib.blake2b(f"{custom_id}/{i}".encode(), digest_size=12).hexdigest(),
            **call,
        }
        for i, call in enumerate(calls)
    ]
