"""The physical lines of an input file, read with bounded memory.

A line longer than the limit is never held whole: it is skipped in chunks up to its newline and
reported by its size, so one runaway line (a whole document pasted in, a missing newline) costs
a bounded read instead of gigabytes of JSON and pydantic objects.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

# Notepad and Excel's "CSV UTF-8" write one at the start of the file; json.loads refuses it.
_BOM = b"\xef\xbb\xbf"
_SKIP_CHUNK = 1 << 20


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
    if handle.read(len(_BOM)) != _BOM:
        handle.seek(0)
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


def has_requests(path: str | Path, max_line_bytes: int) -> bool:
    """Whether the file has a non-blank line; reads only up to the first one."""
    with Path(path).open("rb") as handle:
        return next(iter_lines(handle, max_line_bytes), None) is not None
