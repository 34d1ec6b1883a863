"""One decoded line into a Request: by its form (prompt, messages, input, or OpenAI's batch
line for an endpoint of endpoints.py) and the job's task; or the LineProblem refusing it."""

from __future__ import annotations

import json
from typing import Any

from batchllm.input.files.custom_ids import default_custom_id
from batchllm.input.formats import schemas as bodies  # the OpenAI bodies a line may carry
from batchllm.input.formats.schemas import (
    ChatLine,
    ClassifyLine,
    EmbeddingLine,
    PromptLine,
    Request,
)
from batchllm.input.formats.scoring import rerank_request, score_request, unpaired
from batchllm.input.formats.structured import ConstraintError
from batchllm.input.parsing.endpoints import (
    CHAT_COMPLETIONS,
    CLASSIFICATION,
    EMBEDDINGS,
    RERANK,
    RESPONSES,
    SCORE,
    OpenAIBatchLine,
    is_classify_line,
    is_embedding_line,
    is_score_line,
)
from batchllm.input.parsing.messages import stored_messages
from batchllm.input.parsing.openai_fields import without_openai_extras
from batchllm.input.parsing.problems import INVALID_JSON, LineProblem, validated
from batchllm.input.parsing.responses import OpenAIResponsesBody, responses_request
from batchllm.input.parsing.sampling import model_adapter, picked_adapter, sampling_of
from batchllm.settings import Settings
from batchllm.spec import CLASSIFY, EMBED, GENERATE

_UNKNOWN_FORM = (
    "unknown line form: expected a 'prompt' string, a 'messages' list, "
    "or an OpenAI batch line with 'custom_id', 'method', 'url' and 'body'"
)


def decode_line(raw: bytes) -> tuple[Any, LineProblem | None]:
    """A line's JSON value, or the problem that stops it (bad UTF-8, malformed JSON)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, LineProblem(None, f"not valid UTF-8 (byte {exc.start})", INVALID_JSON)
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        message = f"malformed JSON: {exc.msg} (column {exc.colno})"
        return None, LineProblem(None, message, INVALID_JSON)
    except RecursionError:
        return None, LineProblem(None, "malformed JSON: nested too deeply", INVALID_JSON)
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        return None, LineProblem(None, f"malformed JSON: {exc}", INVALID_JSON)


def parse_line(
    obj: Any,
    line: int,
    adapters: frozenset[str] = frozenset(),
    task: str = GENERATE,
    *,
    settings: Settings,
) -> Request:
    """Turn one decoded JSON value into a Request, or raise LineProblem naming the field.
    `adapters`: the names of the job's LoRA adapters, which lines may pick; `task`: the
    job's (a line of the other task is an error); `settings`: the limits (BATCHLLM_MAX_N)
    and where images may be read from."""
    if not isinstance(obj, dict):
        raise LineProblem(None, f"expected a JSON object, got {type(obj).__name__}")
    if task == CLASSIFY:
        plain = "input" in obj and not {"method", "body", "url"} & obj.keys()
        if is_classify_line(obj) or plain:
            return _parse_classify(obj, line)
        if is_score_line(obj):  # a cross-encoder's pairs (engine/cross_encoder.py)
            return _parse_embedding(obj, line)
        if not {"messages", "prompt", "url"} & obj.keys():
            raise LineProblem(None, 'expected a classify line: {"input": text}')
        raise _wrong_task(obj, task)
    if task == EMBED:
        if is_embedding_line(obj) or is_score_line(obj):
            return _parse_embedding(obj, line)
        if not {"messages", "prompt", "url"} & obj.keys():
            raise LineProblem(None, 'expected an embedding line: {"input": text or list}')
        raise _wrong_task(obj, task)
    if is_embedding_line(obj) or is_score_line(obj) or is_classify_line(obj):
        raise _wrong_task(obj, task)
    if {"method", "url", "body"} & obj.keys():
        return _parse_generation_envelope(validated(OpenAIBatchLine, obj), line, adapters, settings)
    if "messages" in obj:
        chat = validated(ChatLine, obj)
        messages = stored_messages(chat.messages, settings)
        return Request(
            line=line,
            custom_id=chat.custom_id or default_custom_id(line),
            kind="chat",
            messages=messages,
            sampling=sampling_of(chat, settings.max_n) | picked_adapter(chat.adapter, adapters),
        )
    if "prompt" in obj:
        plain = validated(PromptLine, obj)
        if not plain.prompt.strip():
            raise LineProblem("prompt", "prompt is blank")
        return Request(
            line=line,
            custom_id=plain.custom_id or default_custom_id(line),
            kind="prompt",
            prompt=plain.prompt,
            sampling=sampling_of(plain, settings.max_n) | picked_adapter(plain.adapter, adapters),
        )
    raise LineProblem(None, _UNKNOWN_FORM)


def _body(envelope: OpenAIBatchLine) -> Any:
    """The line's body as its endpoint's model (OpenAI's fields it does not hold taken off
    first: parsing/openai_fields.py)."""
    body = without_openai_extras(envelope.url, envelope.body)
    return validated(envelope.endpoint.body, body, prefix="body.")


def _parse_generation_envelope(
    envelope: OpenAIBatchLine, line: int, adapters: frozenset[str], settings: Settings
) -> Request:
    endpoint = envelope.endpoint
    if endpoint is RESPONSES:
        return _responses_line(_body(envelope), envelope.custom_id, line, adapters)
    if endpoint is CHAT_COMPLETIONS:
        chat: bodies.OpenAIChatBody = _body(envelope)
        sampling = sampling_of(chat, settings.max_n, "body.")
        sampling |= model_adapter(chat.model, adapters)
        if chat.max_completion_tokens is not None:
            sampling["max_tokens"] = chat.max_completion_tokens
        return Request(
            line=line,
            custom_id=envelope.custom_id,
            kind=endpoint.kind,
            messages=stored_messages(chat.messages, settings, "body."),
            sampling=sampling,
        )
    completion: bodies.OpenAICompletionBody = _body(envelope)
    return Request(
        line=line,
        custom_id=envelope.custom_id,
        kind=endpoint.kind,
        prompt=completion.prompt,
        sampling=sampling_of(completion, settings.max_n, "body.")
        | model_adapter(completion.model, adapters),
    )


def _responses_line(
    body: OpenAIResponsesBody, custom_id: str, line: int, adapters: frozenset[str]
) -> Request:
    try:
        messages, sampling = responses_request(body)
    except ConstraintError as exc:
        raise LineProblem(exc.field, exc.message) from None
    return Request(
        line=line,
        custom_id=custom_id,
        kind=RESPONSES.kind,
        messages=messages,
        sampling=sampling | model_adapter(body.model, adapters),
    )


def _embedding_request(
    line: int, custom_id: str, value: str | list[str], dimensions: int | None
) -> Request:
    return Request(
        line=line,
        custom_id=custom_id,
        kind=EMBEDDINGS.kind,
        prompt=value if isinstance(value, str) else None,
        inputs=None if isinstance(value, str) else list(value),
        sampling={"dimensions": dimensions} if dimensions is not None else {},
    )


def _parse_embedding(obj: dict[str, Any], line: int) -> Request:
    if "url" in obj:
        envelope = validated(OpenAIBatchLine, obj)
        if envelope.endpoint is SCORE:
            score: bodies.OpenAIScoreBody = _body(envelope)
            problem = unpaired(score)
            if problem is not None:
                raise LineProblem("body.text_1", problem)
            return score_request(line, envelope.custom_id, score)
        if envelope.endpoint is RERANK:
            rerank: bodies.OpenAIRerankBody = _body(envelope)
            return rerank_request(line, envelope.custom_id, rerank)
        body: bodies.OpenAIEmbeddingBody = _body(
            envelope
        )  # an embedding line's (is_embedding_line)
        return _embedding_request(line, envelope.custom_id, body.input, body.dimensions)
    plain = validated(EmbeddingLine, obj)
    return _embedding_request(
        line, plain.custom_id or default_custom_id(line), plain.input, plain.dimensions
    )


def _parse_classify(obj: dict[str, Any], line: int) -> Request:
    if "url" in obj:
        envelope = validated(OpenAIBatchLine, obj)
        body: bodies.OpenAIClassifyBody = _body(envelope)
        custom_id = envelope.custom_id
        text = body.input
    else:
        plain = validated(ClassifyLine, obj)
        custom_id, text = plain.custom_id or default_custom_id(line), plain.input
    return Request(line=line, custom_id=custom_id, kind=CLASSIFICATION.kind, prompt=text)


def _wrong_task(obj: dict[str, Any], task: str) -> LineProblem:
    if is_score_line(obj):
        return LineProblem(
            "url",
            f"a {obj['url']} line in a {task} job (score and rerank lines run in an "
            "embedding job, --task embed, or with a cross-encoder --task classify)",
        )
    if is_classify_line(obj):
        return LineProblem("url", f"a /v1/classify line in a {task} job (--task classify)")
    if task == CLASSIFY:
        field = "url" if "url" in obj else ("messages" if "messages" in obj else "prompt")
        return LineProblem(field, 'a classification job takes {"input": text} lines')
    if task == EMBED:
        form = "a chat" if "messages" in obj else "a completion"
        field = "url" if "url" in obj else ("messages" if "messages" in obj else "prompt")
        return LineProblem(field, f"{form} line in an embedding job (--task embed)")
    field = "url" if "url" in obj else "input"
    return LineProblem(field, "an embedding line in a generation job (--task generate)")
