"""The line-by-line reader: one Request or LineError per non-blank line, each line validated on
its own (input/validation/validate.py's `_check`). It is the definition of validity that the
block validation a job's intake uses (`read_row_chunks`, input/validation/columnar.py) is
checked against, so it lives with the tests: batchllm itself reads a file a block at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from batchllm.input.files.custom_ids import CustomIds
from batchllm.input.files.lines import Line
from batchllm.input.files.source import InputSource
from batchllm.input.formats.schemas import LineError, Request
from batchllm.input.images import ImageChecks, image_urls
from batchllm.input.parsing.problems import LineProblem, duplicate
from batchllm.input.validation.validate import _check, _Checked, _line_chunks
from batchllm.settings import Settings
from batchllm.spec import GENERATE


def read_requests(
    source: InputSource,
    *,
    settings: Settings,
    max_line_bytes: int | None = None,
    adapters: frozenset[str] = frozenset(),
    task: str = GENERATE,
) -> Iterator[Request | LineError]:
    """Yield one Request or LineError per non-blank line of `source` (a local file or a URI
    such as s3://bucket/key, streamed), in line order, validating line by line.

    Blank lines are not requests and produce nothing. Line numbers are 1-based physical lines.
    A line over `max_line_bytes` (default: the settings') is an error without being parsed.
    The file is read twice (files/custom_ids.py), each time from its start.
    """
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
            problem = duplicate(custom_id, duplicates[number])
        else:
            resolved.append((number, custom_id, item))
            continue
        resolved.append((number, custom_id, problem.error(name, number, custom_id)))
    return resolved
