"""The one stored input row: what validation writes into a job's input shards and what the engine
side (tokenization, context sizing, the feed) reads back. Its encoding to and from the input
Parquet schema lives here and nowhere else.

`messages` and `sampling` stay JSON text: the feed keys its sampling cache by the text and the
chat template decodes messages once, so no row pays a decode it does not need.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

import pyarrow as pa

from batchllm.jobs.schemas import LineError, Request

RowKind = Literal["prompt", "chat", "embed", "invalid"]

INPUT_SCHEMA = pa.schema(
    [
        pa.field("line", pa.int64(), nullable=False),
        pa.field("custom_id", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),  # prompt | chat | embed | invalid
        pa.field("prompt", pa.string()),
        pa.field("messages", pa.string()),  # JSON list of {role, content}
        pa.field("sampling", pa.string()),  # JSON object of per-line overrides
        pa.field("error", pa.string()),
        pa.field("inputs", pa.string()),  # JSON list of the texts of a list embedding input
    ]
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
    inputs: str | None = None  # JSON text of a list embedding input (kind "embed")

    @classmethod
    def from_item(cls, item: Request | LineError) -> InputRow:
        """The row of one validated line (a request, or the error that refused it)."""
        if isinstance(item, LineError):
            reason = (f"field '{item.field}': " if item.field else "") + item.message
            return cls(line=item.line, custom_id=item.custom_id, kind="invalid", error=reason)
        return cls(
            line=item.line,
            custom_id=item.custom_id,
            kind=item.kind,
            prompt=item.prompt,
            messages=json.dumps(item.messages) if item.messages is not None else None,
            sampling=json.dumps(item.sampling) if item.sampling else None,
            inputs=json.dumps(item.inputs) if item.inputs is not None else None,
        )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> InputRow:
        """A row read back from an input shard (pyarrow's to_pylist record)."""
        return cls(**record)

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    def texts(self) -> list[str]:
        """The texts of an embedding row: its one input, or its list."""
        return json.loads(self.inputs) if self.inputs else [str(self.prompt)]

    def chat_messages(self) -> list[dict[str, Any]]:
        return json.loads(self.messages) if self.messages else []

    def overrides(self) -> dict[str, Any]:
        """The line's own sampling settings (over the job's defaults)."""
        return json.loads(self.sampling) if self.sampling else {}
