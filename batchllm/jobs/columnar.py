"""Validation of many lines at once, for the line shapes nearly every file is made of.

Validating line by line costs a JSON decode and two or three pydantic validations per line, most
of batchllm's own work per row. But a file's lines differ mostly in their texts (custom_id,
prompt, message contents); their other fields (the form, the sampling settings, the roles, the
model) take few distinct values. So a block of lines is parsed at once by pyarrow's JSON reader
(C++, both cores), the lines are grouped by everything except their texts, and one line of each
group goes through the line-by-line validation (reader.parse_line), whose verdict and
normalized settings then hold for the whole group; only the texts are checked per row, and those
checks are vectorized.

Whatever this path is unsure of goes to the line-by-line path, which stays the definition of
validity (the two are compared by tests/unit/test_columnar_property.py):
- a block pyarrow refuses (malformed JSON, values of two types in one field, a key given twice,
  two objects on one line, invalid UTF-8) is halved until the parts parse, down to _SLOW_BELOW
  lines;
- a line whose known field pyarrow read as another type than the field's (a list stop, a
  date-like string read as a timestamp, a float for an int field unless integral and below
  2**53);
- a line holding `null`, `NaN` or `Infinity` (pyarrow reads null as absent, where pydantic may
  tell them apart) or starting with a byte order mark;
- a line with a field whose value is a list or an object other than the messages (stop lists,
  response_format, chat_template_kwargs, message fields beyond role and content);
- a line whose texts fail a check (an empty custom_id, a blank prompt, a message without content);
- every line of a group whose representative line is refused (the error may depend on a text).
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable
from json.encoder import encode_basestring_ascii
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from batchllm.jobs.lines import Line

_SLOW_BELOW = 64  # a part of a refused block this small goes line by line
_BOM = b"\xef\xbb\xbf"
_UNSURE = (b"null", b"NaN", b"Infinity")

# A stored row's values other than its line and custom_id: (kind, prompt, messages, sampling,
# inputs), in INPUT_SCHEMA's terms (jobs/rows.py).
Payload = tuple[str, str | None, str | None, str | None, str | None]

_SAMPLING_TYPES = {
    "max_tokens": pa.int64(),
    "max_completion_tokens": pa.int64(),
    "temperature": pa.float64(),
    "top_p": pa.float64(),
    "top_k": pa.int64(),
    "min_p": pa.float64(),
    "stop": pa.string(),
    "seed": pa.int64(),
    "presence_penalty": pa.float64(),
    "frequency_penalty": pa.float64(),
    "repetition_penalty": pa.float64(),
    "ignore_eos": pa.bool_(),
    "n": pa.int64(),
    "top_logprobs": pa.int64(),
    "add_generation_prompt": pa.bool_(),
    "continue_final_message": pa.bool_(),
    "regex": pa.string(),
    "grammar": pa.string(),
    "adapter": pa.string(),
    "dimensions": pa.int64(),
    "model": pa.string(),
    "user": pa.string(),
    "encoding_format": pa.string(),
}
# The type each known field must have to be read here; a field of another type (a date-like
# stop read as a timestamp, a list stop, an int where a bool belongs) sends its rows line by
# line. Fields not listed (logprobs: true or 3, unknown names) are grouped on as they come.
# pyarrow infers the types: an explicit schema of all these fields parses 2.6x slower.
_EXPECTED = {
    "custom_id": pa.string(),
    "method": pa.string(),
    "url": pa.string(),
    "prompt": pa.string(),
    "input": pa.string(),
    **_SAMPLING_TYPES,
}
_PARSE = pajson.ParseOptions(newlines_in_values=False)
_EXACT_FLOAT_INT = 2**53  # integers a float64 holds exactly

# Column names: (field,) at the top level, ("body", field) inside the OpenAI form's body.
Name = tuple[str, ...]
_TEXT_FIELDS = ("custom_id", "prompt", "input")
_MESSAGES_NAMES = (("messages",), ("body", "messages"))


@functools.cache
def _not_space() -> str:
    """A regex for one character Python's str.strip() keeps: a prompt without one is blank
    (reader.parse_line). Built on first use: the scan of every code point costs ~70 ms, too
    much for the import of every CLI command."""
    spaces = (chr(c) for c in range(0x110000) if chr(c).isspace())
    return "[^" + "".join(f"\\x{{{ord(c):x}}}" for c in spaces) + "]"


LineCheck = Callable[[Line], tuple[str | None, Any]]
# A representative line's verdict for its group: (kind, "body" or "top": where its texts are,
# the stored sampling text), or None when the line is refused.
Verdict = tuple[str, str, str | None]
Judge = Callable[[Any, int], Verdict | None]


def check_block(
    lines: list[Line], check_line: LineCheck, judge: Judge
) -> list[tuple[int, str | None, Any]]:
    """(line number, the custom_id the line gives, its Payload or what check_line returns for
    it) per line, in order. `check_line` is the line-by-line path: (given id, a Payload or the
    problem) for one line; `judge` gives a representative line's Verdict from its decoded JSON
    and line number."""
    results: dict[int, tuple[str | None, Any]] = {}
    sure = [line for line in lines if line.raw is not None]
    for line in lines:
        if line.raw is None:  # over the size limit
            results[line.number] = check_line(line)
    joined: bytes | None = b"\n".join(line.raw for line in sure)  # type: ignore[misc]
    assert joined is not None
    if joined.startswith(_BOM) or b"\n" + _BOM in joined or any(w in joined for w in _UNSURE):
        unsure = [line for line in sure if _is_unsure(line.raw)]  # type: ignore[arg-type]
        for line in unsure:
            results[line.number] = check_line(line)
        if unsure:
            sure, joined = [line for line in sure if line.number not in results], None
    for part, table in _parsed_parts(sure, joined):
        if table is None:
            for line in part:
                results[line.number] = check_line(line)
        else:
            _check_table(part, table, check_line, judge, results)
    return [(line.number, *results[line.number]) for line in lines]


def _is_unsure(raw: bytes) -> bool:
    return raw.startswith(_BOM) or any(word in raw for word in _UNSURE)


def _parsed_parts(
    lines: list[Line], joined: bytes | None = None
) -> list[tuple[list[Line], pa.Table | None]]:
    """The lines in parts pyarrow parses to one row per line (None: a part to check line by
    line). `joined`: the lines' bytes joined by newlines, where the caller has them."""
    if not lines:
        return []
    if joined is None:
        joined = b"\n".join(line.raw or b"" for line in lines)  # none is None: check_block
    try:
        table = pajson.read_json(io.BytesIO(joined), parse_options=_PARSE)
        table.validate(full=True)  # the reader lets invalid UTF-8 through into strings
        if table.num_rows == len(lines):
            return [(lines, table)]
    except pa.ArrowInvalid:
        pass
    if len(lines) == 1 or len(lines) < _SLOW_BELOW:
        return [(lines, None)]
    middle = len(lines) // 2
    return _parsed_parts(lines[:middle]) + _parsed_parts(lines[middle:])


class _Columns:
    """A parsed part's columns, flattened (("body", "max_tokens") beside ("max_tokens",)) and
    brought to the known fields' types; `unsure` marks the rows a column could not be."""

    def __init__(self, table: pa.Table) -> None:
        self.rows = table.num_rows
        self.columns: dict[Name, pa.Array] = {}
        self.unsure = np.zeros(self.rows, dtype=bool)
        for name in table.column_names:
            column = table.column(name).combine_chunks()
            if name == "body" and pa.types.is_struct(column.type):
                self.columns[("body",)] = column
                for i in range(column.type.num_fields):
                    child = column.type.field(i).name
                    self._add(("body", child), pc.struct_field(column, [i]))
            else:
                self._add((name,), column)

    def _add(self, name: Name, column: pa.Array) -> None:
        if name in _MESSAGES_NAMES:
            conformed = column if _is_messages(column.type) else None
        elif name == ("body",):
            conformed = None  # a body that is not an object
        else:
            expected = _EXPECTED.get(name[-1])
            conformed = column if expected is None else _as_type(column, expected)
        if conformed is None:
            self.mark(pc.is_valid(column))
        else:
            self.columns[name] = conformed

    def mark(self, mask: pa.Array) -> None:
        self.unsure[np.asarray(mask.fill_null(False).to_numpy(zero_copy_only=False))] = True

    def get(self, *name: str) -> pa.Array | None:
        return self.columns.get(name)


def _is_messages(kind: pa.DataType) -> bool:
    """A list of objects whose role and content are strings (other fields are checked per
    row)."""
    if not pa.types.is_list(kind) or not pa.types.is_struct(kind.value_type):
        return False
    fields = {field.name: field.type for field in kind.value_type}
    return bool(fields.get("role") == pa.string() and fields.get("content") == pa.string())


def _as_type(column: pa.Array, expected: pa.DataType) -> pa.Array | None:
    """The column as the field's type, where its values are exactly what pydantic reads from
    them (an int for a float field, an integral float below 2**53 for an int field)."""
    if column.type == expected:
        return column
    if column.type == pa.int64() and expected == pa.float64():
        try:
            return column.cast(expected)  # a safe cast: it refuses an int a float cannot hold
        except pa.ArrowInvalid:
            return None
    if column.type == pa.float64() and expected == pa.int64():
        values = column.drop_null()
        whole = pc.all(pc.equal(pc.floor(values), values)).as_py() is not False
        small = pc.max(pc.abs(values)).as_py() or 0
        return column.cast(expected) if whole and small < _EXACT_FLOAT_INT else None
    return None


def _check_table(
    lines: list[Line],
    table: pa.Table,
    check_line: LineCheck,
    judge: Judge,
    results: dict[int, tuple[str | None, Any]],
) -> None:
    columns = _Columns(table)
    unsure = _unsure_rows(columns)
    keys = _group_keys(columns)
    order = np.flatnonzero(~unsure)
    groups, first = np.unique(keys[order], return_index=True)
    verdicts: dict[int, Verdict | None] = {}
    for group, at in zip(groups.tolist(), order[first].tolist(), strict=True):
        line = lines[at]
        verdicts[group] = judge(json.loads(line.raw or b""), line.number)
    texts = _Texts(columns)
    stored = {group: texts.source(verdict) for group, verdict in verdicts.items() if verdict}
    custom_ids = texts.custom_id
    for row, (line, doubt, key) in enumerate(zip(lines, unsure.tolist(), keys.tolist())):
        found = None if doubt else stored.get(key)
        if found is None:
            results[line.number] = check_line(line)
            continue
        kind, column, sampling, chat = found
        text = column[row]
        results[line.number] = (
            custom_ids[row],
            (kind, None, text, sampling, None) if chat else (kind, text, None, sampling, None),
        )


def _unsure_rows(columns: _Columns) -> np.ndarray:
    """Rows to check line by line: those marked while reading the columns, a list or object
    value other than the messages, or a text that fails its check."""
    for name, column in columns.columns.items():
        if name not in _MESSAGES_NAMES and name != ("body",) and pa.types.is_nested(column.type):
            columns.mark(pc.is_valid(column))
    for custom_id in (columns.get("custom_id"), columns.get("body", "custom_id")):
        if custom_id is not None and pa.types.is_string(custom_id.type):
            columns.mark(pc.equal(pc.utf8_length(custom_id), 0))
    for name in (("prompt",), ("body", "prompt"), ("input",), ("body", "input")):
        column = columns.columns.get(name)
        if column is not None:
            columns.mark(pc.invert(pc.match_substring_regex(column, _not_space())))
    for name in _MESSAGES_NAMES:
        column = columns.columns.get(name)
        if column is None:
            continue
        items = pc.list_flatten(column)
        parents = pc.list_parent_indices(column).to_numpy()
        bad = pc.is_null(items.field("content"))
        for field in items.type:  # message fields beyond role and content
            if field.name not in ("role", "content"):
                bad = pc.or_(bad, pc.is_valid(items.field(field.name)))
        columns.unsure[parents[np.asarray(bad.to_numpy(zero_copy_only=False))]] = True
    return columns.unsure


def _group_keys(columns: _Columns) -> np.ndarray:
    """One integer per row, equal for rows whose fields other than texts are equal."""
    keys = np.zeros(columns.rows, dtype=np.int64)
    for name, column in sorted(columns.columns.items()):
        if name[-1] in _TEXT_FIELDS or name == ("body",):
            parts = [pc.is_valid(column)]  # only whether the field is there
        elif name in _MESSAGES_NAMES:
            # the roles and their count (a valid role holds no separator: they are names)
            parts = [pc.list_value_length(column), _joined_roles(column)]
        elif pa.types.is_nested(column.type):
            parts = [pc.is_valid(column)]  # rows where it is given are checked line by line
        else:
            parts = [column]
        for part in parts:
            if part.null_count == len(part):
                continue  # the field is in no row of the part: it tells no row apart
            codes = pc.dictionary_encode(part, null_encoding="encode").indices.to_numpy()
            keys = np.unique(keys * (int(codes.max(initial=0)) + 1) + codes, return_inverse=True)[
                1
            ].astype(np.int64)
    return keys


def _joined_roles(column: pa.Array) -> pa.Array:
    return pc.binary_join(_list_of(column, pc.list_flatten(column).field("role")), "\x1f")


def _list_of(column: pa.Array, values: pa.Array) -> pa.ListArray:
    """`values` (one per item of the list column `column`) as lists shaped like `column`."""
    lengths = pc.list_value_length(column).fill_null(0).to_numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pc.is_null(column))


class _Texts:
    """A parsed part's texts as Python values, and the stored payload of one of its rows."""

    def __init__(self, columns: _Columns) -> None:
        self.custom_id = _text_list(columns, "custom_id")
        self.prompt = _text_list(columns, "prompt")
        self.body_prompt = _text_list(columns, "body", "prompt")
        self.input = _text_list(columns, "input")
        self.body_input = _text_list(columns, "body", "input")
        self.messages = _messages_json(columns.get("messages"), columns.rows)
        self.body_messages = _messages_json(columns.get("body", "messages"), columns.rows)

    def source(self, verdict: Verdict) -> tuple[str, list[str | None], str | None, bool]:
        """For the rows of a group with this verdict: their kind, the column holding their
        text, their sampling text, and whether the text is the messages."""
        kind, where, sampling = verdict
        body = where == "body"
        if kind == "chat":
            return kind, self.body_messages if body else self.messages, sampling, True
        if kind == "embed":
            return kind, self.body_input if body else self.input, sampling, False
        return kind, self.body_prompt if body else self.prompt, sampling, False


def _text_list(columns: _Columns, *name: str) -> list[str | None]:
    column = columns.get(*name)
    return column.to_pylist() if column is not None else [None] * columns.rows


def _messages_json(column: pa.Array | None, rows: int) -> list[str | None]:
    """Each row's messages as the JSON text validation stores (json.dumps of role/content
    objects, byte for byte)."""
    if column is None:
        return [None] * rows
    items = pc.list_flatten(column)
    known_roles: dict[str, str] = {}
    roles = [
        None if role is None else known_roles.setdefault(role, encode_basestring_ascii(role))
        for role in items.field("role").to_pylist()
    ]
    contents = [
        None if text is None else encode_basestring_ascii(text)
        for text in items.field("content").to_pylist()
    ]
    messages = [
        None if role is None or text is None else '{"role": ' + role + ', "content": ' + text + "}"
        for role, text in zip(roles, contents, strict=True)
    ]
    lengths = pc.list_value_length(column).to_pylist()
    if len(messages) == rows and lengths.count(1) == rows and None not in messages:
        return ["[" + message + "]" for message in messages]  # type: ignore[operator]  # one each
    out: list[str | None] = []
    at = 0
    for length in lengths:
        row = [m for m in messages[at : at + (length or 0)] if m is not None]
        if length is None or len(row) < length:
            out.append(None)  # no messages, or a message without role or content: unsure rows
        else:
            out.append("[" + ", ".join(row) + "]")
        at += length or 0
    return out
