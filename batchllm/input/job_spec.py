"""A job's settings have one front door: the CLI's flags (cli/options.py), the Client's keyword
arguments (client.py) and a Batch API request (api/batches.py) all become a JobSpec here, and
the task, when the caller names none, is inferred here from the requests themselves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from batchllm.errors import InputError
from batchllm.input.formats.structured import constraint_of
from batchllm.settings import Settings
from batchllm.spec import GENERATE, EngineOptions, JobSpec, SamplingDefaults, TableColumns

if TYPE_CHECKING:  # pyarrow stays out of `batchllm --help`'s imports
    from batchllm.input.files.source import InputSource

SAMPLING_FIELDS = frozenset(SamplingDefaults.model_fields)
ENGINE_FIELDS = frozenset(EngineOptions.model_fields)


class OptionOverLimit(InputError):
    """A job option over the deployment's limit. `option` names it, so that each front door
    can name it its own way (the CLI by its flag); `reason` is the rest of the message."""

    def __init__(self, option: str, reason: str) -> None:
        super().__init__(f"{option}: {reason}")
        self.option = option
        self.reason = reason


def build_job_spec(
    model: str,
    *,
    settings: Settings,
    requests: InputSource | None = None,
    json_schema: dict[str, Any] | None = None,
    choice: list[str] | None = None,
    regex: str | None = None,
    lora: Mapping[str, str] | None = None,
    chat_template: str | None = None,
    metadata: Mapping[str, str] | None = None,
    prompt_column: str | None = None,
    messages_column: str | None = None,
    prompt_template: str | None = None,
    id_column: str | None = None,
    system: str | None = None,
    priority: str = "normal",
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    parents: list[str] | None = None,
    after: list[str] | None = None,
    **options: Any,
) -> JobSpec:
    """A JobSpec from job options by their field names (max_tokens, temperature, top_p, n,
    logprobs, structured, task, max_model_len, dtype, ...); unknown names are refused, and
    `n` over the settings' max_n (OptionOverLimit).

    A task given as None, or not at all, is read off `requests` (an embeddings file makes an
    embed job) or, with no requests to read, is `generate`.

    `prompt_column` or `messages_column` (with `id_column`, `system`): `requests` is a Parquet
    or CSV file read by these columns (validation/table.py), checked here before any job exists.
    `prompt_template` builds each row's prompt from a table's columns or a JSONL file's keys
    (input/formats/prompt_template.py).
    `requests`: the resolved input file (input/files/source.py), read as `settings` say.
    `parents`: the jobs whose rows `requests` holds (jobs/parent_rows.py), recorded; `after`:
    the jobs a fleet job waits for (store/dependencies.py)."""
    unknown = set(options) - SAMPLING_FIELDS - ENGINE_FIELDS
    if unknown:
        raise TypeError(f"unknown job option(s): {', '.join(sorted(unknown))}")
    sampling = {k: v for k, v in options.items() if k in SAMPLING_FIELDS}
    constraint = constraint_of({"json": json_schema, "choice": choice, "regex": regex})
    if constraint is not None:
        sampling["structured"] = constraint
    defaults = SamplingDefaults(**sampling)
    if defaults.n > settings.max_n:  # before any line is read; a line's own n: validation's
        raise OptionOverLimit("n", f"{defaults.n} is over BATCHLLM_MAX_N ({settings.max_n})")
    engine = {k: v for k, v in options.items() if k in ENGINE_FIELDS}
    table = _table_columns(
        requests, prompt_column, messages_column, prompt_template, id_column, system
    )
    if engine.get("task") is None:
        # Lazily: `batchllm --help` and `import batchllm` stay instant.
        from batchllm.input.validation.validate import infer_task

        lines = requests if table is None else None
        engine["task"] = infer_task(lines, settings) if lines is not None else GENERATE
    if table is not None and requests is not None:
        from batchllm.input.validation.table import table_schema

        table_schema(requests, table, engine["task"], settings=settings)
    return JobSpec(
        model=model,
        sampling=defaults,
        engine=EngineOptions(**engine),
        metadata=dict(metadata or {}),
        chat_template=chat_template,
        adapters=dict(lora or {}),
        table=table,
        priority=priority,  # type: ignore[arg-type]  # pydantic refuses other values
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        parents=list(parents or []),
        after=list(after or []),
    )


def _table_columns(
    requests: InputSource | None,
    prompt_column: str | None,
    messages_column: str | None,
    prompt_template: str | None,
    id_column: str | None,
    system: str | None,
) -> TableColumns | None:
    """The table options, or None for a JSONL file read as request lines; InputError when
    they do not fit the file. A JSONL file with a prompt template is read as a table whose
    columns are its lines' keys."""
    given = {
        "prompt_column": prompt_column,
        "messages_column": messages_column,
        "prompt_template": prompt_template,
    }
    named = {k: v for k, v in given.items() if v is not None}
    extra = {"id_column": id_column, "system": system}
    fmt = requests.table_format if requests is not None else None
    if not named:
        if fmt is not None:
            raise InputError(
                f"{requests}: a {fmt} file needs prompt_column (--prompt-column) or "
                "messages_column (--messages-column) to say where its requests are"
            )
        if any(value is not None for value in extra.values()):
            used = ", ".join(k for k, v in extra.items() if v is not None)
            raise InputError(
                f"{used}: for a Parquet or CSV input (with prompt_column, messages_column "
                "or prompt_template), or a JSONL input with prompt_template"
            )
        return None
    if len(named) > 1:
        raise InputError(f"give one of {', '.join(named)}, not both")
    if requests is not None and fmt is None and prompt_template is None:
        raise InputError(
            f"{requests}: {', '.join(named)} reads a Parquet (.parquet) or CSV (.csv) file; "
            "this one is read as JSONL"
        )
    return TableColumns(**named, **{k: v for k, v in extra.items() if v is not None})
