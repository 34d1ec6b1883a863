"""Input line formats and the normalized request every form becomes (a job's spec: spec.py).

Three line forms are accepted (see docs/input.md):
  {"prompt": "..."}                         plain completion
  {"messages": [{"role": ..., "content": ...}]}  chat, the model's chat template is applied
  {"custom_id", "method": "POST", "url", "body": {...}}  OpenAI's, for an endpoint of
                                                 input/parsing/endpoints.py
Sampling overrides sit at the top level of the first two forms and inside `body` for the third.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from batchllm.spec import (
    MAX_TOKENS_LIMIT,
    ChatOptions,
    CompletionLogprobs,
    ConstraintFields,
    Int,
    NonEmptyStr,
    SamplingOverrides,
    unset,
)


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
    (input/formats/scoring.py checks the counts)."""

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


# What a request asks of the engine, stored as its row's kind (input/formats/rows.py).
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
    # its documents (input/formats/scoring.py).
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
