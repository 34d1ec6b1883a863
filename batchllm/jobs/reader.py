"""Streaming validation of JSONL input: one `Request` or one `LineError` per non-blank line.

Memory stays flat in the file size: lines are read one at a time and the duplicate check keeps
its seen ids in an on-disk SQLite table rather than a Python set.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from batchllm.jobs.schemas import (
    ChatLine,
    LineError,
    OpenAIBatchLine,
    OpenAIChatBody,
    OpenAICompletionBody,
    PromptLine,
    Request,
    SamplingOverrides,
)

log = logging.getLogger(__name__)

_SAMPLING_FIELDS = set(SamplingOverrides.model_fields)
_CHUNK = 4096
_UNKNOWN_FORM = (
    "unknown line form: expected a 'prompt' string, a 'messages' list, "
    "or an OpenAI batch line with 'custom_id', 'method', 'url' and 'body'"
)


class _LineProblem(Exception):
    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _from_validation(exc: ValidationError, prefix: str = "") -> _LineProblem:
    errors = exc.errors(include_url=False)
    first = errors[0]
    field = prefix + ".".join(str(part) for part in first["loc"]) if first["loc"] else prefix or None
    message = "; ".join(
        (prefix + ".".join(str(p) for p in e["loc"]) + ": " if e["loc"] else "") + e["msg"]
        for e in errors
    )
    return _LineProblem(field or None, message)


def _validate(model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(exc, prefix) from None


def _sampling_of(parsed: BaseModel) -> dict[str, Any]:
    return {k: v for k, v in parsed.model_dump(include=_SAMPLING_FIELDS).items() if v is not None}


def parse_line(obj: Any, line: int) -> Request:
    """Turn one decoded JSON value into a Request, or raise _LineProblem naming the field."""
    if not isinstance(obj, dict):
        raise _LineProblem(None, f"expected a JSON object, got {type(obj).__name__}")
    if {"method", "url", "body"} & obj.keys():
        envelope = _validate(OpenAIBatchLine, obj)
        if envelope.url == "/v1/chat/completions":
            body = _validate(OpenAIChatBody, envelope.body, prefix="body.")
            sampling = _sampling_of(body)
            if body.max_completion_tokens is not None:
                sampling["max_tokens"] = body.max_completion_tokens
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            return Request(line=line, custom_id=envelope.custom_id, kind="chat",
                           messages=messages, sampling=sampling)
        body = _validate(OpenAICompletionBody, envelope.body, prefix="body.")
        return Request(line=line, custom_id=envelope.custom_id, kind="prompt",
                       prompt=body.prompt, sampling=_sampling_of(body))
    if "messages" in obj:
        chat = _validate(ChatLine, obj)
        messages = [{"role": m.role, "content": m.text()} for m in chat.messages]
        return Request(line=line, custom_id=chat.custom_id or default_custom_id(line),
                       kind="chat", messages=messages, sampling=_sampling_of(chat))
    if "prompt" in obj:
        plain = _validate(PromptLine, obj)
        if not plain.prompt.strip():
            raise _LineProblem("prompt", "prompt is blank")
        return Request(line=line, custom_id=plain.custom_id or default_custom_id(line),
                       kind="prompt", prompt=plain.prompt, sampling=_sampling_of(plain))
    raise _LineProblem(None, _UNKNOWN_FORM)


def default_custom_id(line: int) -> str:
    return f"line-{line}"


def _claimed_id(obj: Any, line: int) -> str:
    if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str) and obj["custom_id"]:
        return obj["custom_id"]
    return default_custom_id(line)


class _SeenIds:
    """custom_ids seen so far, kept on disk so a 100M-line file does not need 100M ids in RAM."""

    def __init__(self) -> None:
        fd, self._path = tempfile.mkstemp(prefix="batchllm-ids-", suffix=".sqlite")
        os.close(fd)
        self._db = sqlite3.connect(self._path)
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("CREATE TABLE seen (custom_id TEXT PRIMARY KEY, line INTEGER) WITHOUT ROWID")

    def first_lines(self, ids: list[str]) -> dict[str, int]:
        found: dict[str, int] = {}
        for start in range(0, len(ids), 500):
            part = ids[start : start + 500]
            marks = ",".join("?" * len(part))
            found.update(self._db.execute(
                f"SELECT custom_id, line FROM seen WHERE custom_id IN ({marks})", part))
        return found

    def add(self, pairs: list[tuple[str, int]]) -> None:
        self._db.executemany("INSERT INTO seen VALUES (?, ?)", pairs)

    def close(self) -> None:
        self._db.close()
        Path(self._path).unlink(missing_ok=True)


def _decode(raw: bytes, line: int) -> tuple[Any, _LineProblem | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, _LineProblem(None, f"not valid UTF-8 (byte {exc.start})")
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, _LineProblem(None, f"malformed JSON: {exc.msg} (column {exc.colno})")


def read_requests(path: str | Path) -> Iterator[Request | LineError]:
    """Yield one Request or LineError per non-blank line of `path`, in line order.

    Blank lines are not requests and produce nothing. Line numbers are 1-based physical lines.
    """
    path = Path(path)
    name = str(path)
    seen = _SeenIds()
    try:
        with path.open("rb") as handle:
            chunk: list[tuple[int, Any, Request | _LineProblem]] = []
            for number, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                obj, problem = _decode(raw.rstrip(b"\r\n"), number)
                if problem is None:
                    try:
                        chunk.append((number, obj, parse_line(obj, number)))
                        obj = None
                    except _LineProblem as exc:
                        problem = exc
                if problem is not None:
                    chunk.append((number, obj, problem))
                if len(chunk) >= _CHUNK:
                    yield from _resolve_chunk(chunk, seen, name)
                    chunk = []
            yield from _resolve_chunk(chunk, seen, name)
    finally:
        seen.close()


def _resolve_chunk(chunk: list[tuple[int, Any, Request | _LineProblem]], seen: _SeenIds,
                   name: str) -> Iterator[Request | LineError]:
    ids = [item.custom_id for _, _, item in chunk if isinstance(item, Request)]
    earlier = seen.first_lines(list(set(ids)))
    new: list[tuple[str, int]] = []
    for number, obj, item in chunk:
        if isinstance(item, _LineProblem):
            yield LineError(file=name, line=number, custom_id=_claimed_id(obj, number),
                            field=item.field, message=item.message)
            continue
        first = earlier.get(item.custom_id)
        if first is not None:
            yield LineError(file=name, line=number, custom_id=item.custom_id, field="custom_id",
                            message=f"duplicate custom_id {item.custom_id!r} (first on line {first})")
            continue
        earlier[item.custom_id] = number
        new.append((item.custom_id, number))
        yield item
    seen.add(new)
