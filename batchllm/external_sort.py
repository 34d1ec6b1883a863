"""Sorting more Arrow rows than memory holds: an external merge sort, so a job's intake and its
readers stay within a bound whatever the file's size.

Rows are gathered a run at a time (`run_bytes` of Arrow data, an eighth of `memory_bytes` by
default) and each run is sorted on a thread beside the caller as soon as it is gathered: while
a job's lines are still being validated (Python, on one core), the other core sorts what came
before, so little is left to do once the last line is read. Runs are kept in memory while they
fit in `memory_bytes`; past it every run is spilled to a local temporary Parquet file, also
beside the caller. The sorted runs are then merged a batch at a time, so the first rows are
handed on before the last are merged. Peak memory is about `memory_bytes` and a run or two
being sorted or written (or, merging spilled runs, a batch of each).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm.errors import StorageError

log = logging.getLogger(__name__)


class SortSpillError(StorageError):
    """A sorted run could not be written to the temporary directory (full, not writable)."""


# Rows read from each run at a time while merging, and rows handed on at a time.
BATCH_ROWS = 16_384

_RUNS_IN_MEMORY = 8  # runs a memory bound holds by default: each sorted beside the caller
_SPILLS_QUEUED = 2  # runs waiting to be spilled at most: the caller waits rather than hold more

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
        run_bytes: int | None = None,
        spill_dir: str | None = None,
        with_keys: Callable[[pa.Table], pa.Table] | None = None,
    ) -> None:
        """`with_keys(rows)`: the rows with key columns of their own added, where the keys are
        not columns of the rows; made where the rows are compared, never stored or handed on
        (a key that is a column's nulls filled costs nothing kept as it is). `run_bytes`: the
        Arrow data of a sorted run (default: an eighth of `memory_bytes`)."""
        if any(order != "ascending" for _, order in keys):
            raise ValueError(f"ascending keys only: {keys}")
        self.keys, self.memory_bytes = keys, memory_bytes
        self.run_bytes = run_bytes or max(1, memory_bytes // _RUNS_IN_MEMORY)
        self._with_keys = with_keys or (lambda rows: rows)
        self._spill_parent = spill_dir
        self._spill: Path | None = None
        self._gathered: list[pa.Table] = []
        self._gathered_bytes = 0
        self._held: list[Future[pa.Table]] = []  # sorted runs kept in memory
        self._held_bytes = 0
        self._spills: list[Future[None]] = []  # runs being written, oldest first
        self._beside: ThreadPoolExecutor | None = None  # one thread: runs sorted in turn
        self.runs: list[Path] = []  # spilled runs, in the order they were gathered
        self.rows = 0

    def add(self, rows: pa.Table) -> None:
        if not rows.num_rows:
            return
        self._gathered.append(rows)
        self._gathered_bytes += rows.nbytes
        self.rows += rows.num_rows
        if self._gathered_bytes >= self.run_bytes:
            self._close_run()

    def sorted_tables(self) -> Iterator[pa.Table]:
        """Every row added, exactly once, in order, a table at a time."""
        if self._gathered and not self._held and not self.runs:
            # One run in all (a small file, such as an API create's): nothing is left to
            # overlap with, so it is sorted here and no thread is started for it.
            table = pa.concat_tables(self._gathered)
            self._gathered, self._gathered_bytes = [], 0
            yield from _in_slices(self._sorted(table))
            return
        if self._gathered:
            self._close_run()
        if self.runs:
            self._wait_for_spills(queued=0)
            log.info("sorting %d rows: merging %d sorted runs", self.rows, len(self.runs))
            yield from self._merge(
                [pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS) for path in self.runs]
            )
            return
        held = [run.result() for run in self._held]
        self._held, self._held_bytes = [], 0
        if len(held) == 1:  # sorted already: handed on as it is
            yield from _in_slices(held[0])
        elif held:
            yield from self._merge([iter(run.to_batches(max_chunksize=BATCH_ROWS)) for run in held])

    def close(self) -> None:
        self._gathered, self._gathered_bytes = [], 0
        if self._beside is not None:
            self._beside.shutdown(wait=True, cancel_futures=True)
            self._beside = None
        self._held, self._held_bytes = [], 0
        if self._spill is not None:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None

    def __enter__(self) -> ExternalSort:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _close_run(self) -> None:
        """Sort the gathered rows as a run beside the caller: kept in memory while the runs fit
        in `memory_bytes`, else (and from then on, with those held so far) spilled."""
        table = pa.concat_tables(self._gathered)
        nbytes, self._gathered, self._gathered_bytes = self._gathered_bytes, [], 0
        beside = self._thread()
        if not self.runs and self._held_bytes + nbytes <= self.memory_bytes:
            self._held.append(beside.submit(self._sorted, table))
            self._held_bytes += nbytes
            return
        if not self.runs:
            # The directory made here, at once: an unwritable TMPDIR is refused by the add
            # that first needs it, not found out by the merge.
            self._spill_directory(table.num_rows)
        held, self._held, self._held_bytes = self._held, [], 0
        for run in held:  # sorted before this task runs: the thread takes tasks in turn
            self._spills.append(beside.submit(self._write_run, run.result, self._next_path()))
        path = self._next_path()
        self._spills.append(beside.submit(self._write_run, lambda: self._sorted(table), path))
        self._wait_for_spills(queued=_SPILLS_QUEUED)

    def _thread(self) -> ThreadPoolExecutor:
        if self._beside is None:
            self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchllm-sort")
        return self._beside

    def _sorted(self, table: pa.Table) -> pa.Table:
        """The rows in order, each column one chunk: a take from a column of many chunks (one
        per table added) cost 15x the take from one, a million chat lines here."""
        table = table.combine_chunks()
        return table.take(pc.sort_indices(self._with_keys(table), self.keys))

    def _spill_directory(self, rows: int) -> Path:
        if self._spill is None:
            try:
                self._spill = Path(
                    tempfile.mkdtemp(prefix="batchllm-sort-", dir=self._spill_parent)
                )
            except OSError as exc:
                raise self._spill_error(rows, exc) from exc
        return self._spill

    def _next_path(self) -> Path:
        path = self._spill_directory(0) / f"run-{len(self.runs):05d}.parquet"
        self.runs.append(path)
        return path

    def _write_run(self, sorted_run: Callable[[], pa.Table], path: Path) -> None:
        run = sorted_run()
        try:
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
            raise self._spill_error(run.num_rows, exc) from exc
        log.debug("spilled sorted run %s (%d rows)", path.name, run.num_rows)

    def _spill_error(self, rows: int, exc: OSError) -> SortSpillError:
        where = self._spill or self._spill_parent or tempfile.gettempdir()
        return SortSpillError(f"cannot spill {rows:,} sorted rows to {where} (TMPDIR): {exc}")

    def _wait_for_spills(self, queued: int) -> None:
        """Wait until at most `queued` runs are still being written; a write that failed
        raises here."""
        while len(self._spills) > queued or (self._spills and self._spills[0].done()):
            self._spills.pop(0).result()

    def _merge(self, readers: list[Iterator[pa.RecordBatch]]) -> Iterator[pa.Table]:
        """Each round takes from every run the rows up to the smallest of the runs' last loaded
        rows (the frontier, compared on the whole key: rows equal on the first key must still
        come in the order of the next), which all come before anything still unread, sorts them
        and hands them on. The run the frontier came from is used up in the round, so every
        round makes progress."""
        columns = [name for name, _ in self.keys]
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


def _in_slices(table: pa.Table) -> Iterator[pa.Table]:
    """A sorted table handed on a slice of BATCH_ROWS at a time (no copy)."""
    for batch in table.to_batches(max_chunksize=BATCH_ROWS):
        yield pa.Table.from_batches([batch])


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
