"""Validation of many lines at once, for the line shapes nearly every file is made of.

Validating line by line costs a JSON decode and two or three pydantic validations per line, most
of batchllm's own work per row. But a file's lines differ mostly in their texts (custom_id,
prompt, message contents); their other fields (the form, the sampling settings, the roles, the
model) take few distinct values. So a block of lines is parsed at once by pyarrow's JSON reader
(C++, both cores), the lines are grouped by everything except their texts, and one line of each
group goes through the line-by-line validation (parsing/line.py), whose verdict and
normalized settings then hold for the whole group; only the texts are checked per row, and those
checks are vectorized. The rows stay in Arrow columns (the texts as parsed, the messages' JSON
built column-wise, kinds and settings taken by group) all the way to the stored shard: no Python
object per row.

Whatever this path is unsure of goes to the line-by-line path, which stays the definition of
validity (the two are compared by tests/unit/test_columnar_property.py):
- a block pyarrow refuses (malformed JSON, values of two types in one field, a key given twice,
  two objects on one line, invalid UTF-8) is halved until the parts parse, down to _SLOW_BELOW
  lines;
- a line whose known field pyarrow read as another type than the field's (a list stop, a
  date-like string read as a timestamp, a float for an int field unless integral and below
  2**53);
- a line holding `null` (pyarrow reads null as absent, where pydantic may tell them apart; only
  lines with a null or absent field are searched for the word), a NaN or infinite number, or a
  block's first line starting with a byte order mark (pyarrow skips one there, and refuses one
  elsewhere);
- a line with a field whose value is a list or an object other than the messages (stop lists,
  response_format, chat_template_kwargs, message fields beyond role and content);
- a line whose texts fail a check (an empty custom_id, a blank prompt, a message without content);
- every line of a group whose representative line is refused (the error may depend on a text).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from batchllm.input.files.lines import Line

_SLOW_BELOW = 64  # a part of a refused block this small goes line by line
_BOM = b"\xef\xbb\xbf"

# A stored row's values other than its line and custom_id: (kind, prompt, messages, sampling,
# inputs), in INPUT_SCHEMA's terms (input/formats/rows.py).
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


# The characters Python's str.isspace() accepts (Unicode's White_Space plus the four ASCII
# separators): a prompt made only of these is blank (parsing/line.py). Written out, since
# scanning every code point for them took 0.1-0.4 s of each `batchllm run`; a unit test keeps
# the list equal to the scan.
SPACES = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
    "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


# A text of these characters alone (or none): a blank prompt. A positive class: RE2 builds the
# negated one ("a character strip() keeps") over all of Unicode, 0.3 s a run here.
BLANK = "^[" + "".join(f"\\x{{{ord(c):x}}}" for c in SPACES) + "]*$"


LineCheck = Callable[[Line], tuple[str | None, Any]]
# A representative line's verdict for its group: (kind, "body" or "top": where its texts are,
# the stored sampling text), or None when the line is refused.
Verdict = tuple[str, str, str | None]
Judge = Callable[[Any, int], Verdict | None]

# The columns of a CheckedBlock: the custom_id a line gives (null: none) and the stored values
# after it (INPUT_SCHEMA's kind, prompt, messages, sampling, inputs; input/formats/rows.py).
BLOCK_COLUMNS = ("given", "kind", "prompt", "messages", "sampling", "inputs")


@dataclass
class CheckedBlock:
    """check_block's verdicts on a list of lines, as columns in line order (BLOCK_COLUMNS,
    strings). A refused line has a null kind and what check_line returned for it in
    `problems`, by its position in the list."""

    numbers: list[int]
    columns: dict[str, pa.Array]
    problems: dict[int, Any]


class _Pieces:
    """The verdicts of a block's lines as they are made: columns for runs of rows the block
    decided, Python values for the rows checked line by line; merged into line order once."""

    def __init__(self) -> None:
        self.decided: list[tuple[np.ndarray, dict[str, pa.Array]]] = []
        self.line_by_line: dict[int, tuple[str | None, Any]] = {}

    def merged(self, numbers: list[int]) -> CheckedBlock:
        slow = sorted(self.line_by_line)
        problems: dict[int, Any] = {}
        values: dict[str, list[Any]] = {name: [] for name in BLOCK_COLUMNS}
        for at in slow:
            given, item = self.line_by_line[at]
            values["given"].append(given)
            if isinstance(item, tuple):  # a Payload
                for name, value in zip(BLOCK_COLUMNS[1:], item, strict=True):
                    values[name].append(value)
            else:
                problems[at] = item
                for name in BLOCK_COLUMNS[1:]:
                    values[name].append(None)
        if not slow and len(self.decided) == 1:  # the common block: one run, every row
            return CheckedBlock(numbers, self.decided[0][1], problems)
        positions = np.concatenate(
            [at for at, _ in self.decided] + [np.asarray(slow, dtype=np.int64)]
        )
        order = pa.array(np.argsort(positions, kind="stable"))
        columns = {
            name: pa.concat_arrays(
                [part[name] for _, part in self.decided] + [pa.array(values[name], pa.string())]
            ).take(order)
            for name in BLOCK_COLUMNS
        }
        return CheckedBlock(numbers, columns, problems)


def check_block(lines: list[Line], check_line: LineCheck, judge: Judge) -> CheckedBlock:
    """The verdict on each line. `check_line` is the line-by-line path: (given id, a Payload
    or the problem) for one line; `judge` gives a representative line's Verdict from its
    decoded JSON and line number."""
    pieces = _Pieces()
    sure = [at for at, line in enumerate(lines) if line.raw is not None]
    if len(sure) < len(lines):
        for at, line in enumerate(lines):
            if line.raw is None:  # over the size limit
                pieces.line_by_line[at] = check_line(line)
    for start, stop, table in _parsed_parts([lines[at] for at in sure]):
        part = [lines[at] for at in sure[start:stop]]
        positions = np.asarray(sure[start:stop], dtype=np.int64)
        if table is None:
            for at, line in zip(positions.tolist(), part, strict=True):
                pieces.line_by_line[at] = check_line(line)
            continue
        decided, columns = _check_table(part, table, judge)
        for at, line in zip(positions[~decided].tolist(), np.flatnonzero(~decided).tolist()):
            pieces.line_by_line[at] = check_line(part[line])
        if decided.all():
            pieces.decided.append((positions, columns))
        elif decided.any():
            mask = pa.array(decided)
            pieces.decided.append(
                (positions[decided], {name: col.filter(mask) for name, col in columns.items()})
            )
    return pieces.merged([line.number for line in lines])


def _parsed_parts(lines: list[Line], offset: int = 0) -> list[tuple[int, int, pa.Table | None]]:
    """The lines in parts pyarrow parses to one row per line, as (start, stop, table) over
    the list (None: a part to check line by line)."""
    if not lines:
        return []
    joined = b"\n".join(line.raw or b"" for line in lines)  # none is None: check_block
    try:
        table = pajson.read_json(io.BytesIO(joined), parse_options=_PARSE)
        table.validate(full=True)  # the reader lets invalid UTF-8 through into strings
        if table.num_rows == len(lines):
            return [(offset, offset + len(lines), table)]
    except pa.ArrowInvalid:
        pass
    if len(lines) == 1 or len(lines) < _SLOW_BELOW:
        return [(offset, offset + len(lines), None)]
    middle = len(lines) // 2
    return _parsed_parts(lines[:middle], offset) + _parsed_parts(lines[middle:], offset + middle)


class _Columns:
    """A parsed part's columns, flattened (("body", "max_tokens") beside ("max_tokens",)) and
    brought to the known fields' types; `unsure` marks the rows a column could not be, and
    `has_null` the rows holding a null value or lacking a field (pyarrow reads both as null)."""

    def __init__(self, table: pa.Table) -> None:
        self.rows = table.num_rows
        self.columns: dict[Name, pa.Array] = {}
        self.unsure = np.zeros(self.rows, dtype=bool)
        self.has_null = np.zeros(self.rows, dtype=bool)
        for name in table.column_names:
            column = table.column(name).combine_chunks()
            if name == "body" and pa.types.is_struct(column.type):
                self.columns[("body",)] = column
                self._note_nulls(column)
                for i in range(column.type.num_fields):
                    child = column.type.field(i).name
                    self._add(("body", child), pc.struct_field(column, [i]))
            else:
                self._add((name,), column)

    def _add(self, name: Name, column: pa.Array) -> None:
        self._note_nulls(column)
        if pa.types.is_floating(column.type):  # NaN and Infinity parse as floats here
            self.mark(pc.or_(pc.is_nan(column), pc.is_inf(column)))
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

    def _note_nulls(self, column: pa.Array) -> None:
        if column.null_count:
            self.has_null |= _bools(pc.is_null(column))

    def mark(self, mask: pa.Array) -> None:
        self.unsure |= _bools(mask)

    def get(self, *name: str) -> pa.Array | None:
        return self.columns.get(name)


def _bools(mask: pa.Array) -> np.ndarray:
    return np.asarray(mask.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)


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
    lines: list[Line], table: pa.Table, judge: Judge
) -> tuple[np.ndarray, dict[str, pa.Array]]:
    """Which of the part's rows the block decides, and BLOCK_COLUMNS for them (the other rows'
    values are to be ignored: the caller checks them line by line)."""
    columns = _Columns(table)
    unsure = _unsure_rows(columns, lines)
    keys = _group_keys(columns)
    order = np.flatnonzero(~unsure)
    groups, first = np.unique(keys[order], return_index=True)
    verdicts: list[Verdict] = []
    verdict_of_key = np.full(int(keys.max(initial=0)) + 1, -1, dtype=np.int64)
    for group, at in zip(groups.tolist(), order[first].tolist(), strict=True):
        line = lines[at]
        verdict = judge(json.loads(line.raw or b""), line.number)
        if verdict is not None:
            verdict_of_key[group] = len(verdicts)
            verdicts.append(verdict)
    row_verdict = verdict_of_key[keys]
    decided = ~unsure & (row_verdict >= 0)
    which = pa.array(row_verdict, mask=~decided)  # null: not decided here
    texts = _Texts(columns)
    prompt_from: list[int | None] = []
    messages_from: list[int | None] = []
    for kind, where, _ in verdicts:
        source = texts.index(kind, where)
        prompt_from.append(None if kind == "chat" else source)
        messages_from.append(source if kind == "chat" else None)
    prompt = texts.pick(prompt_from, row_verdict, decided)
    messages = texts.pick(messages_from, row_verdict, decided)
    # A row the verdict reads its text from must have one (else: line by line).
    text = pc.coalesce(prompt, messages)
    decided &= ~_bools(pc.is_null(text))
    return decided, {
        "given": _string_column(columns.get("custom_id"), columns.rows),
        "kind": pa.array([kind for kind, _, _ in verdicts], pa.string()).take(which),
        "prompt": prompt,
        "messages": messages,
        "sampling": pa.array([sampling for _, _, sampling in verdicts], pa.string()).take(which),
        "inputs": pa.nulls(columns.rows, pa.string()),
    }


def _string_column(column: pa.Array | None, rows: int) -> pa.Array:
    return column if column is not None else pa.nulls(rows, pa.string())


def _unsure_rows(columns: _Columns, lines: list[Line]) -> np.ndarray:
    """Rows to check line by line: those marked while reading the columns, a list or object
    value other than the messages, a text that fails its check, a null written as such (not
    an absent field; pydantic may tell them apart) and a first line starting with a byte order
    mark (pyarrow skips one there)."""
    for name, column in columns.columns.items():
        if name not in _MESSAGES_NAMES and name != ("body",) and pa.types.is_nested(column.type):
            columns.mark(pc.is_valid(column))
    for custom_id in (columns.get("custom_id"), columns.get("body", "custom_id")):
        if custom_id is not None and pa.types.is_string(custom_id.type):
            columns.mark(pc.equal(pc.utf8_length(custom_id), 0))
    for name in (("prompt",), ("body", "prompt"), ("input",), ("body", "input")):
        column = columns.columns.get(name)
        if column is not None:
            columns.mark(pc.match_substring_regex(column, BLANK))
    for name in _MESSAGES_NAMES:
        column = columns.columns.get(name)
        if column is None:
            continue
        items = pc.list_flatten(column)
        parents = pc.list_parent_indices(column).to_numpy()
        bad = pc.is_null(items.field("content"))
        if items.null_count:  # a message written as null
            columns.has_null[parents[_bools(pc.is_null(items))]] = True
        for field in items.type:  # message fields beyond role and content
            if field.name not in ("role", "content"):
                bad = pc.or_(bad, pc.is_valid(items.field(field.name)))
            if items.field(field.name).null_count:
                columns.has_null[parents[_bools(pc.is_null(items.field(field.name)))]] = True
        columns.unsure[parents[_bools(bad)]] = True
    unsure = columns.unsure
    for at in np.flatnonzero(columns.has_null & ~unsure).tolist():
        if b"null" in (lines[at].raw or b""):
            unsure[at] = True
    if lines and (lines[0].raw or b"").startswith(_BOM):
        unsure[0] = True
    return unsure


def _group_keys(columns: _Columns) -> np.ndarray:
    """One integer per row, equal for rows whose fields other than texts are equal; the
    integers are 0..n-1 for n distinct groups."""
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
    """A parsed part's text columns as stored: the prompts and inputs as they are, the
    messages as their JSON text."""

    _SOURCES = (("prompt",), ("body", "prompt"), ("input",), ("body", "input"))

    def __init__(self, columns: _Columns) -> None:
        self.columns = columns
        self.built: dict[int, pa.Array] = {}

    def index(self, kind: str, where: str) -> int:
        """Which text column rows of this kind and form take their text from."""
        body = where == "body"
        if kind == "chat":
            return 4 + body
        return (2 if kind in ("embed", "classify") else 0) + body

    def column(self, index: int) -> pa.Array:
        if index not in self.built:
            rows = self.columns.rows
            if index >= 4:
                name = _MESSAGES_NAMES[index - 4]
                found = self.columns.columns.get(name)
                self.built[index] = (
                    pa.nulls(rows, pa.string()) if found is None else _messages_json(found)
                )
            else:
                found = self.columns.columns.get(self._SOURCES[index])
                self.built[index] = _string_column(found, rows)
        return self.built[index]

    def pick(
        self, source_of: list[int | None], row_verdict: np.ndarray, decided: np.ndarray
    ) -> pa.Array:
        """Each decided row's text from the column its verdict names (null elsewhere)."""
        rows = self.columns.rows
        used = sorted({source for source in source_of if source is not None})
        if not used:
            return pa.nulls(rows, pa.string())
        slot = np.full(len(source_of), -1, dtype=np.int64)
        for verdict, source in enumerate(source_of):
            if source is not None:
                slot[verdict] = used.index(source)
        chosen = slot[np.where(decided, row_verdict, 0)]
        take = chosen * rows + np.arange(rows)
        mask = ~decided | (chosen < 0)
        columns = [self.column(source) for source in used]
        stacked = columns[0] if len(columns) == 1 else pa.concat_arrays(columns)
        return stacked.take(pa.array(np.where(mask, 0, take), mask=mask))


# A JSON string json.dumps writes as the text between quotes, unchanged: printable ASCII
# other than the quote and the backslash.
_PLAIN_JSON = r"^[ !#-\[\]-~]*$"


def json_strings(values: pa.Array) -> pa.Array:
    """Each string as json.dumps encodes it (ASCII, quoted); the rare ones needing escapes
    through json's own encoder."""
    plain = pc.match_substring_regex(values, _PLAIN_JSON).fill_null(True)
    quoted = pc.binary_join_element_wise('"', values, '"', "")
    if pc.all(plain).as_py():
        return quoted
    escaped = pc.invert(plain)
    texts = values.filter(escaped).to_pylist()
    return pc.replace_with_mask(
        quoted, escaped, pa.array([encode_basestring_ascii(text) for text in texts], pa.string())
    )


def _messages_json(column: pa.Array) -> pa.Array:
    """Each row's messages as the JSON text validation stores (json.dumps of role/content
    objects, byte for byte); null for a row without messages or with a message lacking its
    role or content (those rows are checked line by line)."""
    items = pc.list_flatten(column)
    item_json = pc.binary_join_element_wise(
        '{"role": ',
        json_strings(items.field("role")),
        ', "content": ',
        json_strings(items.field("content")),
        "}",
        "",
    )
    listed = pc.binary_join(_list_of(column, item_json), ", ")
    return pc.binary_join_element_wise("[", listed, "]", "")
