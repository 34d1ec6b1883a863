"""Streaming validation of JSONL input: a block of lines at a time, into the rows to store and a
`LineError` for each line that cannot run.

Memory stays flat in the file size: lines are read one at a time, bounded in size (files/lines.py),
and custom_ids are kept in an on-disk SQLite table rather than a Python set (files/custom_ids.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchllm.input.files.custom_ids import CustomIds, given_id, may_give_default_id
from batchllm.input.files.lines import Line, iter_line_chunks, iter_lines
from batchllm.input.files.source import InputSource
from batchllm.input.formats.rows import INPUT_SCHEMA, InputRow, request_payload
from batchllm.input.formats.schemas import LineError
from batchllm.input.formats.unicode_text import (
    UNENCODABLE,
    encodable,
    may_hold_surrogates,
    unencodable_field,
)
from batchllm.input.images import ImageChecks, image_urls
from batchllm.input.parsing.endpoints import task_of_line
from batchllm.input.parsing.line import decode_line, parse_line
from batchllm.input.parsing.problems import LineProblem, duplicate
from batchllm.input.validation import columnar
from batchllm.input.validation.columnar import Verdict
from batchllm.settings import Settings
from batchllm.spec import GENERATE, Task

log = logging.getLogger(__name__)

# INPUT_SCHEMA's columns after line and custom_id.
_STORED_AFTER_ID = ("kind", "prompt", "messages", "sampling", "error", "inputs")


# (line number, the custom_id the line gives, its Request (or stored payload) or the problem
# that stops it)
_Checked = tuple[int, str | None, Any]


def infer_task(source: InputSource, settings: Settings) -> Task:
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
                return task_of_line(obj)
    return GENERATE


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


def read_row_chunks(
    source: InputSource,
    *,
    settings: Settings,
    max_line_bytes: int | None = None,
    adapters: frozenset[str] = frozenset(),
    task: str = GENERATE,
) -> Iterator[tuple[pa.Table, list[LineError]]]:
    """The non-blank lines of `source` as rows to store, a chunk of the file at a time: a table
    of the lines' input-shard values (INPUT_SCHEMA, formats/rows.py) in line order, and the
    LineErrors of the chunk's lines that cannot run. The same rows as the line-by-line reader
    gives (tests/support/line_reader.py), validated a block at a time (columnar.py) and kept
    in columns to the stored shard."""
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
    errors: dict[int, InputRow] = {}  # position -> the row of the refused line
    problems: list[LineError] = []
    at_of_line = {number: at for at, number in enumerate(block.numbers)}
    refused = [(at, block.problems[at]) for at in sorted(block.problems)]
    refused += [
        (at_of_line[line], duplicate(custom_id, first)) for custom_id, line, first in duplicates
    ]
    for at, problem in sorted(refused, key=lambda item: item[0]):
        error = problem.error(name, block.numbers[at], custom_ids[at].as_py())
        problems.append(error)
        errors[at] = InputRow.from_item(error)
    invalid = np.zeros(len(block.numbers), dtype=bool)
    invalid[list(errors)] = True
    mask = pa.array(invalid)
    kept = {
        name: pc.if_else(mask, pa.scalar(None, pa.string()), columns[name])
        for name in ("prompt", "messages", "inputs")
    }
    refusals = [errors.get(at) for at in range(len(block.numbers))]
    refused_settings = pa.array([row and row.sampling for row in refusals], pa.string())
    kept["sampling"] = pc.if_else(mask, refused_settings, columns["sampling"])
    kept["kind"] = pc.if_else(mask, "invalid", columns["kind"])
    kept["error"] = pa.array([row and row.error for row in refusals], pa.string())
    return pa.table(
        [numbers, custom_ids, *(kept[n] for n in _STORED_AFTER_ID)], schema=INPUT_SCHEMA
    ), problems


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
