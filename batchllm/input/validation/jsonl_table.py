"""A JSONL file read as a table: with a prompt template (`--prompt-template`), each line is a
JSON object whose keys are the template's fields (`{"question": "...", "custom_id": "q1"}`),
not an OpenAI request line. table.py reads it as it reads a CSV file: record batches of the
columns it names.

Each field's value becomes text here (a string as it is, anything else as its JSON), and the
line's `custom_id`, when it gives one, is its id (else the line's number, as for any JSONL
line). A line that cannot be read (not JSON, not an object, over the size limit, text that
UTF-8 cannot hold) stays a row, with its fields null and its problem noted: it becomes an
error row naming its line, and nothing after it is lost.

Which keys the file has is read off its first batch of lines (`BATCH_LINES`): a field that
none of those lines has is refused before the job is created, as a table's missing column is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import pyarrow as pa

from batchllm.input.files.lines import iter_lines
from batchllm.input.formats.unicode_text import UNENCODABLE, may_hold_surrogates, unencodable_field
from batchllm.input.parsing.line import decode_line
from batchllm.input.parsing.problems import LineProblem

BATCH_LINES = 65_536
ID_KEY = "custom_id"


@dataclass(slots=True)
class LineBatch:
    """Up to BATCH_LINES lines: the named keys' texts, the lines' numbers, and the problems of
    the lines that could not be read (by position in the batch)."""

    batch: pa.RecordBatch
    numbers: list[int]
    problems: dict[int, LineProblem]


def jsonl_batches(
    handle: BinaryIO, keys: list[str], max_line_bytes: int
) -> tuple[pa.Schema, Iterator[LineBatch]]:
    """The file's schema (every key of its first batch's objects, as text) and its batches of
    `keys` plus custom_id (texts; null where a line lacks the key)."""
    wanted = list(dict.fromkeys([*keys, ID_KEY]))
    lines = iter_lines(handle, max_line_bytes)
    seen: dict[str, None] = {}
    first = _read_batch(lines, wanted, max_line_bytes, seen)
    schema = pa.schema([(key, pa.string()) for key in seen])

    def batches() -> Iterator[LineBatch]:
        batch = first
        while batch is not None:
            yield batch
            batch = _read_batch(lines, wanted, max_line_bytes, None)

    return schema, batches()


def _read_batch(
    lines: Iterator[Any], wanted: list[str], limit: int, seen: dict[str, None] | None
) -> LineBatch | None:
    numbers: list[int] = []
    problems: dict[int, LineProblem] = {}
    values: dict[str, list[Any]] = {key: [] for key in wanted}
    for line in lines:
        at = len(numbers)
        numbers.append(line.number)
        obj, problem = _object(line.raw, line.size, limit)
        if problem is not None:
            problems[at] = problem
            obj = {}
        if seen is not None:
            seen.update(dict.fromkeys(obj))
        for key in wanted:
            values[key].append(obj.get(key))
        if len(numbers) == BATCH_LINES:
            break
    if not numbers:
        return None
    columns = [_column(values[key]) for key in wanted]
    return LineBatch(pa.RecordBatch.from_arrays(columns, names=wanted), numbers, problems)


def _object(raw: bytes | None, size: int, limit: int) -> tuple[dict[str, Any], LineProblem | None]:
    """The line's JSON object, or the problem that stops it."""
    if raw is None:
        message = f"line is {size:,} bytes, over the limit of {limit:,} (BATCHLLM_MAX_LINE_BYTES)"
        return {}, LineProblem(None, message)
    obj, problem = decode_line(raw)
    if problem is not None:
        return {}, problem
    if not isinstance(obj, dict):
        return {}, LineProblem(None, f"a line must be a JSON object, got {type(obj).__name__}")
    if may_hold_surrogates(raw):
        field = unencodable_field(obj)
        if field is not None:
            return {}, LineProblem(field, UNENCODABLE)
    return obj, None


def _column(values: list[Any]) -> pa.Array:
    """A key's values as one text column: strings as they are; anything else (numbers,
    lists, objects, a mix of types) as its JSON, as field_text writes a table's values."""
    return pa.array(
        [
            value if value is None or isinstance(value, str) else json.dumps(value, default=str)
            for value in values
        ],
        pa.string(),
    )
