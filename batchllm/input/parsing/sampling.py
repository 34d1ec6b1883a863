"""The settings a line stores with its row (its `sampling` text): sampling overrides, the sample
count, log probabilities, structured output, tools, chat template options and the adapter."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from batchllm.input.formats.rows import TEMPLATE_OPTIONS
from batchllm.input.formats.structured import ConstraintError, constraint_of
from batchllm.input.formats.tools import line_tool_settings
from batchllm.input.parsing.problems import LineProblem
from batchllm.spec import ChatOptions, CompletionLogprobs, ConstraintFields, SamplingOverrides

_SAMPLING_FIELDS = tuple(SamplingOverrides.model_fields)  # in field order: a stable stored text


def sampling_of(parsed: BaseModel, max_n: int, prefix: str = "") -> dict[str, Any]:
    """The settings a line stores with its row: sampling overrides, then the normalized
    sample count (at most `max_n`), log probabilities, constraint and chat template options."""
    # The sampling fields are numbers, booleans, strings and lists of strings: reading the
    # attributes gives what model_dump would, without its serializer (per line, on the hot path).
    sampling = {}
    for name in _SAMPLING_FIELDS:
        value = getattr(parsed, name, None)
        if value is not None:
            sampling[name] = value
    if sampling.get("n", 1) > max_n:
        raise LineProblem(
            prefix + "n", f"n is {sampling['n']}; at most {max_n} samples (BATCHLLM_MAX_N)"
        )
    if isinstance(parsed, ChatOptions):
        if parsed.top_logprobs is not None and not parsed.logprobs:
            raise LineProblem(prefix + "top_logprobs", "top_logprobs needs logprobs: true")
        if parsed.logprobs:
            sampling["logprobs"] = parsed.top_logprobs or 0
        elif parsed.logprobs is False:
            sampling["logprobs"] = None  # switches the job's --logprobs off for this line
        if parsed.add_generation_prompt and parsed.continue_final_message:
            raise LineProblem(
                prefix + "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true",
            )
        for name in TEMPLATE_OPTIONS:
            value = getattr(parsed, name)
            if value is not None:
                sampling[name] = value
    elif isinstance(parsed, CompletionLogprobs) and parsed.logprobs is not None:
        sampling["logprobs"] = parsed.logprobs
    if isinstance(parsed, ConstraintFields) and _has_constraint(parsed):
        try:
            constraint = constraint_of(parsed.constraint_fields())
        except ConstraintError as exc:
            raise LineProblem(prefix + exc.field, exc.message) from None
        if constraint is not None or parsed.response_format is not None:
            # response_format text: this line runs unconstrained, whatever the job's default
            sampling["structured"] = constraint
    if isinstance(parsed, ChatOptions) and (
        parsed.tools is not None or parsed.tool_choice is not None
    ):
        _add_tools(parsed, sampling, prefix)
    return sampling


def _add_tools(parsed: ChatOptions, sampling: dict[str, Any], prefix: str) -> None:
    """The line's tools and tool_choice, and the constraint a forced call runs under."""
    try:
        settings, enforced = line_tool_settings(
            parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls
        )
    except ConstraintError as exc:
        raise LineProblem(prefix + exc.field, exc.message) from None
    if enforced is not None:
        if sampling.get("structured"):
            raise LineProblem(
                prefix + "tool_choice",
                "a forced tool call and a structured output constraint cannot both apply",
            )
        sampling["structured"] = enforced
    sampling.update(settings)


def _has_constraint(parsed: ConstraintFields) -> bool:
    return not (
        parsed.response_format is None
        and parsed.json_schema_ is None
        and parsed.choice is None
        and parsed.regex is None
        and parsed.grammar is None
    )


def picked_adapter(name: str | None, adapters: frozenset[str]) -> dict[str, str]:
    """The line's adapter setting: {} for the base model; LineProblem for an unknown name."""
    if name is None:
        return {}
    if name not in adapters:
        known = ", ".join(sorted(adapters)) or "none (give them with --lora NAME=PATH)"
        raise LineProblem("adapter", f"unknown adapter {name!r}; this job's adapters: {known}")
    return {"adapter": name}


def model_adapter(model: str | None, adapters: frozenset[str]) -> dict[str, str]:
    """In the OpenAI form a body.model naming one of the job's adapters picks it (as with
    vLLM's server); any other model name runs the job's model."""
    return {"adapter": model} if model is not None and model in adapters else {}
