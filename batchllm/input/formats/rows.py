"""The one stored input row: what validation writes into a job's input shards and what the engine
side (tokenization, context sizing, the feed) reads back. Its encoding to and from the input
Parquet schema lives here and nowhere else.

`messages` and `sampling` stay JSON text: the feed keys its sampling cache by the text and the
chat template decodes messages once, so no row pays a decode it does not need.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import pyarrow as pa

from batchllm.input.formats.schemas import LineError, Request

RowKind = Literal["prompt", "chat", "embed", "score", "classify", "invalid"]
# Rows the pooling runner serves: nothing is generated, an input needs no room for an output
# token, and `inputs` (a list of texts) is tokenized text by text.
POOLING_KINDS = frozenset({"embed", "score", "classify"})

# A chat line's settings that change how its conversation renders: validation stores them in
# the row's sampling text, the prompt renderer reads them from there.
TEMPLATE_OPTIONS = (
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
)

# An invalid row has no settings: its `sampling` text holds its refusal's OpenAI error code
# instead ({"error_code": ...}, input/parsing/problems.py), which the export reads. Not a column
# of its own: that would change the shard schema and the positional row every reader builds for
# a value only the export reads, while every other reader skips an invalid row's settings (the
# runner, the sizing pass and the feed run only valid rows, an older release included). A shard
# stored before has none; the export then reads the code from the message's wording.
_REFUSAL_CODE = "error_code"

INPUT_SCHEMA = pa.schema(
    [
        pa.field("line", pa.int64(), nullable=False),
        pa.field("custom_id", pa.string(), nullable=False),
        # prompt | chat | embed | score | classify | invalid
        pa.field("kind", pa.string(), nullable=False),
        pa.field("prompt", pa.string()),
        pa.field("messages", pa.string()),  # JSON list of {role, content}
        pa.field("sampling", pa.string()),  # JSON object of per-line overrides (see above)
        pa.field("error", pa.string()),
        # JSON list of the texts of a list embedding input, or a score row's (formats/scoring.py)
        pa.field("inputs", pa.string()),
    ]
)


def request_payload(item: Request) -> tuple[str, str | None, str | None, str | None, str | None]:
    """A request's stored columns after line and custom_id: kind, prompt, messages, sampling,
    inputs (the JSON texts as INPUT_SCHEMA holds them; validation/columnar.py builds the same)."""
    return (
        item.kind,
        item.prompt,
        json.dumps(item.messages) if item.messages is not None else None,
        json.dumps(item.sampling) if item.sampling else None,
        json.dumps(item.inputs) if item.inputs is not None else None,
    )


@dataclass(frozen=True, slots=True)
class InputRow:
    line: int  # 1-based line number in the input file
    custom_id: str
    kind: RowKind
    prompt: str | None = None
    messages: str | None = None  # JSON text of the chat messages (kind "chat")
    sampling: str | None = None  # JSON text of the line's sampling overrides, if any
    error: str | None = None  # why the line is invalid (kind "invalid")
    inputs: str | None = None  # JSON text of a list embedding input, or a score row's texts
    # The prompt's token ids from the job's context-sizing pass (input/token_store.py), so the
    # feed does not tokenize the row a second time. Not a column of the input shard.
    token_ids: list[int] | None = None

    @classmethod
    def from_item(cls, item: Request | LineError) -> InputRow:
        """The row of one validated line (a request, or the error that refused it)."""
        if isinstance(item, LineError):
            reason = (f"field '{item.field}': " if item.field else "") + item.message
            return cls(
                line=item.line,
                custom_id=item.custom_id,
                kind="invalid",
                sampling=json.dumps({_REFUSAL_CODE: item.code}) if item.code else None,
                error=reason,
            )
        kind, prompt, messages, sampling, inputs = request_payload(item)
        return cls(
            line=item.line,
            custom_id=item.custom_id,
            kind=kind,  # type: ignore[arg-type]  # a Request's kind
            prompt=prompt,
            messages=messages,
            sampling=sampling,
            inputs=inputs,
        )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> InputRow:
        """A row read back from an input shard (pyarrow's to_pylist record)."""
        return cls(**record)

    def to_record(self) -> dict[str, Any]:
        return dict(zip(STORED_FIELDS, self.stored_values(), strict=True))

    def stored_values(self) -> tuple[Any, ...]:
        """The row's input-shard columns, in INPUT_SCHEMA's order (dataclasses.asdict
        deep-copies every field: a third of storing a validated line)."""
        return (
            self.line,
            self.custom_id,
            self.kind,
            self.prompt,
            self.messages,
            self.sampling,
            self.error,
            self.inputs,
        )

    def texts(self) -> list[str]:
        """The texts of an embedding row: its one input, or its list."""
        return json.loads(self.inputs) if self.inputs else [str(self.prompt)]

    def chat_messages(self) -> list[dict[str, Any]]:
        return json.loads(self.messages) if self.messages else []

    def overrides(self) -> MappingProxyType[str, Any]:
        """The line's own sampling settings (over the job's defaults), read-only: the decoded
        text is shared by every row with the same settings (most rows of a job), and the
        template, the sizing pass and the sampling cache each ask for it."""
        return _decoded(self.sampling) if self.sampling else _EMPTY


_EMPTY: MappingProxyType[str, Any] = MappingProxyType({})


def refusal_code(sampling: str | None) -> str | None:
    """The OpenAI error code an invalid row's stored `sampling` text holds, if any."""
    code = json.loads(sampling).get(_REFUSAL_CODE) if sampling else None
    return code if isinstance(code, str) else None


# Each field's slot, set directly by stored_row.
_new_row = object.__new__
(
    _set_line,
    _set_custom_id,
    _set_kind,
    _set_prompt,
    _set_messages,
    _set_sampling,
    _set_error,
    _set_inputs,
    _set_token_ids,
) = (getattr(InputRow, f.name).__set__ for f in dataclasses.fields(InputRow))


def stored_row(
    line: int,
    custom_id: str,
    kind: RowKind,
    prompt: str | None,
    messages: str | None,
    sampling: str | None,
    error: str | None,
    inputs: str | None,
    token_ids: list[int] | None,
) -> InputRow:
    """InputRow(...) for a row read back from a shard, every field given in order: the frozen
    dataclass's __init__ sets each field through object.__setattr__, which was half the cost
    of reading a shard's rows back; the row is the same."""
    row = _new_row(InputRow)
    _set_line(row, line)
    _set_custom_id(row, custom_id)
    _set_kind(row, kind)
    _set_prompt(row, prompt)
    _set_messages(row, messages)
    _set_sampling(row, sampling)
    _set_error(row, error)
    _set_inputs(row, inputs)
    _set_token_ids(row, token_ids)
    return row


@functools.lru_cache(maxsize=4096)
def _decoded(text: str) -> MappingProxyType[str, Any]:
    return MappingProxyType(json.loads(text))


STORED_FIELDS = tuple(INPUT_SCHEMA.names)
