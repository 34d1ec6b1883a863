"""The physical lines of an input file, read with bounded memory.

A line longer than the limit is never held whole: it is skipped in chunks up to its newline and
reported by its size, so one runaway line (a whole document pasted in, a missing newline) costs
a bounded read instead of gigabytes of JSON and pydantic objects.

An input file is a local path or a URI (`s3://bucket/prompts.jsonl`); a URI is streamed through
pyarrow's filesystem a buffer at a time (ranged reads), never copied whole into memory or to disk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import BinaryIO, NamedTuple

from batchllm.input.files.source import InputSource

# Notepad and Excel's "CSV UTF-8" write one at the start of the file; json.loads refuses it.
_BOM = b"\xef\xbb\xbf"
_SKIP_CHUNK = 1 << 20
_CHUNK_BYTES = 4 << 20  # bytes split into lines at once


class Line(NamedTuple):
    """One non-blank physical line: its bytes without the newline, or only its size when it
    is over the limit (`raw` is None then)."""

    number: int
    raw: bytes | None
    size: int


# Line((n, raw, size)) without NamedTuple's Python-level __new__: a third of the cost of a line
# in iter_line_chunks' comprehension, which makes a million of them per 450 MB.
_new_line = functools.partial(tuple.__new__, Line)


def iter_lines(handle: BinaryIO, max_line_bytes: int) -> Iterator[Line]:
    """Yield the non-blank lines of a binary file opened at its start; numbers are 1-based.

    A line's size counts its bytes without the final newline. Blank means only ASCII
    whitespace, the same test as `bytes.strip()`, also for an over-long line.
    """
    _skip_bom(handle)
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


def iter_line_chunks(
    handle: BinaryIO,
    max_line_bytes: int,
    chunk_bytes: int = _CHUNK_BYTES,
    *,
    wanted: Callable[[bytes], object] | None = None,
) -> Iterator[list[Line]]:
    """iter_lines' lines, a list per `chunk_bytes` read: the same lines, numbers and sizes,
    split a chunk at a time instead of a readline per line (a fifth of the cost). A line
    longer than the limit is still never held whole: once the unfinished line passes it, the
    rest is counted and dropped up to its newline.

    `wanted`: a test of a run of whole lines; a run it fails is counted, not split (a caller
    looking for a few lines skips the rest at the cost of a byte search)."""
    _skip_bom(handle)
    number = 0
    carry = b""  # the unfinished line at the end of the last chunk
    long: tuple[int, bool] | None = None  # (size so far, blank so far) of an over-long line
    while True:
        data = handle.read(chunk_bytes)
        lines: list[Line] = []
        if long is not None:
            size, blank = long
            end = data.find(b"\n")
            piece = data if end < 0 else data[:end]
            size, blank = size + len(piece), blank and (not piece or piece.isspace())
            if end < 0 and data:
                long = (size, blank)
                continue
            number += 1
            if not blank:
                lines.append(Line(number, None, size))
            long, data = None, (data[end + 1 :] if end >= 0 else b"")
            if end < 0:  # the file ended inside the long line
                if lines:
                    yield lines
                return
        elif not data:
            if carry:
                number += 1
                number = _add_line(lines, carry, number, max_line_bytes)
            if lines:
                yield lines
            return
        else:
            data = carry + data
        cut = data.rfind(b"\n")
        whole = data[:cut] if cut >= 0 else None
        carry = data[cut + 1 :] if cut >= 0 else data
        if whole is not None and wanted is not None and not wanted(whole):
            number += whole.count(b"\n") + 1
        elif whole is not None:
            pieces = whole.split(b"\n")
            if max(map(len, pieces)) <= max_line_bytes:  # the common case, in one comprehension
                lines += [
                    _new_line((n, raw, len(raw)))
                    for n, raw in enumerate(pieces, number + 1)
                    if raw.strip()
                ]
                number += len(pieces)
            else:
                for raw in pieces:
                    number = _add_line(lines, raw, number + 1, max_line_bytes)
        if len(carry) > max_line_bytes:  # over the limit before its newline: count the rest
            long, carry = (len(carry), carry.isspace()), b""
        if lines:
            yield lines


def _add_line(lines: list[Line], raw: bytes, number: int, max_line_bytes: int) -> int:
    """Append line `number` unless blank; returns the number."""
    if len(raw) > max_line_bytes:
        if not raw.isspace():
            lines.append(Line(number, None, len(raw)))
    elif raw.strip():
        lines.append(Line(number, raw, len(raw)))
    return number


def _skip_bom(handle: BinaryIO) -> None:
    peek = getattr(handle, "peek", None)
    if peek is None:
        if handle.read(len(_BOM)) != _BOM:
            handle.seek(0)
    elif peek(len(_BOM))[: len(_BOM)] == _BOM:  # a stream (a URI's) cannot seek back
        handle.read(len(_BOM))


def has_requests(source: InputSource, max_line_bytes: int) -> bool:
    """Whether the file has a non-blank line; reads only up to the first one."""
    with source.open() as handle:
        return next(iter_lines(handle, max_line_bytes), None) is not None
