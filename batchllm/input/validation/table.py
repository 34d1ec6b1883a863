"""Table input: the rows of a Parquet or CSV file (a data pipeline's output) as requests, with
no conversion to JSONL first.

A row becomes the same stored input row a JSONL line becomes (INPUT_SCHEMA, formats/rows.py), by
the same rules and with the same error rows (validate.stored_block): a null or blank prompt is an
error row naming its row and column; the id column's value is the row's custom_id (a missing one
is an error row, a repeated one a duplicate), or without one the row number (from 1, as the
`line` of every output row). A column the file lacks is refused before anything is stored.

The file is read a record batch at a time (ParquetFile.iter_batches, pyarrow.csv.open_csv), only
the columns named, so memory stays flat in its length; a local path or a URI (s3://...).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from batchllm.errors import InputError
from batchllm.input.files.custom_ids import CustomIds
from batchllm.input.files.source import InputSource
from batchllm.input.formats.prompt_template import PromptTemplate
from batchllm.input.formats.rows import request_payload
from batchllm.input.formats.schemas import LineError
from batchllm.input.images import ImageChecks, image_urls
from batchllm.input.parsing.line import parse_line
from batchllm.input.parsing.problems import LineProblem
from batchllm.input.validation.columnar import BLANK, BLOCK_COLUMNS, CheckedBlock, json_strings
from batchllm.input.validation.jsonl_table import BATCH_LINES, ID_KEY, LineBatch, jsonl_batches
from batchllm.input.validation.validate import stored_block
from batchllm.settings import Settings
from batchllm.spec import EMBED, POOLING_TASKS, TableColumns

_BATCH_ROWS = 65_536  # rows per record batch: a few MB of text, whatever the file's length
_CSV_BLOCK = 4 << 20


def check_columns(
    name: str,
    schema: pa.Schema,
    table: TableColumns,
    task: str = "generate",
    *,
    jsonl: bool = False,
) -> None:
    """InputError, naming the file and the columns it has, for a column it lacks or one that
    cannot hold what it is named for; also for table options an embedding job cannot use.
    For a JSONL file (`jsonl`), its columns are the keys of its first lines."""
    have = ", ".join(schema.names) or "none"
    for role, column in _wanted_columns(table):
        if column in schema.names:
            continue
        if jsonl:
            raise InputError(
                f"{name}: no line among the first {BATCH_LINES:,} has key {column!r} "
                f"({role}); their keys: {have}"
            )
        raise InputError(f"{name}: no column {column!r} ({_the(role)}); its columns: {have}")
    if table.prompt_column is not None:
        kind = schema.field(table.prompt_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise InputError(
                f"{name}: column {table.prompt_column!r} (the prompt column) holds {kind}, not text"
            )
    if task in POOLING_TASKS and (table.messages_column is not None or table.system is not None):
        job = "an embedding job embeds" if task == EMBED else "a classification job classifies"
        raise InputError(
            f"{name}: {job} the prompt column's (or template's) texts; "
            "a messages column or a system message is for generation"
        )


def _the(role: str) -> str:
    return role if role.startswith("a ") else f"the {role}"


def _wanted_columns(table: TableColumns) -> list[tuple[str, str]]:
    named = [
        ("prompt column", table.prompt_column),
        ("messages column", table.messages_column),
        ("id column", table.id_column),
    ]
    if table.prompt_template is not None:
        fields = PromptTemplate.parse(table.prompt_template).fields
        named += [("a field of the prompt template", field) for field in fields]
    return [(role, column) for role, column in named if column is not None]


def table_schema(
    source: InputSource, table: TableColumns, task: str, *, settings: Settings
) -> pa.Schema:
    """The file's columns (read from the Parquet footer or the CSV header; a JSONL file's
    keys, from its first lines), checked."""
    with _batches(source, table, task, max_line_bytes=settings.max_line_bytes) as (schema, _):
        return schema


@contextmanager
def _batches(
    source: InputSource, table: TableColumns, task: str, *, max_line_bytes: int
) -> Iterator[tuple[pa.Schema, Iterator[LineBatch]]]:
    """The file's schema (checked) and its record batches of the named columns, numbered."""
    with ExitStack() as stack:
        try:
            columns = list(dict.fromkeys(column for _, column in _wanted_columns(table)))
            schema, batches = _open(stack, source, columns, max_line_bytes)
        except (pa.ArrowInvalid, OSError) as exc:  # ArrowInvalid: not Parquet, not CSV
            raise _unreadable(source, exc) from exc
        check_columns(source.name, schema, table, task, jsonl=source.format == "jsonl")
        yield schema, _reading(batches, source)


def _open(
    stack: ExitStack, source: InputSource, columns: list[str], max_line_bytes: int
) -> tuple[pa.Schema, Iterator[LineBatch]]:
    if source.format == "jsonl":
        handle = stack.enter_context(source.open())
        return jsonl_batches(handle, columns, max_line_bytes)
    if source.format == "csv":
        handle = stack.enter_context(source.open())
        # Text columns stay text: an id column of "007" must not become 7.
        reader = pacsv.open_csv(
            handle,
            read_options=pacsv.ReadOptions(block_size=_CSV_BLOCK),
            convert_options=pacsv.ConvertOptions(
                column_types={column: pa.string() for column in columns}
            ),
        )
        return reader.schema, _numbered(batch.select(columns) for batch in reader)
    if source.uri:
        fs, path = source.filesystem()
        parquet = pq.ParquetFile(stack.enter_context(fs.open_input_file(path)))
    else:
        parquet = stack.enter_context(pq.ParquetFile(source.local_path))
    schema = parquet.schema_arrow
    named = [column for column in columns if column in schema.names]  # checked after this
    return schema, _numbered(parquet.iter_batches(_BATCH_ROWS, columns=named))


def _numbered(batches: Iterator[pa.RecordBatch]) -> Iterator[LineBatch]:
    """A table's record batches with their row numbers (from 1), empty ones left out."""
    first = 1
    for batch in batches:
        if batch.num_rows:
            yield LineBatch(batch, list(range(first, first + batch.num_rows)), {})
            first += batch.num_rows


def _reading(batches: Iterator[LineBatch], source: InputSource) -> Iterator[LineBatch]:
    try:
        yield from batches
    except (pa.ArrowInvalid, OSError) as exc:  # e.g. a CSV row with too many fields
        raise _unreadable(source, exc) from exc


def _unreadable(source: InputSource, exc: Exception) -> InputError:
    return InputError(f"{source.name}: cannot read as {source.format}: {exc}")


def read_table_chunks(
    source: InputSource,
    table: TableColumns,
    *,
    settings: Settings,
    adapters: frozenset[str] = frozenset(),
    task: str = "generate",
) -> Iterator[tuple[pa.Table, list[LineError]]]:
    """The file's rows as rows to store, a record batch at a time: a table in INPUT_SCHEMA
    and the LineErrors of its rows that cannot run (validate.read_row_chunks' contract),
    read and checked as `settings` say."""
    name = source.name
    ids = CustomIds()
    images = ImageChecks(settings)
    jsonl = source.format == "jsonl"
    try:
        with _batches(source, table, task, max_line_bytes=settings.max_line_bytes) as (
            _,
            batches,
        ):
            for rows in batches:
                with images.prefetching(_image_urls(rows.batch, table)):
                    block = _checked_batch(rows, table, adapters, task, settings, jsonl=jsonl)
                yield stored_block(block, ids, name)
    finally:
        images.close()
        ids.close()


def _image_urls(batch: pa.RecordBatch, table: TableColumns) -> Iterator[str]:
    """The image URLs of a batch's messages, fetched ahead (input/images/checks.py)."""
    if table.messages_column is None:
        return iter(())
    column = batch.column(str(table.messages_column))
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.filter(pc.fill_null(pc.match_substring(column, "image_url"), False))
    elif "image_url" not in str(column.type):  # structs without image parts
        return iter(())
    return image_urls(column.to_pylist())


def _checked_batch(
    rows: LineBatch,
    table: TableColumns,
    adapters: frozenset[str],
    task: str,
    settings: Settings,
    *,
    jsonl: bool = False,
) -> CheckedBlock:
    batch, numbers = rows.batch, rows.numbers
    problems: dict[int, LineProblem] = dict(rows.problems)  # lines that could not be read
    unit = "line" if jsonl else "row"
    if table.prompt_template is not None:
        text = _templated(batch, table.prompt_template, numbers, problems, unit)
        columns = _prompt_columns(text, "prompt_template", table, task, numbers, problems, unit)
    elif table.prompt_column is not None:
        column = str(table.prompt_column)
        text = pc.cast(batch.column(column), pa.string())
        columns = _prompt_columns(text, column, table, task, numbers, problems, unit)
    else:
        columns = _messages_columns(batch, table, adapters, numbers, problems, settings)
    if table.id_column is None and jsonl:  # the line's own custom_id, else its number
        columns["given"] = pc.cast(batch.column(ID_KEY), pa.string())
    elif table.id_column is None:
        columns["given"] = pa.array(map(str, numbers), pa.string())
    else:
        given = pc.cast(batch.column(table.id_column), pa.string())
        missing = pc.fill_null(pc.equal(pc.utf8_length(given), 0), True)
        for at in _positions(missing):
            problems.setdefault(
                at,
                LineProblem(
                    table.id_column,
                    f"{unit} {numbers[at]}: no id in column {table.id_column!r}",
                ),
            )
        columns["given"] = pc.if_else(missing, pa.scalar(None, pa.string()), given)
    if problems:  # a refused row has no kind (CheckedBlock's contract)
        refused = pa.array([at in problems for at in range(len(numbers))])
        columns["kind"] = pc.if_else(refused, pa.scalar(None, pa.string()), columns["kind"])
    return CheckedBlock(
        numbers=numbers, columns={name: columns[name] for name in BLOCK_COLUMNS}, problems=problems
    )


def _templated(
    batch: pa.RecordBatch,
    template_text: str,
    numbers: list[int],
    problems: dict[int, LineProblem],
    unit: str,
) -> pa.Array:
    """Each row's prompt from the template; a row missing a field is refused, naming it."""
    template = PromptTemplate.parse(template_text)
    fields = {field: batch.column(field) for field in template.fields}
    for field, missing in template.missing(fields).items():
        for at in _positions(missing):
            problems.setdefault(
                at,
                LineProblem(
                    field, f"{unit} {numbers[at]}: no value for the template's {{{field}}}"
                ),
            )
    return template.render(fields)


def _prompt_columns(
    text: pa.Array,
    label: str,
    table: TableColumns,
    task: str,
    numbers: list[int],
    problems: dict[int, LineProblem],
    unit: str = "row",
) -> dict[str, pa.Array]:
    """Each row's prompt from its text (the prompt column's, or the template's), checked
    column-wise: null and blank texts (no character str.strip() keeps, as for a JSONL
    prompt) are refused."""
    what = "the prompt template gives" if label == "prompt_template" else f"column {label!r} is"
    rows = len(text)
    for at in _positions(pc.is_null(text)):
        problems.setdefault(at, LineProblem(label, f"{unit} {numbers[at]}: {what} null"))
    blank = pc.match_substring_regex(text, BLANK)
    for at in _positions(pc.fill_null(blank, False)):
        problems.setdefault(at, LineProblem(label, f"{unit} {numbers[at]}: {what} blank"))
    nothing = pa.nulls(rows, pa.string())
    kind: str
    if task in POOLING_TASKS:  # a row's text, embedded or classified as it is
        kind, prompt, messages = task, text, nothing
    elif table.system is None:
        kind, prompt, messages = "prompt", text, nothing
    else:  # json.dumps' text of [system, user], as a JSONL chat line stores it
        head = '[{"role": "system", "content": ' + json.dumps(table.system)
        head += '}, {"role": "user", "content": '
        kind, prompt = "chat", nothing
        messages = pc.binary_join_element_wise(head, json_strings(text), "}]", "")
    return {
        "kind": pa.array([kind] * rows, pa.string()),
        "prompt": prompt,
        "messages": messages,
        "sampling": nothing,
        "inputs": nothing,
    }


def _messages_columns(
    batch: pa.RecordBatch,
    table: TableColumns,
    adapters: frozenset[str],
    numbers: list[int],
    problems: dict[int, LineProblem],
    settings: Settings,
) -> dict[str, pa.Array]:
    """Each row's messages (a list of {role, content} structs, or their JSON text), validated
    as a JSONL chat line's messages are (parsing/line.py), a row at a time."""
    column = str(table.messages_column)
    kinds: list[str | None] = []
    texts: list[str | None] = []
    for at, value in enumerate(batch.column(column).to_pylist()):
        number = numbers[at]
        try:
            messages = _messages_of(value, column, number)
            request = parse_line({"messages": messages}, number, adapters, settings=settings)
        except LineProblem as problem:
            field = problem.field or ""
            problems[at] = LineProblem(
                column + field.removeprefix("messages"),
                problem.message
                if problem.message.startswith("row ")
                else f"row {number}: column {column!r}: {problem.message}",
                problem.code,
            )
            kinds.append(None)
            texts.append(None)
            continue
        if table.system is not None:
            system = {"role": "system", "content": table.system}
            request.messages = [system, *(request.messages or [])]
        kind, _, stored, _, _ = request_payload(request)
        kinds.append(kind)
        texts.append(stored)
    nothing = pa.nulls(len(numbers), pa.string())
    return {
        "kind": pa.array(kinds, pa.string()),
        "prompt": nothing,
        "messages": pa.array(texts, pa.string()),
        "sampling": nothing,
        "inputs": nothing,
    }


def _messages_of(value: Any, column: str, number: int) -> Any:
    """The row's messages as parse_line takes them; a problem's field is "messages", which
    the caller names by the column."""
    if value is None:
        raise LineProblem("messages", f"row {number}: column {column!r} is null")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise LineProblem(
                "messages", f"row {number}: column {column!r} is not a JSON list of messages: {exc}"
            ) from None
    return value


def _positions(mask: pa.Array) -> list[int]:
    """The positions where a boolean array is true."""
    return pc.indices_nonzero(mask).to_pylist()  # type: ignore[no-any-return]
