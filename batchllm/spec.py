"""A job's spec: what a job asks of its engine and its sampling, the same whichever front door
made it (the CLI's flags, the Client's keyword arguments, a Batch API request, a pipeline
file's stage): `JobSpec` with its `EngineOptions` and `SamplingDefaults`, and the sampling
fields a line may override (`SamplingOverrides` and the option groups the line formats in
input/formats/schemas.py share).

It sits at the foundation, below every layer: 41 modules outside input/ read a job's spec, and
with it in the input parser the engine and the store sat above the line formats only to reach
it. A prompt template's syntax is checked here too (`template_pieces`), where a table's spec
names one; input/formats/prompt_template.py renders it.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from batchllm.errors import InputError

NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]

# No model generates this many tokens in one request (the longest contexts are about 1M
# tokens); a larger max_tokens is a typo or a unit mistake, and it would silently size the
# job's context to the model's maximum, which costs KV cache and concurrency for every row.
MAX_TOKENS_LIMIT = 1_048_576


def _not_a_boolean(value: Any) -> Any:
    # Lax pydantic reads true as 1 and false as 0: `"max_tokens": true` would run with 1 token.
    if isinstance(value, bool):
        raise PydanticCustomError("number_not_bool", "Input should be a number, not true/false")
    return value


# int and float that refuse booleans; every number field of a line or of the job's defaults.
Int = Annotated[int, BeforeValidator(_not_a_boolean)]
Float = Annotated[float, BeforeValidator(_not_a_boolean)]


def unset(description: str) -> Any:
    """A field that is None unless given: what None means is in its description."""
    return Field(default=None, description=description)


class SamplingOverrides(BaseModel):
    """Per-line sampling settings; any field left out takes the job's default."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: Int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_LIMIT, description="Most tokens to generate."
    )
    temperature: Float | None = Field(default=None, ge=0, description="0 means greedy.")
    top_p: Float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: Int | None = Field(
        default=None, description="Sample from the k likeliest; -1 or 0: all."
    )
    min_p: Float | None = Field(
        default=None, ge=0, le=1, description="Minimum relative probability."
    )
    stop: str | list[str] | None = Field(default=None, description="Stop strings.")
    seed: Int | None = Field(default=None, description="Per-request sampling seed.")
    presence_penalty: Float | None = Field(default=None, ge=-2, le=2, description="OpenAI-style.")
    frequency_penalty: Float | None = Field(default=None, ge=-2, le=2, description="OpenAI-style.")
    repetition_penalty: Float | None = Field(default=None, gt=0, description="vLLM-style.")
    ignore_eos: bool | None = Field(default=None, description="Keep generating past EOS.")
    n: Int | None = Field(
        default=None, ge=1, description="Samples per request (capped by BATCHLLM_MAX_N)."
    )
    logit_bias: dict[str, Float] | None = Field(
        default=None,
        description="OpenAI's: token id (a string) -> a bias from -100 to 100 added to its logit "
        "(vLLM's SamplingParams.logit_bias; an id past the vocabulary is the row's error).",
    )

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit()):
                raise ValueError(f"key {token!r} is not a token id (a non-negative integer)")
            if not -100 <= bias <= 100:  # OpenAI's range (vLLM would clamp it silently)
                raise ValueError(f"the bias of token {token} is {bias}: from -100 to 100")
        return value or None  # {} asks nothing


# Most alternatives per generated token that `logprobs`/`top_logprobs` may ask for (OpenAI's cap).
MAX_TOP_LOGPROBS = 20


class ConstraintFields(BaseModel):
    """Structured output fields a line may carry (at most one; input/formats/structured.py checks
    and normalizes them)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    response_format: Any = Field(
        default=None, description="OpenAI: {type: json_object | json_schema | text}."
    )
    json_schema_: Any = Field(default=None, alias="json", description="A JSON schema.")
    choice: Any = Field(default=None, description="The output is one of these strings.")
    regex: Any = Field(default=None, description="The output fully matches this regex.")
    grammar: Any = Field(default=None, description="A GBNF or Lark grammar.")

    def constraint_fields(self) -> dict[str, Any]:
        return {
            "response_format": self.response_format,
            "json": self.json_schema_,
            "choice": self.choice,
            "regex": self.regex,
            "grammar": self.grammar,
        }


class CompletionLogprobs(BaseModel):
    """Completions-style log probabilities: `logprobs: K` alternatives per token."""

    logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class ChatOptions(BaseModel):
    """Chat-style log probabilities and chat template control."""

    # Strict: `"logprobs": 3` copied from a completions line must not pass as true.
    logprobs: StrictBool | None = Field(default=None, description="Return log probabilities.")
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extra variables for the chat template."
    )
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    tools: list[Any] | None = Field(
        default=None, description="OpenAI function tools the chat template renders."
    )
    tool_choice: Any = Field(
        default=None, description="none | auto | required | {type: function, function: {name}}."
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: at most one call under tool_choice required."
    )


# Job settings a line may switch off by storing null (see SamplingDefaults.merged).
_SWITCHABLE = frozenset({"logprobs", "structured"})


class SamplingDefaults(BaseModel):
    """Job-level sampling defaults (CLI flags); lines override them field by field."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: Int = Field(
        default=256, ge=1, le=MAX_TOKENS_LIMIT, description="Most tokens to generate per request."
    )
    temperature: Float = Field(default=1.0, ge=0, description="Sampling temperature; 0 = greedy.")
    top_p: Float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    ignore_eos: bool = Field(default=False, description="Generate exactly max_tokens tokens.")
    n: Int = Field(default=1, ge=1, description="Samples per request.")
    logprobs: Int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Log probabilities of each generated token with this many alternatives.",
    )
    structured: dict[str, Any] | None = unset(
        "The job's structured output constraint (input/formats/structured.py), which a "
        "line's own constraint replaces."
    )

    def merged(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The full sampling settings for one request: these defaults under its overrides.
        A null override means "not given", except for the settings a line may switch off
        (`"logprobs": false`, `response_format` text): there a stored null wins."""
        return {
            **self.model_dump(),
            **{k: v for k, v in overrides.items() if v is not None or k in _SWITCHABLE},
        }


# What a job's engine does, one task per job: generate text, embed texts (vLLM's pooling runner),
# or classify them (a sequence-classification model).
Task = Literal["generate", "embed", "classify"]
GENERATE: Task = "generate"
EMBED: Task = "embed"
CLASSIFY: Task = "classify"
TASKS: tuple[Task, ...] = (GENERATE, EMBED, CLASSIFY)
POOLING_TASKS = frozenset({EMBED, CLASSIFY})  # no text generated: generation flags do nothing


class EngineOptions(BaseModel):
    """vLLM engine settings. `None` means: let batchllm or vLLM choose (see descriptions)."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1, description="GPU memory share.")
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="Context length. Default: the job's longest prompt plus its max_tokens, "
        "capped by the model; oversizing it only costs KV cache.",
    )
    max_num_seqs: int | None = Field(default=None, ge=1, description="Sequences per engine step.")
    max_num_batched_tokens: int | None = Field(default=None, ge=1, description="Tokens per step.")
    dtype: str = Field(default="auto", description="Weights/activations dtype, e.g. bfloat16.")
    quantization: str | None = Field(default=None, description="e.g. fp8, awq, gptq.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per engine.")
    enable_prefix_caching: bool | None = Field(default=None, description="vLLM default: on.")
    enforce_eager: bool = Field(default=False, description="Skip CUDA graph capture.")
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        ge=1,
        description="KV cache size in bytes. Default: vLLM's (a share of GPU memory; on CPUs "
        "VLLM_CPU_KVCACHE_SPACE GiB).",
    )
    compact_json: bool = Field(
        default=False,
        description="JSON-constrained answers without whitespace between tokens: fewer "
        "tokens, and a weak model cannot spend max_tokens on whitespace. Uses vLLM's "
        "xgrammar backend for every constraint (no fallback to guidance).",
    )
    task: Task = Field(
        default=GENERATE,
        description="generate: text completions; embed: vectors from vLLM's pooling runner "
        "(and /v1/score and /v1/rerank lines, scored as the cosine of their texts' vectors); "
        "classify: class probabilities from a sequence-classification model.",
    )
    enable_lora: bool = Field(
        default=False, description="Serve LoRA adapters (set when the job has adapters)."
    )
    max_lora_rank: int | None = Field(
        default=None, ge=1, description="Largest adapter rank the engine serves (vLLM: 16)."
    )
    max_loras: int | None = Field(
        default=None, ge=1, description="Adapters in one batch (the job's adapter count)."
    )
    group_prefixes: bool = Field(
        default=True,
        description="Run requests that share a prompt prefix next to each other so the prefix "
        "cache pays; output row identity is unchanged.",
    )

    def engine_key(self, model: str) -> str:
        """Identity of a built engine: a warm engine is reused only for an equal key."""
        return model + "|" + self.model_dump_json(exclude={"group_prefixes"})


class TableColumns(BaseModel):
    """How the rows of a Parquet or CSV input become requests (docs/input.md, table input)."""

    model_config = ConfigDict(extra="forbid")

    prompt_column: NonEmptyStr | None = Field(
        default=None, description="The column holding each row's prompt text."
    )
    messages_column: NonEmptyStr | None = unset(
        "The column holding each row's chat messages: a list of {role, content} "
        "structs, or their JSON text."
    )
    prompt_template: NonEmptyStr | None = unset(
        "Each row's prompt built from its fields: `str.format` named fields, "
        "e.g. 'Question: {question}' (input/formats/prompt_template.py). Fields are the table's "
        "columns, or a JSONL line's own keys."
    )
    id_column: NonEmptyStr | None = unset(
        "The column whose value becomes the row's custom_id (default: the row "
        "number, from 1; for a JSONL file with a template, the line's custom_id, else its "
        "line number)."
    )
    system: str | None = Field(
        default=None, description="A system message put before every row's prompt or messages."
    )

    @model_validator(mode="after")
    def _one_text_column(self) -> TableColumns:
        given = [self.prompt_column, self.messages_column, self.prompt_template]
        if sum(value is not None for value in given) != 1:
            raise ValueError("give one of prompt_column, messages_column and prompt_template")
        if self.prompt_template is not None:
            template_pieces(self.prompt_template)  # InputError naming the flag
        return self


Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")


class JobSpec(BaseModel):
    """Everything a job needs besides its input rows."""

    model: NonEmptyStr = Field(description="Model path or name, as vLLM loads it.")
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    engine: EngineOptions = Field(default_factory=EngineOptions)
    metadata: dict[str, str] = Field(default_factory=dict, description="Free-form labels.")
    chat_template: str | None = Field(
        default=None, description="A Jinja chat template replacing the model's own."
    )
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters lines may pick by name: name -> path (once the job is "
        "created, the copy in the job's storage).",
    )
    table: TableColumns | None = unset(
        "For a Parquet or CSV input: the columns its rows are read from."
    )
    priority: Priority = Field(
        default="normal",
        description="Which queued shards a worker takes first (worker/fair_share.py).",
    )
    reasoning_parser: NonEmptyStr | None = unset(
        "vLLM's reasoning parser (e.g. deepseek_r1, qwen3): the thinking goes to "
        "the `reasoning` column, the answer to `text`."
    )
    tool_call_parser: NonEmptyStr | None = unset(
        "vLLM's tool call parser (e.g. hermes, llama3_json) for tool_choice auto."
    )
    parents: list[NonEmptyStr] = Field(
        default_factory=list,
        description="The jobs whose rows this job reads (`--from`), recorded with it.",
    )
    after: list[NonEmptyStr] = Field(
        default_factory=list,
        description="The jobs this job starts after (`submit --after`): it waits until they "
        "all complete, and fails if one of them does not.",
    )

    @model_validator(mode="after")
    def _lora_engine(self) -> JobSpec:
        """A job with adapters needs an engine built for them; the engine settings follow
        from the adapters, so a caller's spec and the stored one build the same engine."""
        if self.adapters and not self.engine.enable_lora:
            self.engine = self.engine.model_copy(
                update={
                    "enable_lora": True,
                    # Adapters one batch may mix: vLLM reserves memory for each slot and
                    # swaps adapters in and out beyond it.
                    "max_loras": self.engine.max_loras or min(len(self.adapters), 8),
                }
            )
        return self


TEMPLATE_FLAG = "--prompt-template"


def template_pieces(text: str) -> tuple[tuple[str, str | None], ...]:
    """A prompt template's literal texts around its fields, `(literal, field or None)` each;
    InputError naming the flag and the field for a template batchllm does not take
    (input/formats/prompt_template.py says which)."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:  # "Single '}' encountered", "unmatched '{'"
        raise InputError(
            f"{TEMPLATE_FLAG}: {exc} (write {{{{ and }}}} for literal braces)"
        ) from None
    pieces = []
    for literal, field, spec, conversion in parsed:
        if field is not None:
            _check_field(field, spec, conversion)
        pieces.append((literal, field))
    if not any(field is not None for _, field in pieces):
        raise InputError(
            f"{TEMPLATE_FLAG}: {text!r} names no field; write the fields as {{name}} "
            "(e.g. 'Question: {question}')"
        )
    return tuple(pieces)


def _check_field(field: str, spec: str | None, conversion: str | None) -> None:
    if field == "" or field.isdigit():
        raise InputError(
            f"{TEMPLATE_FLAG}: positional field {{{field}}}; name the field, e.g. {{question}}"
        )
    if any(mark in field for mark in ".[]"):
        raise InputError(
            f"{TEMPLATE_FLAG}: field {{{field}}}: attribute and index access are not supported; "
            "name a column or key as it is"
        )
    if conversion or spec:
        raise InputError(
            f"{TEMPLATE_FLAG}: field {{{field}}} has a conversion or format spec "
            f"({'!' + conversion if conversion else ''}{':' + spec if spec else ''}); "
            "a template only places each field's text"
        )
