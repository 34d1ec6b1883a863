"""The physical lines of an input file, read with bounded memory.

A line longer than the limit is never held whole: it is skipped in chunks up to its newline and
reported by its size, so one runaway line (a whole document pasted in, a missing newline) costs
a bounded read instead of gigabytes of JSON and pydantic objects.

An input file is a local path or a URI (`s3://bucket/prompts.jsonl`); a URI is streamed through
pyarrow's filesystem a buffer at a time (ranged reads), never copied whole into memory or to disk.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, NamedTuple

from batchllm.jobs.storage import filesystem_for, is_uri

# Notepad and Excel's "CSV UTF-8" write one at the start of the file; json.loads refuses it.
_BOM = b"\xef\xbb\xbf"
_SKIP_CHUNK = 1 << 20
_STREAM_BUFFER = 4 << 20  # bytes per ranged read of an input URI


class Line(NamedTuple):
    """One non-blank physical line: its bytes without the newline, or only its size when it
    is over the limit (`raw` is None then)."""

    number: int
    raw: bytes | None
    size: int


def iter_lines(handle: BinaryIO, max_line_bytes: int) -> Iterator[Line]:
    """Yield the non-blank lines of a binary file opened at its start; numbers are 1-based.

    A line's size counts its bytes without the final newline. Blank means only ASCII
    whitespace, the same test as `bytes.strip()`, also for an over-long line.
    """
    peek = getattr(handle, "peek", None)
    if peek is None:
        if handle.read(len(_BOM)) != _BOM:
            handle.seek(0)
    elif peek(len(_BOM))[: len(_BOM)] == _BOM:  # a stream (a URI's) cannot seek back
        handle.read(len(_BOM))
    number = 0
    while True:
        raw = handle.readline(max_line_bytes + 1)
        if not raw:
            return
        number += 1
        if raw.endswith(b"\n") or len(raw) <= max_line_bytes:
            raw = raw.removesuffix(b"\n")
            if raw.strip():
                yield Line(number, raw, len(raw))
            continue
        size, blank = len(raw), raw.isspace()
        while True:
            piece = handle.readline(_SKIP_CHUNK)
            if not piece:
                break
            size += len(piece)
            blank = blank and piece.isspace()
            if piece.endswith(b"\n"):
                size -= 1
                break
        if not blank:
            yield Line(number, None, size)


@contextmanager
def open_input(source: str | Path) -> Iterator[BinaryIO]:
    """An input file opened for reading from its start: a local path, or a URI
    (`s3://bucket/key`) streamed with buffered ranged reads. Reading it twice (custom_ids.py)
    means opening it twice."""
    if not is_uri(source):
        with Path(source).open("rb") as handle:
            yield handle
        return
    fs, path = filesystem_for(str(source))
    # compression=None: bytes as they are stored, as for a local file (no .gz guessing).
    with (
        fs.open_input_stream(path, compression=None) as stream,
        io.BufferedReader(stream, _STREAM_BUFFER) as handle,
    ):
        yield handle


def has_requests(path: str | Path, max_line_bytes: int) -> bool:
    """Whether the file has a non-blank line; reads only up to the first one."""
    with open_input(path) as handle:
        return next(iter_lines(handle, max_line_bytes), None) is not None
