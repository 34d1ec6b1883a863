"""Input line formats, job-level specs and the normalized request every form becomes.

Three line forms are accepted (see docs/input.md):
  {"prompt": "..."}                         plain completion
  {"messages": [{"role": ..., "content": ...}]}  chat, the model's chat template is applied
  {"custom_id", "method": "POST", "url", "body": {...}}  OpenAI's, for an endpoint of
                                                 input/endpoints.py
Sampling overrides sit at the top level of the first two forms and inside `body` for the third.
"""

from __future__ import annotations

import json
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
    """Structured output fields a line may carry (at most one; input/structured.py checks and
    normalizes them)."""

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
        "The job's structured output constraint (input/structured.py), which a "
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
        "e.g. 'Question: {question}' (input/prompt_template.py). Fields are the table's "
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
            from batchllm.input.prompt_template import PromptTemplate

            PromptTemplate.parse(self.prompt_template)  # InputError naming the flag
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


class ToolCallFunction(BaseModel):
    name: NonEmptyStr
    arguments: str = Field(description="The arguments as JSON text, as OpenAI sends them.")


class AssistantToolCall(BaseModel):
    """A tool call of an earlier assistant turn (a multi-turn line's history)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # None only for an assistant turn that called tools (checked below)
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _known_parts(
        cls, value: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        # An image part's reference is checked (and its image opened) by parsing/messages.py,
        # which names the part in its error.
        if isinstance(value, list):
            for part in value:
                kind = part.get("type")
                if kind == "image_url":
                    continue
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        "content parts are {type: text, text} or {type: image_url, image_url}"
                    )
        return value

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for an assistant's tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            part["type"] == "image_url" for part in self.content
        )

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)

    def stored(self) -> dict[str, Any]:
        """The message as the chat template reads it: role and text, plus a tool turn's id
        and an assistant turn's calls with their arguments decoded (templates render them
        as objects, as vLLM's server passes them)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _decoded_arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _decoded_arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class PromptLine(SamplingOverrides, ConstraintFields, CompletionLogprobs):
    custom_id: NonEmptyStr | None = None
    prompt: NonEmptyStr
    adapter: NonEmptyStr | None = Field(default=None, description="A LoRA adapter of the job.")


class ChatLine(SamplingOverrides, ConstraintFields, ChatOptions):
    custom_id: NonEmptyStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    adapter: NonEmptyStr | None = Field(default=None, description="A LoRA adapter of the job.")


class OpenAICompletionBody(SamplingOverrides, ConstraintFields, CompletionLogprobs):
    model: str | None = None
    prompt: NonEmptyStr


class OpenAIChatBody(SamplingOverrides, ConstraintFields, ChatOptions):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)


EmbeddingInput = NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]


class EmbeddingLine(BaseModel):
    """A text (or a list of texts) to embed, in an embedding job."""

    model_config = ConfigDict(extra="forbid")

    custom_id: NonEmptyStr | None = None
    input: EmbeddingInput
    dimensions: Int | None = Field(
        default=None, ge=1, description="Truncate to this many dimensions (Matryoshka models)."
    )


class OpenAIEmbeddingBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: EmbeddingInput
    dimensions: Int | None = Field(default=None, ge=1)
    encoding_format: Literal["float"] | None = Field(
        default=None, description="Only float: the vectors are a Parquet list<float32> column."
    )
    user: str | None = None


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


# A text or a list of them, read as a list: one type rather than a union, so that a refusal
# names the field itself (a union's error names each member tried).
ScoreTexts = Annotated[list[NonEmptyStr], BeforeValidator(_one_or_many), Field(min_length=1)]


class OpenAIScoreBody(BaseModel):
    """A /v1/score line's body as vLLM's run-batch takes it (ScoreTextRequest): `text_1`
    against each `text_2`, one text of `text_1` against them all or one per `text_2`
    (input/scoring.py checks the counts)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    text_1: ScoreTexts
    text_2: ScoreTexts
    user: str | None = None


class OpenAIRerankBody(BaseModel):
    """A /v1/rerank line's body as vLLM's run-batch takes it (RerankRequest)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    query: NonEmptyStr
    documents: ScoreTexts
    top_n: Int | None = Field(
        default=None, ge=0, description="The best documents to return (0 or none: all)."
    )
    user: str | None = None


class ClassifyLine(BaseModel):
    """A text to classify, in a classification job."""

    model_config = ConfigDict(extra="forbid")

    custom_id: NonEmptyStr | None = None
    input: NonEmptyStr


class OpenAIClassifyBody(BaseModel):
    """A /v1/classify line's body (vLLM's ClassificationRequest, one text)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: NonEmptyStr
    user: str | None = None


# What a request asks of the engine, stored as its row's kind (input/rows.py).
RequestKind = Literal["prompt", "chat", "embed", "score", "classify"]


class Request(BaseModel):
    """One validated input line in the one shape the engine path consumes."""

    line: int
    custom_id: str
    kind: RequestKind
    prompt: str | None = None  # also the text of an embedding or classify line with one input
    # {role, content}: content a string, or for a message with images its parts, text
    # {type: text, text} and images {type: image_url, image_url: {url}} (references, not pixels)
    messages: list[dict[str, Any]] | None = None
    # The texts of an embedding line with a list input; of a score line, its queries then
    # its documents (input/scoring.py).
    inputs: list[str] | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)


class LineError(BaseModel):
    """A line that cannot run. It still becomes one output row, with status `error`."""

    file: str
    line: int
    custom_id: str
    field: str | None
    message: str
    code: str | None = unset(
        "OpenAI's error code for the refusal (input/parsing/problems.py); None: "
        "decided from the message when exported."
    )

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" + (f" field '{self.field}'" if self.field else "")
        return f"{where}: {self.message}"
