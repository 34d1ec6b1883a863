"""Sorting more Arrow rows than memory holds: an external merge sort, so a job's intake and its
readers stay within a bound whatever the file's size.

Rows are gathered up to `memory_bytes` of Arrow data and sorted there (a run); when more
follow, each run is spilled to a local temporary Parquet file and the runs are merged a batch
at a time. Input that fits in memory is sorted there, with no file written. Peak memory is
about twice `memory_bytes` (a run and its sorted copy) or, merging, a batch of every run.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm.errors import StorageError

log = logging.getLogger(__name__)


class SortSpillError(StorageError):
    """A sorted run could not be written to the temporary directory (full, not writable)."""


# Rows read from each spilled run at a time while merging, and rows handed on at a time.
BATCH_ROWS = 16_384

_TAKE_ROWS = 65_536  # rows gathered at a time from a run sorted in memory

SortKeys = list[tuple[str, str]]  # (column, "ascending") as pyarrow's sort_indices takes them


class ExternalSort:
    """Tables in, the same rows out sorted by `keys`; `close()` removes what was spilled.

    Keys are ascending and never null, and their values must order alike in Python and in
    Arrow: numbers, or strings (whose UTF-8 bytes order as their code points)."""

    def __init__(
        self,
        keys: SortKeys,
        *,
        memory_bytes: int,
        spill_dir: str | None = None,
        with_keys: Callable[[pa.Table], pa.Table] | None = None,
    ) -> None:
        """`with_keys(rows)`: the rows with key columns of their own added, where the keys are
        not columns of the rows; made where the rows are compared, never stored or handed on
        (a key that is a column's nulls filled costs nothing kept as it is)."""
        if any(order != "ascending" for _, order in keys):
            raise ValueError(f"ascending keys only: {keys}")
        self.keys, self.memory_bytes = keys, memory_bytes
        self._with_keys = with_keys or (lambda rows: rows)
        self._spill_parent = spill_dir
        self._spill: Path | None = None
        self._gathered: list[pa.Table] = []
        self._gathered_bytes = 0
        self.runs: list[Path] = []
        self.rows = 0

    def add(self, rows: pa.Table) -> None:
        if not rows.num_rows:
            return
        self._gathered.append(rows)
        self._gathered_bytes += rows.nbytes
        self.rows += rows.num_rows
        if self._gathered_bytes >= self.memory_bytes:
            self._spill_run()

    def sorted_tables(self) -> Iterator[pa.Table]:
        """Every row added, exactly once, in order, a table at a time."""
        if not self.runs:  # it all fit in memory
            if self._gathered:
                table = pa.concat_tables(self._gathered)
                self._gathered, self._gathered_bytes = [], 0
                with ThreadPoolExecutor(max_workers=1) as beside:
                    combined = beside.submit(_combined, table)
                    order = pc.sort_indices(self._with_keys(table), self.keys)
                    table = combined.result()
                yield from _taken_in_slices(table, order)
            return
        if self._gathered:
            self._spill_run()
        log.info("sorting %d rows: merging %d sorted runs", self.rows, len(self.runs))
        yield from self._merge()

    def close(self) -> None:
        self._gathered, self._gathered_bytes = [], 0
        if self._spill is not None:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None

    def __enter__(self) -> ExternalSort:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _sorted_run(self) -> pa.Table | None:
        if not self._gathered:
            return None
        table = pa.concat_tables(self._gathered)
        self._gathered, self._gathered_bytes = [], 0
        return _take(table, pc.sort_indices(self._with_keys(table), self.keys))

    def _spill_run(self) -> None:
        run = self._sorted_run()
        if run is None:
            return
        try:
            if self._spill is None:
                self._spill = Path(
                    tempfile.mkdtemp(prefix="batchllm-sort-", dir=self._spill_parent)
                )
            path = self._spill / f"run-{len(self.runs):05d}.parquet"
            # Read once, soon, on this machine: fast compression, no statistics or dictionaries.
            pq.write_table(
                run,
                path,
                compression="lz4",
                use_dictionary=False,
                write_statistics=False,
                row_group_size=BATCH_ROWS,
            )
        except OSError as exc:  # not the input's fault: say where the space ran out
            raise SortSpillError(
                f"cannot spill {run.num_rows:,} sorted rows to {self._spill or tempfile.gettempdir()}"
                f" (TMPDIR): {exc}"
            ) from exc
        self.runs.append(path)
        log.debug("spilled sorted run %d (%d rows)", len(self.runs), run.num_rows)

    def _merge(self) -> Iterator[pa.Table]:
        """Each round takes from every run the rows up to the smallest of the runs' last loaded
        rows (the frontier, compared on the whole key: rows equal on the first key must still
        come in the order of the next), which all come before anything still unread, sorts them
        and hands them on. The run the frontier came from is used up in the round, so every
        round makes progress."""
        columns = [name for name, _ in self.keys]
        readers = [pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS) for path in self.runs]
        current = [_next_table(reader) for reader in readers]
        while True:
            if all(table is None for table in current):
                return
            keyed = [None if table is None else self._with_keys(table) for table in current]
            frontier = min(
                tuple(table.column(name)[-1].as_py() for name in columns)
                for table in keyed
                if table is not None
            )
            taken: list[pa.Table] = []
            for i, table in enumerate(current):
                if table is None:
                    continue
                # The run is sorted: its rows up to the frontier are a prefix of its batch.
                upto = pc.sum(_up_to(keyed[i], columns, frontier)).as_py() or 0
                taken.append(table.slice(0, upto))
                rest = table.slice(upto)
                current[i] = rest if rest.num_rows else _next_table(readers[i])
            merged = pa.concat_tables(taken)
            yield _take(merged, pc.sort_indices(self._with_keys(merged), self.keys))


def _take(table: pa.Table, order: pa.Array) -> pa.Table:
    """The rows of `table` in `order`, each column gathered on a thread of its own (Arrow
    releases the GIL: two cores gather in 0.4 s what one does in 0.55 s, a million chat lines
    here). Each column is made one chunk first: a take from many chunks (one per table added)
    ran as slow as the combine and the take together."""
    if table.num_columns < 2 or len(order) < BATCH_ROWS:
        return table.combine_chunks().take(order)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        columns = list(pool.map(lambda column: column.combine_chunks().take(order), table.columns))
    return pa.Table.from_arrays(columns, schema=table.schema)


def _combined(table: pa.Table) -> pa.Table:
    """The table with each column one chunk: a take from a column of many chunks (one per
    table added) cost 15x the take from one, a million chat lines here."""
    return table.combine_chunks()


def _taken_in_slices(table: pa.Table, order: pa.Array) -> Iterator[pa.Table]:
    """The rows of `table` in `order`, a slice of the order at a time, the next slice gathered
    on a thread while the caller handles this one (Arrow releases the GIL). Gathered whole,
    a million chat lines took 0.6 s, most of it faulting in a fresh copy of every column;
    a slice at a time, 0.15 s, reusing the memory of the slices before it, and the intake's
    peak memory is one copy of the rows rather than two."""
    slices = range(0, len(order), _TAKE_ROWS)
    with ThreadPoolExecutor(max_workers=1) as ahead:
        pending = None
        for offset in slices:
            upcoming = ahead.submit(table.take, order.slice(offset, _TAKE_ROWS))
            if pending is not None:
                yield pending.result()
            pending = upcoming
        if pending is not None:
            yield pending.result()


def _up_to(table: pa.Table, columns: list[str], frontier: tuple) -> pa.ChunkedArray:
    """Each row's key <= `frontier`, compared as tuples are: less on a column, or equal on it
    and so on to the last, where equal counts too."""
    last = len(columns) - 1
    result = pc.less_equal(table.column(columns[last]), frontier[last])
    for at in range(last - 1, -1, -1):
        column, value = table.column(columns[at]), frontier[at]
        result = pc.or_(pc.less(column, value), pc.and_(pc.equal(column, value), result))
    return result


def _next_table(reader: Iterator[pa.RecordBatch]) -> pa.Table | None:
    batch = next(reader, None)
    return None if batch is None else pa.Table.from_batches([batch])
