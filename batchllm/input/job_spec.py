"""A job's settings have one front door: the CLI's flags (cli/options.py), the Client's keyword
arguments (client.py) and a Batch API request (api/batches.py) all become a JobSpec here, and
the task, when the caller names none, is inferred here from the requests themselves."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchllm.input.schemas import EngineOptions, JobSpec, SamplingDefaults
from batchllm.input.structured import constraint_of

SAMPLING_FIELDS = frozenset(SamplingDefaults.model_fields)
ENGINE_FIELDS = frozenset(EngineOptions.model_fields)


def build_job_spec(
    model: str,
    *,
    requests: str | Path | None = None,
    json_schema: dict[str, Any] | None = None,
    choice: list[str] | None = None,
    regex: str | None = None,
    lora: Mapping[str, str] | None = None,
    chat_template: str | None = None,
    metadata: Mapping[str, str] | None = None,
    priority: str = "normal",
    **options: Any,
) -> JobSpec:
    """A JobSpec from job options by their field names (max_tokens, temperature, top_p, n,
    logprobs, structured, task, max_model_len, dtype, ...); unknown names are refused.

    A task given as None, or not at all, is read off `requests` (an embeddings file makes an
    embed job) or, with no requests to read, is `generate`."""
    unknown = set(options) - SAMPLING_FIELDS - ENGINE_FIELDS
    if unknown:
        raise TypeError(f"unknown job option(s): {', '.join(sorted(unknown))}")
    sampling = {k: v for k, v in options.items() if k in SAMPLING_FIELDS}
    constraint = constraint_of({"json": json_schema, "choice": choice, "regex": regex})
    if constraint is not None:
        sampling["structured"] = constraint
    engine = {k: v for k, v in options.items() if k in ENGINE_FIELDS}
    if engine.get("task") is None:
        # Lazily: `batchllm --help` and `import batchllm` stay instant.
        from batchllm.input.validate import infer_task

        engine["task"] = infer_task(requests) if requests is not None else "generate"
    return JobSpec(
        model=model,
        sampling=SamplingDefaults(**sampling),
        engine=EngineOptions(**engine),
        metadata=dict(metadata or {}),
        chat_template=chat_template,
        adapters=dict(lora or {}),
        priority=priority,  # type: ignore[arg-type]  # pydantic refuses other values
    )
