"""Validated input, stored as Parquet shards in the job's storage.

Every non-blank input line becomes one stored row, including the lines that failed validation
(kind `invalid`, with the reason): the runner turns those into error rows, so the output
accounts for every line whatever happened to it.
"""

from __future__ import annotations

import io
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm.errors import InputError, StorageError
from batchllm.external_sort import ExternalSort
from batchllm.heap import frozen_heap
from batchllm.input.files.source import InputSource
from batchllm.input.formats.rows import INPUT_SCHEMA, STORED_FIELDS, InputRow, stored_row
from batchllm.input.formats.schemas import LineError
from batchllm.input.token_store import iter_token_batches, token_lists
from batchllm.input.validation.table import read_table_chunks
from batchllm.input.validation.validate import read_row_chunks
from batchllm.settings import Settings
from batchllm.spec import TableColumns
from batchllm.storage import Storage

log = logging.getLogger(__name__)

_ROW_GROUP = 8192
_REPEATING = ["kind", "sampling", "error"]
_WITH_STATISTICS = ["line", "custom_id", "kind"]
_PREVIEW = 20


@dataclass
class ShardInput:
    index: int
    path: str
    rows: int
    first_line: int  # the smallest and largest of its lines: a placed shard's lines are not
    last_line: int  # a range (input/shards.py)


@dataclass
class StoredInput:
    shards: list[ShardInput] = field(default_factory=list)
    total: int = 0
    invalid: int = 0
    problems: list[LineError] = field(default_factory=list)  # the first few, for messages


class _ShardWriter:
    """Rows in, Parquet shards of `shard_size` rows out, each encoded and stored on a thread
    beside the caller (zstd and the write release the GIL): in file order a shard is written
    while the next lines are validated, placed the shards are written two at a time. Shards
    are announced (`on_shard`) in their order, as each is stored."""

    _IN_FLIGHT = 4  # shards encoded at once at most: memory stays a few shards' rows

    def __init__(
        self,
        storage: Storage,
        job_id: str,
        shard_size: int,
        on_shard: Callable[[ShardInput], None] | None = None,
    ) -> None:
        self.storage, self.shard_size, self.on_shard = storage, shard_size, on_shard
        self.job_id = job_id
        self.dir = storage.input_dir(job_id)
        try:
            storage.makedirs(self.dir)
        except OSError as exc:
            raise _not_writable(storage, exc) from exc
        self.shards: list[ShardInput] = []
        self._tables: list[pa.Table] = []  # rows of the shard being gathered
        self._current: ShardInput | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="batchllm-shards")
        self._pending: deque[tuple[ShardInput, Future[None]]] = deque()

    def add(self, rows: pa.Table) -> None:
        """Rows in INPUT_SCHEMA, in line order or in placement order."""
        while rows.num_rows:
            if self._current is None:
                index = len(self.shards) + len(self._pending)
                path = self.storage.input_shard(self.job_id, index)
                first = rows.column(0)[0].as_py()
                self._current = ShardInput(index, path, 0, first, first)
            room = self.shard_size - self._current.rows
            taken, rows = rows.slice(0, room), rows.slice(room)
            self._tables.append(taken)
            self._current.rows += taken.num_rows
            # The range its lines fall in: in file order its first and last; placed, they
            # come in prompt order.
            bounds = pc.min_max(taken.column(0))
            self._current.first_line = min(self._current.first_line, bounds["min"].as_py())
            self._current.last_line = max(self._current.last_line, bounds["max"].as_py())
            if self._current.rows >= self.shard_size:
                self.close_shard()

    def close_shard(self) -> None:
        """Send the shard being gathered to be written, and announce those written since."""
        if self._current is not None:
            tables, self._tables = self._tables, []
            shard, self._current = self._current, None
            self._pending.append((shard, self._pool.submit(self._write, shard, tables)))
        self._announce(wait_for=len(self._pending) - self._IN_FLIGHT)

    def finish(self) -> None:
        """Write what is gathered and wait for every shard to be stored."""
        self.close_shard()
        self._announce(wait_for=len(self._pending))
        self._pool.shutdown()

    def _announce(self, wait_for: int) -> None:
        """Announce the written shards at the head of the queue: the first `wait_for` waited
        for, those after them only if already done. A shard that failed raises here."""
        while self._pending and (wait_for > 0 or self._pending[0][1].done()):
            shard, written = self._pending.popleft()
            wait_for -= 1
            written.result()
            self.shards.append(shard)
            if self.on_shard is not None:
                self.on_shard(shard)

    def _write(self, shard: ShardInput, tables: list[pa.Table]) -> None:
        sink = io.BytesIO()
        with pq.ParquetWriter(
            sink,
            INPUT_SCHEMA,
            compression="zstd",
            # Dictionaries only where values repeat (trying them on the texts and ids costs
            # time and falls back to plain anyway); min/max statistics only of short columns:
            # those of the texts cost half the write and serve no one.
            use_dictionary=_REPEATING,
            write_statistics=_WITH_STATISTICS,
        ) as writer:
            writer.write_table(pa.concat_tables(tables), row_group_size=_ROW_GROUP)
        try:
            self.storage.write_bytes(shard.path, sink.getvalue())
        except OSError as exc:
            raise _not_writable(self.storage, exc) from exc

    def discard(self) -> None:
        """Delete the shards stored so far, and those being written once they are; best
        effort (the storage may be what failed)."""
        self._pool.shutdown(wait=True)
        paths = [shard.path for shard in self.shards] + [s.path for s, _ in self._pending]
        self._pending.clear()
        for path in paths:
            try:
                if self.storage.exists(path):
                    self.storage.delete(path)
            except OSError as exc:
                log.warning("could not delete %s: %s", path, exc)


def _not_writable(storage: Storage, exc: OSError) -> StorageError:
    return StorageError(f"job storage {storage.display(storage.root)}: cannot write: {exc}")


# Job-wide prefix placement (issue 62). Each shard runs its own rows in prompt order
# (execution/shard_state.py), but a shuffled file spread each document's lines over every
# shard, and each shard (on each worker) paid their prefill again: 34% of prompt tokens from the
# prefix cache in 10 shards against 61% in one. Written in prompt order job-wide, the lines
# sharing a prefix (a system prompt, a document, a few-shot block) fill as few shards as their
# number allows, wherever in the file they were; a group larger than a shard is split only at
# shard edges, and a small one straddles at most one edge, where the next shard (run next on
# the same worker: worker/fair_share.py) meets it still cached.
#
# An external merge sort (batchllm/external_sort.py) keeps memory bounded: rather than buckets
# by a hash of the key, which keep a group together but scatter the groups that share a
# shorter prefix (one system prompt over many documents), and rather than ranges, which need
# the keys' distribution before the first row is placed. The order is the shard runner's: by
# kind, then by prompt text (a chat row's messages JSON), then by line. The sort reads the
# text columns themselves (a copy of every prompt as a key cost a third of intake's time and
# memory), with nulls as empty strings, which the merge compares (a chat row has no prompt).
_PLACED_MESSAGES, _PLACED_PROMPT = "_placed_messages", "_placed_prompt"
PLACEMENT_ORDER = [
    ("kind", "ascending"),
    (_PLACED_MESSAGES, "ascending"),
    (_PLACED_PROMPT, "ascending"),
    ("line", "ascending"),
]


def with_placement_keys(rows: pa.Table) -> pa.Table:
    """The rows with their text columns as sort keys: the same arrays where no value is null
    (no copy), else with empty strings for the nulls."""
    for name, column in ((_PLACED_MESSAGES, "messages"), (_PLACED_PROMPT, "prompt")):
        values = rows.column(column)
        rows = rows.append_column(name, pc.fill_null(values, "") if values.null_count else values)
    return rows


def validated_chunks(
    source: InputSource,
    *,
    settings: Settings,
    table: TableColumns | None = None,
    adapters: frozenset[str] = frozenset(),
    task: str = "generate",
) -> Iterator[tuple[pa.Table, list[LineError]]]:
    """The input's rows as stored (INPUT_SCHEMA) with the errors of those that cannot run, a
    chunk at a time: a JSONL file's lines, or with `table` a Parquet or CSV file's rows; read
    and checked as `settings` say (limits, where images may be read from)."""
    if table is not None:
        return read_table_chunks(source, table, settings=settings, adapters=adapters, task=task)
    return read_row_chunks(source, settings=settings, adapters=adapters, task=task)


def store_input(
    source: InputSource,
    storage: Storage,
    job_id: str,
    *,
    settings: Settings,
    shard_size: int,
    strict: bool = False,
    adapters: frozenset[str] = frozenset(),
    task: str = "generate",
    table: TableColumns | None = None,
    on_shard: Callable[[ShardInput], None] | None = None,
    place: bool = False,
) -> StoredInput:
    """Validate `source` (a local file or a URI, streamed) line by line, or with `table` a
    Parquet or CSV file row by row, and store it as Parquet shards of `shard_size` rows.

    With `strict`, any invalid line refuses the whole file (nothing stays stored) and the
    InputError lists the problems. Raises InputError when the file cannot be read or holds
    no request at all, StorageError when the shards cannot be written. `on_shard` is called
    with each shard once it is stored (a `run` sizes it meanwhile, `submit` queues it).
    `settings`: how the input is read and checked (validated_chunks). `place`: the rows are
    written in placement order (below), so no shard is stored before the whole file is read;
    otherwise in file order, each shard stored as soon as it is full.
    """
    result = StoredInput()
    writer = _ShardWriter(storage, job_id, shard_size, on_shard)
    placement = (
        ExternalSort(
            PLACEMENT_ORDER,
            memory_bytes=settings.placement_memory_mb * 1024 * 1024,
            with_keys=with_placement_keys,
        )
        if place
        else None
    )
    try:
        with frozen_heap():  # a million rows pass through: keep the heap out of the GC's scans
            chunks = validated_chunks(
                source, settings=settings, table=table, adapters=adapters, task=task
            )
            for rows, problems in chunks:
                result.total += len(rows)
                result.invalid += len(problems)
                result.problems += problems[: _PREVIEW - len(result.problems)]
                if placement is None:
                    writer.add(rows)
                else:
                    placement.add(rows)
            if placement is not None and not (strict and result.invalid):
                for rows in placement.sorted_tables():
                    writer.add(rows)
            writer.finish()
    except OSError as exc:  # reading: the writer's errors are StorageErrors
        writer.discard()
        raise InputError(f"{source}: cannot read: {exc}") from exc
    except StorageError:
        writer.discard()
        raise
    finally:
        if placement is not None:
            placement.close()
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


def iter_shard_rows(
    storage: Storage, path: str, batch_rows: int = 4096, *, with_token_ids: bool = False
) -> Iterator[InputRow]:
    """Stream one stored shard's rows, a row group at a time; `with_token_ids`: with the ids
    the job's sizing pass stored for them, where it did (input/token_store.py)."""

    def batches() -> Iterator[Iterator[InputRow]]:
        tokens = iter_token_batches(storage, path, batch_rows) if with_token_ids else None
        with storage.fs.open_input_file(path) as src:
            parquet = pq.ParquetFile(src)
            # A shard stored by an older release may lack a later column (it reads as null).
            names = [name for name in STORED_FIELDS if name in parquet.schema_arrow.names]
            for batch in parquet.iter_batches(batch_size=batch_rows, columns=names):
                stored = dict(zip(names, batch.columns, strict=True))
                ids = _token_ids_for(tokens, stored["line"]) if tokens is not None else None
                if ids is None:
                    tokens = None  # missing or out of step: the feed tokenizes these rows itself
                columns = [
                    stored[name].to_pylist() if name in stored else repeat(None)
                    for name in STORED_FIELDS
                ]
                yield map(stored_row, *columns, ids if ids is not None else repeat(None))

    # Rows are made from whole columns and handed on in C (map, chain): no tuple or dict per
    # row, and no generator resumed per row.
    return chain.from_iterable(batches())


def _token_ids_for(tokens: Iterator[Any], lines: pa.Array) -> list[Any] | None:
    """The next token batch's ids when it holds exactly these lines, else None."""
    batch = next(tokens, None)
    if batch is None or not batch.column(0).equals(lines):
        log.warning("stored token ids do not match their shard's rows; tokenizing instead")
        return None
    return token_lists(batch.column(1))
