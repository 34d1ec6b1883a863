"""Validated input, stored as Parquet shards in the job's storage.

Every non-blank input line becomes one stored row, including the lines that failed validation
(kind `invalid`, with the reason): the runner turns those into error rows, so the output
accounts for every line whatever happened to it.
"""

from __future__ import annotations

import io
import logging
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.errors import InputError
from batchllm.jobs.reader import read_requests
from batchllm.jobs.rows import INPUT_SCHEMA, InputRow
from batchllm.jobs.schemas import LineError
from batchllm.jobs.storage import Storage

log = logging.getLogger(__name__)

_ROW_GROUP = 8192
_PREVIEW = 20


@dataclass
class ShardInput:
    index: int
    path: str
    rows: int
    first_line: int
    last_line: int


@dataclass
class StoredInput:
    shards: list[ShardInput] = field(default_factory=list)
    total: int = 0
    invalid: int = 0
    problems: list[LineError] = field(default_factory=list)  # the first few, for messages


class _ShardWriter:
    def __init__(self, storage: Storage, job_id: str, shard_size: int) -> None:
        self.storage, self.shard_size = storage, shard_size
        self.dir = storage.input_dir(job_id)
        storage.makedirs(self.dir)
        self.shards: list[ShardInput] = []
        self._rows: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None
        self._sink: io.BytesIO | None = None
        self._current: ShardInput | None = None

    def add(self, row: InputRow) -> None:
        if self._current is None:
            index = len(self.shards)
            path = posixpath.join(self.dir, f"shard-{index:05d}.parquet")
            self._current = ShardInput(index, path, 0, row.line, row.line)
            self._sink = io.BytesIO()
            self._writer = pq.ParquetWriter(self._sink, INPUT_SCHEMA, compression="zstd")
        self._rows.append(row.to_record())
        self._current.rows += 1
        self._current.last_line = row.line
        if len(self._rows) >= _ROW_GROUP:
            self._flush_rows()
        if self._current.rows >= self.shard_size:
            self.close_shard()

    def _flush_rows(self) -> None:
        if self._rows and self._writer is not None:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=INPUT_SCHEMA))
        self._rows = []

    def close_shard(self) -> None:
        if self._current is None:
            return
        self._flush_rows()
        assert self._writer is not None and self._sink is not None  # set with _current
        self._writer.close()
        self.storage.write_bytes(self._current.path, self._sink.getvalue())
        self.shards.append(self._current)
        self._current, self._writer, self._sink = None, None, None

    def discard(self) -> None:
        for shard in self.shards:
            self.storage.delete(shard.path)


def readable_input(source: str | Path) -> Path:
    """The input file as a Path; InputError, naming it, when it is missing or a directory.
    Checked before anything is created for a job (no job row, no engine start)."""
    source = Path(source)
    if source.is_dir():
        raise InputError(f"{source}: is a directory, not a JSONL file")
    if not source.is_file():
        raise InputError(f"{source}: no such file")
    return source


def store_input(
    source: str | Path,
    storage: Storage,
    job_id: str,
    *,
    shard_size: int,
    strict: bool = False,
    adapters: frozenset[str] = frozenset(),
    task: str = "generate",
) -> StoredInput:
    """Validate `source` line by line and store it as Parquet shards of `shard_size` rows.

    With `strict`, any invalid line refuses the whole file (nothing stays stored) and the
    InputError lists the problems. Raises InputError when the file cannot be read or holds
    no request at all.
    """
    source = readable_input(source)
    result = StoredInput()
    writer = _ShardWriter(storage, job_id, shard_size)
    try:
        for item in read_requests(source, adapters=adapters, task=task):
            result.total += 1
            if isinstance(item, LineError):
                result.invalid += 1
                if len(result.problems) < _PREVIEW:
                    result.problems.append(item)
            writer.add(InputRow.from_item(item))
        writer.close_shard()
    except OSError as exc:
        writer.discard()
        raise InputError(f"{source}: cannot read: {exc}") from exc
    result.shards = writer.shards
    if result.total == 0:
        raise InputError(f"{source}: no requests (the file is empty or has only blank lines)")
    if strict and result.invalid:
        writer.discard()
        listing = "\n".join(f"  {p}" for p in result.problems)
        more = result.invalid - len(result.problems)
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise InputError(
            f"{source}: {result.invalid} of {result.total} lines are invalid; "
            f"--strict refuses the file:\n{listing}{tail}"
        )
    return result


def iter_shard_rows(storage: Storage, path: str, batch_rows: int = 4096) -> Iterator[InputRow]:
    """Stream one stored shard's rows, a row group at a time."""
    with storage.fs.open_input_file(path) as src:
        for batch in pq.ParquetFile(src).iter_batches(batch_size=batch_rows):
            for record in batch.to_pylist():
                yield InputRow.from_record(record)
