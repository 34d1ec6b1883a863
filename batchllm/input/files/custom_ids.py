"""custom_ids: the duplicate check and the default ids of lines that give none.

A line without a custom_id gets `line-<N>`, N its line number. A file may give that very id to
another line, earlier or later (`{"custom_id": "line-35", ...}` on line 12), so defaults are
chosen in two phases: a first pass collects the given ids of the default shape, and a default
that one of them holds moves on to `line-<N>-2`, `line-<N>-3`, ... So a default never equals a
given id nor another default (N is the part before the second dash), and defaults depend only on
the file: a rerun of the same file yields the same ids.

Both id sets live in on-disk SQLite tables rather than in Python sets, so a 100M-line file
does not need 100M ids in RAM.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from batchllm.input.files.lines import Line

_DEFAULT_SHAPE = re.compile(r"line-[0-9]+(-[0-9]+)?")
_ASCII_ESCAPE = re.compile(rb"\\u00[2-7]")
_BATCH = 500


def default_custom_id(line: int) -> str:
    return f"line-{line}"


def given_id(obj: Any) -> str | None:
    """The custom_id a decoded line gives, if any: a non-empty string."""
    if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str) and obj["custom_id"]:
        return str(obj["custom_id"])
    return None


def may_give_default_id(raw: bytes) -> bool:
    r"""Whether these bytes (a line or a run of lines) may give a default-shaped id: only text
    holding `line-`, literally or with some of it as \u escapes of ASCII characters, can; the
    byte test spares decoding every other line a second time (escaped non-ASCII text,
    \u0080 and up, does not count)."""
    return b"line-" in raw or _ASCII_ESCAPE.search(raw) is not None


def _default_shaped_ids(lines: Iterable[Line]) -> Iterator[str]:
    for line in lines:
        if line.raw is None or not may_give_default_id(line.raw):
            continue
        try:
            found = given_id(json.loads(line.raw.decode("utf-8")))
        except (ValueError, RecursionError):
            continue
        if found is not None and _DEFAULT_SHAPE.fullmatch(found):
            yield found


class CustomIds:
    """The id tables of one file's validation: `given` (default-shaped ids the file gives) and
    `seen` (ids of the requests accepted so far, with their line)."""

    def __init__(self) -> None:
        fd, self._path = tempfile.mkstemp(prefix="batchllm-ids-", suffix=".sqlite")
        os.close(fd)
        self._db = sqlite3.connect(self._path)
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        # 64 MiB of pages in memory (the default is 2): a million random ids (UUIDs) went in in
        # 1.7 s instead of 3.0, the B-tree's pages no longer written out and read back.
        self._db.execute("PRAGMA cache_size=-65536")
        self._db.execute("CREATE TABLE given (custom_id TEXT PRIMARY KEY) WITHOUT ROWID")
        self._db.execute(
            "CREATE TABLE seen (custom_id TEXT PRIMARY KEY, line INTEGER) WITHOUT ROWID"
        )
        self._any_given = False
        self._first_pass: Callable[[], Iterable[Line]] | None = None

    def defer_first_pass(self, lines: Callable[[], Iterable[Line]]) -> None:
        """Run the first pass over `lines()` (the whole file) only when a default is first asked
        for: a file whose every line gives its custom_id, as every OpenAI batch file does, is
        then read once instead of twice (a 10M-line file's first pass took ~17 s here, and no
        shard could be stored before it ended)."""
        self._first_pass = lines

    def collect_given(self, lines: Iterable[Line]) -> None:
        """The first pass: remember every default-shaped id the file gives."""
        batch: list[tuple[str]] = []
        for found in _default_shaped_ids(lines):
            batch.append((found,))
            if len(batch) >= _BATCH:
                self._add_given(batch)
                batch = []
        self._add_given(batch)

    def _add_given(self, batch: list[tuple[str]]) -> None:
        if batch:
            self._db.executemany("INSERT OR IGNORE INTO given VALUES (?)", batch)
            self._any_given = True

    def defaults(self, lines: list[int]) -> dict[int, str]:
        """The default id of each of these line numbers."""
        if self._first_pass is not None:
            first_pass, self._first_pass = self._first_pass, None
            self.collect_given(first_pass())
        chosen = {line: default_custom_id(line) for line in lines}
        if not self._any_given:
            return chosen
        taken = {
            row[0]
            for row in self._rows(
                "SELECT custom_id FROM given WHERE custom_id IN ({})", list(chosen.values())
            )
        }
        for line, custom_id in chosen.items():
            if custom_id in taken:
                chosen[line] = self._free_default(line)
        return chosen

    def _free_default(self, line: int) -> str:
        suffix = 2
        while self._db.execute(
            "SELECT 1 FROM given WHERE custom_id = ?", (f"line-{line}-{suffix}",)
        ).fetchone():
            suffix += 1
        return f"line-{line}-{suffix}"

    def add_first(self, ids: list[str], lines: list[int]) -> list[tuple[str, int, int]]:
        """Accept each of these runnable lines' ids (line numbers in order) unless an earlier
        line holds it; returns the lines refused as duplicates: (id, line, the line it was
        first accepted on). The insert alone tells whether any is a duplicate (the common
        answer: none), so a chunk costs one statement per id."""
        before = self._db.total_changes
        self._db.executemany("INSERT OR IGNORE INTO seen VALUES (?, ?)", zip(ids, lines))
        if self._db.total_changes - before == len(ids):
            return []
        query = "SELECT custom_id, line FROM seen WHERE custom_id IN ({})"
        first = dict(self._rows(query, list(set(ids))))
        return [(i, line, first[i]) for i, line in zip(ids, lines, strict=True) if first[i] != line]

    def _rows(self, query: str, values: list[str]) -> Iterator[tuple[Any, ...]]:
        """Rows of `query`, whose `{}` takes the values' placeholders, a batch at a time
        (SQLite limits the number of parameters)."""
        for start in range(0, len(values), _BATCH):
            part = values[start : start + _BATCH]
            yield from self._db.execute(query.format(",".join("?" * len(part))), part)

    def close(self) -> None:
        self._db.close()
        Path(self._path).unlink(missing_ok=True)
