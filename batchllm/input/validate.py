"""Streaming validation of JSONL input: one `Request` or one `LineError` per non-blank line.

Memory stays flat in the file size: lines are read one at a time, bounded in size (files/lines.py),
and custom_ids are kept in an on-disk SQLite table rather than a Python set (files/custom_ids.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ValidationError

from batchllm.input import columnar
from batchllm.input.columnar import Verdict
from batchllm.input.files.custom_ids import (
    CustomIds,
    default_custom_id,
    given_id,
    may_give_default_id,
)
from batchllm.input.files.lines import Line, iter_line_chunks, iter_lines
from batchllm.input.files.source import InputSource, resolve_input
from batchllm.input.images import ImageChecks, ImageProblem, check_image, image_urls
from batchllm.input.responses import OpenAIResponsesBody, responses_request
from batchllm.input.rows import INPUT_SCHEMA, TEMPLATE_OPTIONS, InputRow, request_payload
from batchllm.input.schemas import (
    ChatLine,
    ChatMessage,
    ChatOptions,
    ClassifyLine,
    CompletionLogprobs,
    ConstraintFields,
    EmbeddingLine,
    LineError,
    OpenAIBatchLine,
    OpenAIChatBody,
    OpenAIClassifyBody,
    OpenAICompletionBody,
    OpenAIEmbeddingBody,
    OpenAIRerankBody,
    OpenAIScoreBody,
    PromptLine,
    Request,
    SamplingOverrides,
)
from batchllm.input.scoring import rerank_request, score_request, unpaired
from batchllm.input.structured import ConstraintError, constraint_of
from batchllm.input.tools import line_tool_settings
from batchllm.input.unicode_text import (
    UNENCODABLE,
    encodable,
    may_hold_surrogates,
    unencodable_field,
)
from batchllm.settings import Settings

log = logging.getLogger(__name__)

# INPUT_SCHEMA's columns after line and custom_id.
_STORED_AFTER_ID = ("kind", "prompt", "messages", "sampling", "error", "inputs")

_SAMPLING_FIELDS = tuple(SamplingOverrides.model_fields)  # in field order: a stable stored text
_UNKNOWN_FORM = (
    "unknown line form: expected a 'prompt' string, a 'messages' list, "
    "or an OpenAI batch line with 'custom_id', 'method', 'url' and 'body'"
)


class LineProblem(Exception):
    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message

    def error(self, file: str, line: int, custom_id: str) -> LineError:
        """The LineError refusing this line."""
        return LineError(
            file=file, line=line, custom_id=custom_id, field=self.field, message=self.message
        )


# (line number, the custom_id the line gives, its Request (or stored payload) or the problem
# that stops it)
_Checked = tuple[int, str | None, Any]


def _from_validation(exc: ValidationError, prefix: str = "") -> LineProblem:
    errors = exc.errors(include_url=False)
    first = errors[0]
    field = (
        prefix + ".".join(str(part) for part in first["loc"]) if first["loc"] else prefix or None
    )
    message = "; ".join(
        (prefix + ".".join(str(p) for p in e["loc"]) + ": " if e["loc"] else "") + e["msg"]
        for e in errors
    )
    return LineProblem(field or None, message)


def _validate(model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(exc, prefix) from None


def _sampling_of(parsed: BaseModel, max_n: int, prefix: str = "") -> dict[str, Any]:
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


def _pick_adapter(name: str | None, adapters: frozenset[str]) -> dict[str, str]:
    """The line's adapter setting: {} for the base model; LineProblem for an unknown name."""
    if name is None:
        return {}
    if name not in adapters:
        known = ", ".join(sorted(adapters)) or "none (give them with --lora NAME=PATH)"
        raise LineProblem("adapter", f"unknown adapter {name!r}; this job's adapters: {known}")
    return {"adapter": name}


def is_embedding_line(obj: Any) -> bool:
    """Whether a decoded line is an embedding request ({"input": ...} or OpenAI's
    /v1/embeddings), which only an embedding job runs."""
    return isinstance(obj, dict) and (
        obj.get("url") == "/v1/embeddings"
        or ("input" in obj and not {"method", "body"} & obj.keys())
    )


_SCORE_URLS = ("/v1/score", "/v1/rerank")


def is_score_line(obj: Any) -> bool:
    """Whether a decoded line is a /v1/score or /v1/rerank request, which an embedding job
    runs (input/scoring.py says why), or with a cross-encoder a classification job."""
    return isinstance(obj, dict) and obj.get("url") in _SCORE_URLS


def is_classify_line(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("url") == "/v1/classify"


def infer_task(source: InputSource, settings: Settings) -> str:
    """The task a file's lines ask for, from its first line that decodes to an object:
    embed for embedding, score and rerank lines, classify for /v1/classify lines, else
    generate (one task per job; lines of another task become error rows). The file is read
    as `settings` say (line limit)."""
    limit = settings.max_line_bytes
    with source.open() as handle:
        for line in iter_lines(handle, limit):
            if line.raw is None:
                continue
            obj, problem = decode_line(line.raw)
            if problem is None and isinstance(obj, dict):
                if is_classify_line(obj):
                    return "classify"
                pooled = is_embedding_line(obj) or is_score_line(obj)
                return "embed" if pooled else "generate"
    return "generate"


def _embedding_request(
    line: int, custom_id: str, value: str | list[str], dimensions: int | None
) -> Request:
    return Request(
        line=line,
        custom_id=custom_id,
        kind="embed",
        prompt=value if isinstance(value, str) else None,
        inputs=None if isinstance(value, str) else list(value),
        sampling={"dimensions": dimensions} if dimensions is not None else {},
    )


def _parse_embedding(obj: dict[str, Any], line: int) -> Request:
    if "url" in obj:
        envelope = _validate(OpenAIBatchLine, obj)
        if envelope.url == "/v1/score":
            body = _validate(OpenAIScoreBody, envelope.body, prefix="body.")
            problem = unpaired(body)
            if problem is not None:
                raise LineProblem("body.text_1", problem)
            return score_request(line, envelope.custom_id, body)
        if envelope.url == "/v1/rerank":
            rerank = _validate(OpenAIRerankBody, envelope.body, prefix="body.")
            return rerank_request(line, envelope.custom_id, rerank)
        body = _validate(OpenAIEmbeddingBody, envelope.body, prefix="body.")
        return _embedding_request(line, envelope.custom_id, body.input, body.dimensions)
    plain = _validate(EmbeddingLine, obj)
    return _embedding_request(
        line, plain.custom_id or default_custom_id(line), plain.input, plain.dimensions
    )


def _parse_classify(obj: dict[str, Any], line: int) -> Request:
    if "url" in obj:
        envelope = _validate(OpenAIBatchLine, obj)
        body = _validate(OpenAIClassifyBody, envelope.body, prefix="body.")
        return Request(line=line, custom_id=envelope.custom_id, kind="classify", prompt=body.input)
    plain = _validate(ClassifyLine, obj)
    custom_id = plain.custom_id or default_custom_id(line)
    return Request(line=line, custom_id=custom_id, kind="classify", prompt=plain.input)


def _wrong_task(obj: dict[str, Any], task: str) -> LineProblem:
    if is_score_line(obj):
        return LineProblem(
            "url",
            f"a {obj['url']} line in a {task} job (score and rerank lines run in an "
            "embedding job, --task embed, or with a cross-encoder --task classify)",
        )
    if is_classify_line(obj):
        return LineProblem("url", f"a /v1/classify line in a {task} job (--task classify)")
    if task == "classify":
        field = "url" if "url" in obj else ("messages" if "messages" in obj else "prompt")
        return LineProblem(field, 'a classification job takes {"input": text} lines')
    if task == "embed":
        form = "a chat" if "messages" in obj else "a completion"
        field = "url" if "url" in obj else ("messages" if "messages" in obj else "prompt")
        return LineProblem(field, f"{form} line in an embedding job (--task embed)")
    field = "url" if "url" in obj else "input"
    return LineProblem(field, "an embedding line in a generation job (--task generate)")


def parse_line(
    obj: Any,
    line: int,
    adapters: frozenset[str] = frozenset(),
    task: str = "generate",
    *,
    settings: Settings,
) -> Request:
    """Turn one decoded JSON value into a Request, or raise LineProblem naming the field.
    `adapters`: the names of the job's LoRA adapters, which lines may pick; `task`: the
    job's (a line of the other task is an error); `settings`: the limits (BATCHLLM_MAX_N)
    and where images may be read from."""
    if not isinstance(obj, dict):
        raise LineProblem(None, f"expected a JSON object, got {type(obj).__name__}")
    if task == "classify":
        plain = "input" in obj and not {"method", "body", "url"} & obj.keys()
        if is_classify_line(obj) or plain:
            return _parse_classify(obj, line)
        if is_score_line(obj):  # a cross-encoder's pairs (engine/cross_encoder.py)
            return _parse_embedding(obj, line)
        if not {"messages", "prompt", "url"} & obj.keys():
            raise LineProblem(None, 'expected a classify line: {"input": text}')
        raise _wrong_task(obj, task)
    if task == "embed":
        if is_embedding_line(obj) or is_score_line(obj):
            return _parse_embedding(obj, line)
        if not {"messages", "prompt", "url"} & obj.keys():
            raise LineProblem(None, 'expected an embedding line: {"input": text or list}')
        raise _wrong_task(obj, task)
    if is_embedding_line(obj) or is_score_line(obj) or is_classify_line(obj):
        raise _wrong_task(obj, task)
    if {"method", "url", "body"} & obj.keys():
        envelope = _validate(OpenAIBatchLine, obj)
        if envelope.url == "/v1/responses":
            return _responses_line(envelope.body, envelope.custom_id, line, adapters)
        if envelope.url == "/v1/chat/completions":
            body = _validate(OpenAIChatBody, envelope.body, prefix="body.")
            sampling = _sampling_of(body, settings.max_n, "body.")
            sampling |= _model_adapter(body.model, adapters)
            if body.max_completion_tokens is not None:
                sampling["max_tokens"] = body.max_completion_tokens
            messages = _stored_messages(body.messages, settings, "body.")
            return Request(
                line=line,
                custom_id=envelope.custom_id,
                kind="chat",
                messages=messages,
                sampling=sampling,
            )
        body = _validate(OpenAICompletionBody, envelope.body, prefix="body.")
        return Request(
            line=line,
            custom_id=envelope.custom_id,
            kind="prompt",
            prompt=body.prompt,
            sampling=_sampling_of(body, settings.max_n, "body.")
            | _model_adapter(body.model, adapters),
        )
    if "messages" in obj:
        chat = _validate(ChatLine, obj)
        messages = _stored_messages(chat.messages, settings)
        return Request(
            line=line,
            custom_id=chat.custom_id or default_custom_id(line),
            kind="chat",
            messages=messages,
            sampling=_sampling_of(chat, settings.max_n) | _pick_adapter(chat.adapter, adapters),
        )
    if "prompt" in obj:
        plain = _validate(PromptLine, obj)
        if not plain.prompt.strip():
            raise LineProblem("prompt", "prompt is blank")
        return Request(
            line=line,
            custom_id=plain.custom_id or default_custom_id(line),
            kind="prompt",
            prompt=plain.prompt,
            sampling=_sampling_of(plain, settings.max_n) | _pick_adapter(plain.adapter, adapters),
        )
    raise LineProblem(None, _UNKNOWN_FORM)


def _responses_line(
    data: dict[str, Any], custom_id: str, line: int, adapters: frozenset[str]
) -> Request:
    body = _validate(OpenAIResponsesBody, data, prefix="body.")
    try:
        messages, sampling = responses_request(body)
    except ConstraintError as exc:
        raise LineProblem(exc.field, exc.message) from None
    return Request(
        line=line,
        custom_id=custom_id,
        kind="chat",
        messages=messages,
        sampling=sampling | _model_adapter(body.model, adapters),
    )


def _stored_messages(
    messages: list[ChatMessage], settings: Settings, prefix: str = ""
) -> list[dict[str, Any]]:
    """The messages as stored: ChatMessage.stored() (the text of text parts joined, a tool
    turn's id, an assistant turn's calls), except a message with images, which keeps its
    parts; every image is opened and decoded here (images/checks.py), so a bad one is this
    line's error naming its part."""
    stored: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not message.has_images():
            stored.append(message.stored())
            continue
        parts: list[dict[str, Any]] = []
        content = message.content if isinstance(message.content, list) else []
        for j, part in enumerate(content):
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
                continue
            field = f"{prefix}messages.{i}.content.{j}.image_url"
            if message.role != "user":
                raise LineProblem(field, f"images are for user messages, not {message.role}")
            url = _image_url(part, field)
            try:
                check_image(url, settings)
            except ImageProblem as exc:
                raise LineProblem(field, str(exc)) from None
            parts.append({"type": "image_url", "image_url": {"url": url}})
        stored.append({"role": message.role, "content": parts})
    return stored


def _image_url(part: dict[str, Any], field: str) -> str:
    reference = part.get("image_url")
    if not isinstance(reference, dict) or not isinstance(reference.get("url"), str):
        raise LineProblem(field, "expected {url: ...}")
    if not reference["url"].strip():
        raise LineProblem(field + ".url", "url is empty")
    extra = set(reference) - {"url", "detail"}
    if extra:
        raise LineProblem(field, f"unknown image_url field(s): {', '.join(sorted(extra))}")
    if reference.get("detail") not in (None, "auto", "low", "high"):
        raise LineProblem(field + ".detail", "detail is auto, low or high")
    return str(reference["url"])


def _model_adapter(model: str | None, adapters: frozenset[str]) -> dict[str, str]:
    """In the OpenAI form a body.model naming one of the job's adapters picks it (as with
    vLLM's server); any other model name runs the job's model."""
    return {"adapter": model} if model is not None and model in adapters else {}


def decode_line(raw: bytes) -> tuple[Any, LineProblem | None]:
    """A line's JSON value, or the problem that stops it (bad UTF-8, malformed JSON)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, LineProblem(None, f"not valid UTF-8 (byte {exc.start})")
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, LineProblem(None, f"malformed JSON: {exc.msg} (column {exc.colno})")
    except RecursionError:
        return None, LineProblem(None, "malformed JSON: nested too deeply")
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        return None, LineProblem(None, f"malformed JSON: {exc}")


def _check(
    line: Line, max_line_bytes: int, adapters: frozenset[str], task: str, settings: Settings
) -> _Checked:
    if line.raw is None:
        return (
            line.number,
            None,
            LineProblem(
                None,
                f"line is {line.size:,} bytes, over the limit of {max_line_bytes:,} "
                "(BATCHLLM_MAX_LINE_BYTES)",
            ),
        )
    obj, problem = decode_line(line.raw)
    if problem is None and may_hold_surrogates(line.raw):
        field = unencodable_field(obj)
        if field is not None:
            given = given_id(obj)
            # An unencodable custom_id is not given: the line's error row gets its default id.
            given = given if given is not None and encodable(given) else None
            return line.number, given, LineProblem(field, UNENCODABLE)
    if problem is None:
        try:
            request = parse_line(obj, line.number, adapters, task, settings=settings)
            return line.number, given_id(obj), request
        except LineProblem as exc:
            problem = exc
    return line.number, given_id(obj), problem


def read_requests(
    path: str | Path | InputSource,
    *,
    settings: Settings,
    max_line_bytes: int | None = None,
    adapters: frozenset[str] = frozenset(),
    task: str = "generate",
) -> Iterator[Request | LineError]:
    """Yield one Request or LineError per non-blank line of `path` (a local path or a URI
    such as s3://bucket/key, streamed), in line order, validating line by line.

    Blank lines are not requests and produce nothing. Line numbers are 1-based physical lines.
    A line over `max_line_bytes` (default: the settings') is an error without being parsed.
    The file is read twice (files/custom_ids.py), each time from its start.
    """
    source = resolve_input(path, s3_endpoint=settings.resolved_s3_endpoint)
    limit = max_line_bytes or settings.max_line_bytes
    images = ImageChecks(settings)

    def checked(lines: list[Line]) -> list[_Checked]:
        with images.prefetching(image_urls(line.raw for line in lines)):
            return [_check(line, limit, adapters, task, settings) for line in lines]

    try:
        for resolved in _resolved_chunks(source, limit, checked):
            for _, custom_id, item in resolved:
                if isinstance(item, Request):
                    item.custom_id = custom_id  # parse_line's `line-<N>` may have moved on
                yield item
    finally:
        images.close()


def read_row_chunks(
    source: InputSource,
    *,
    settings: Settings,
    max_line_bytes: int | None = None,
    adapters: frozenset[str] = frozenset(),
    task: str = "generate",
) -> Iterator[tuple[pa.Table, list[LineError]]]:
    """The non-blank lines of `source` as rows to store, a chunk of the file at a time: a table
    of the lines' input-shard values (INPUT_SCHEMA, input/rows.py) in line order, and the
    LineErrors of the chunk's lines that cannot run. The same rows as read_requests gives,
    validated a block at a time (input/columnar.py) and kept in columns to the stored shard."""
    limit = max_line_bytes or settings.max_line_bytes

    def one(line: Line) -> tuple[str | None, Any]:
        _, given, item = _check(line, limit, adapters, task, settings)
        return given, item if isinstance(item, LineProblem) else request_payload(item)

    def judge(obj: Any, number: int) -> Verdict | None:
        try:
            request = parse_line(obj, number, adapters, task, settings=settings)
        except LineProblem:
            return None
        if request.inputs is not None:
            return None  # a list of texts to embed: not a shape columnar.py reads
        _, _, _, sampling, _ = request_payload(request)
        return request.kind, "body" if "body" in obj else "top", sampling

    ids = CustomIds()
    images = ImageChecks(settings)
    try:
        for chunk in _line_chunks(source, limit, ids):
            with images.prefetching(image_urls(line.raw for line in chunk)):
                block = columnar.check_block(chunk, one, judge)
            yield stored_block(block, ids, source.name)
    finally:
        images.close()
        ids.close()


def stored_block(
    block: columnar.CheckedBlock, ids: CustomIds, name: str
) -> tuple[pa.Table, list[LineError]]:
    """A checked block's rows as stored (INPUT_SCHEMA), with final custom_ids (defaults for
    lines that give none, duplicates refused), and the LineErrors of its refused lines."""
    columns = block.columns
    numbers = pa.array(block.numbers, pa.int64())
    custom_ids = columns["given"]
    if custom_ids.null_count:
        missing = pc.is_null(custom_ids)
        defaults = ids.defaults(numbers.filter(missing).to_pylist())
        custom_ids = pc.replace_with_mask(
            custom_ids, missing, pa.array(list(defaults.values()), pa.string())
        )
    runnable = pc.is_valid(columns["kind"])
    accepted = runnable if block.problems else None  # None: every line
    candidates = custom_ids.filter(accepted) if accepted is not None else custom_ids
    lines = numbers.filter(accepted) if accepted is not None else numbers
    duplicates = ids.add_first(candidates.to_pylist(), lines.to_pylist())
    if not block.problems and not duplicates:  # the common block: every line runs
        stored = {**columns, "error": pa.nulls(len(numbers), pa.string())}
        return pa.table(
            [numbers, custom_ids, *(stored[n] for n in _STORED_AFTER_ID)], schema=INPUT_SCHEMA
        ), []
    errors: dict[int, str] = {}  # position -> why the line is refused
    problems: list[LineError] = []
    at_of_line = {number: at for at, number in enumerate(block.numbers)}
    refused = [(at, block.problems[at]) for at in sorted(block.problems)]
    refused += [
        (at_of_line[line], _duplicate(custom_id, first)) for custom_id, line, first in duplicates
    ]
    for at, problem in sorted(refused, key=lambda item: item[0]):
        error = problem.error(name, block.numbers[at], custom_ids[at].as_py())
        problems.append(error)
        errors[at] = InputRow.from_item(error).error or ""
    invalid = np.zeros(len(block.numbers), dtype=bool)
    invalid[list(errors)] = True
    mask = pa.array(invalid)
    kept = {
        name: pc.if_else(mask, pa.scalar(None, pa.string()), columns[name])
        for name in ("prompt", "messages", "sampling", "inputs")
    }
    kept["kind"] = pc.if_else(mask, "invalid", columns["kind"])
    kept["error"] = pa.array([errors.get(at) for at in range(len(block.numbers))], pa.string())
    return pa.table(
        [numbers, custom_ids, *(kept[n] for n in _STORED_AFTER_ID)], schema=INPUT_SCHEMA
    ), problems


def _duplicate(custom_id: str, first: int) -> LineProblem:
    return LineProblem("custom_id", f"duplicate custom_id {custom_id!r} (first on line {first})")


def _line_chunks(source: InputSource, limit: int, ids: CustomIds) -> Iterator[list[Line]]:
    """The file's non-blank lines, a list per chunk. The first pass, which collects the
    default-shaped custom_ids the file gives (files/custom_ids.py), runs when the first line without
    a custom_id needs its default, over the whole file on a handle of its own."""

    def given_lines() -> Iterator[Line]:
        with source.open() as handle:
            for chunk in iter_line_chunks(handle, limit, wanted=may_give_default_id):
                yield from chunk

    ids.defer_first_pass(given_lines)
    with source.open() as handle:
        yield from iter_line_chunks(handle, limit)


def _resolved_chunks(
    source: InputSource,
    limit: int,
    checked: Callable[[list[Line]], list[_Checked]],
) -> Iterator[list[tuple[int, str, Any]]]:
    """(line number, final custom_id, the checked item or the LineError refusing the line)
    per non-blank line, a list per chunk of lines that `checked` checks at once."""
    ids = CustomIds()
    try:
        for chunk in _line_chunks(source, limit, ids):
            yield _resolve_chunk(checked(chunk), ids, source.name)
    finally:
        ids.close()


def _resolve_chunk(
    chunk: list[_Checked],
    ids: CustomIds,
    name: str,
) -> list[tuple[int, str, Any]]:
    missing = [number for number, given, _ in chunk if given is None]
    defaults = ids.defaults(missing) if missing else {}
    final = [given if given is not None else defaults[number] for number, given, _ in chunk]
    runnable = [
        (custom_id, number)
        for custom_id, (number, _, item) in zip(final, chunk, strict=True)
        if not isinstance(item, LineProblem)
    ]
    duplicates = {
        line: first
        for _, line, first in ids.add_first([i for i, _ in runnable], [n for _, n in runnable])
    }
    if not duplicates and len(runnable) == len(chunk):  # the common chunk: every line runs
        return [(number, custom_id, item) for custom_id, (number, _, item) in zip(final, chunk)]
    resolved: list[tuple[int, str, Any]] = []
    for custom_id, (number, _, item) in zip(final, chunk, strict=True):
        if isinstance(item, LineProblem):
            problem = item
        elif number in duplicates:
            problem = _duplicate(custom_id, duplicates[number])
        else:
            resolved.append((number, custom_id, item))
            continue
        resolved.append((number, custom_id, problem.error(name, number, custom_id)))
    return resolved
