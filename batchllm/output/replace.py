"""A retry's rows replacing the rows of an earlier run of the same job (`batchllm retry`),
keeping exactly one row per input line through any crash.

Part files are immutable and a part counts once its checkpoint records it (output/commit.py),
so a row is retired by retiring its file: the retry writes its new rows as a part file, and
each earlier part holding a replaced line is written again without that line; then ONE
transaction records the new files' checkpoints, deletes the old files' checkpoints and moves the
counts (the new rows added, the replaced rows taken off). Only after that are the old files
deleted. A crash before the transaction leaves the new files unrecorded: they are deleted (at
the shard's resume, the job's end) and the old rows stand. A crash after it leaves the old files
unrecorded: deleted the same way, and the new rows stand. Never both, never none.

Rewriting an earlier part costs a read and a write of it per commit that replaces one of its
lines: retries are meant for the few rows a run lost, not for rerunning a job.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from sqlalchemy import select
from sqlalchemy.orm import Session

from batchllm.output import commit
from batchllm.output.parts import OUTPUT_SCHEMA, Part, Values, part_name, part_of, write_table
from batchllm.row_errors import retryable
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import Checkpoint

log = logging.getLogger(__name__)


def rows_to_replace(
    storage: Storage,
    checkpoints: Iterable[Checkpoint],
    *,
    before_attempt: int,
    all_errors: bool,
    input_path: str,
) -> dict[int, str]:
    """The lines whose recorded row a retry runs again, each with the path of the part that
    holds the row: error rows of runs before `before_attempt`, of a retryable kind
    (row_errors.py) or, with `all_errors`, of any kind."""
    chosen: dict[int, str] = {}
    unclassified: dict[int, tuple[str, str | None]] = {}  # rows written before error codes
    for checkpoint in checkpoints:
        if checkpoint.job_attempt >= before_attempt or not checkpoint.rows_failed:
            continue
        table = _read(storage, checkpoint.path, ["line", "status", "error_code", "error"])
        errors = table.filter(pc.equal(table.column("status"), "error"))
        for line, code, message in zip(
            errors.column("line").to_pylist(),
            errors.column("error_code").to_pylist(),
            errors.column("error").to_pylist(),
            strict=True,
        ):
            if all_errors or (code is not None and retryable(code, message)):
                chosen[line] = checkpoint.path
            elif code is None:
                unclassified[line] = (checkpoint.path, message)
    if unclassified:
        invalid = _invalid_lines(storage, input_path)
        for line, (path, message) in unclassified.items():
            if retryable(None, message, invalid=line in invalid):
                chosen[line] = path
    return chosen


def _invalid_lines(storage: Storage, input_path: str) -> set[int]:
    table = _read_input(storage, input_path)
    invalid = table.filter(pc.equal(table.column("kind"), "invalid"))
    return set(invalid.column("line").to_pylist())


def _read_input(storage: Storage, path: str) -> pa.Table:
    with storage.fs.open_input_file(path) as src:
        return pq.read_table(src, columns=["line", "kind"])


def _read(storage: Storage, path: str, columns: list[str] | None = None) -> pa.Table:
    import pyarrow.dataset as ds  # imports pandas: ~0.3 s a `batchllm run` need not pay

    # Through the contract's schema: a part of an older schema version reads with the newer
    # columns null.
    return ds.dataset(
        [path], schema=OUTPUT_SCHEMA, filesystem=storage.fs, format="parquet"
    ).to_table(columns=columns)


@dataclass(frozen=True, slots=True)
class _Rewrite:
    old: Checkpoint
    kept: Part  # the old part's rows that stay
    removed: Part  # its rows the new part replaces
    path: str | None  # the file of the kept rows; None when none is left


def commit_replacing_part(
    storage: Storage,
    settings: Settings,
    part: Part,
    replacing: dict[int, str],
    place: commit.PartPlace,
    *,
    engine_seconds: float,
) -> int:
    """Commit a retry's part whose lines replace the rows `replacing` locates (line -> part
    path; updated in place to where the rows that stay now are). Returns the next free seq.
    ShardLost (its files deleted) when this run lost the shard."""
    lines = set(part.table.column("line").to_pylist())
    hit = {replacing[line] for line in lines if line in replacing}
    old = _checkpoints_at(settings, place.shard_id, hit)
    written = [write_table(storage, place.out_dir, place.file_name, part.table)]
    next_seq = place.seq + 1
    rewrites: list[_Rewrite] = []
    try:
        for checkpoint in old:
            table = _read(storage, checkpoint.path)
            replaced = pc.is_in(table.column("line"), pa.array(sorted(lines), pa.int64()))
            kept = part_of(_values(table.filter(pc.invert(replaced))))
            path = None
            if kept.table.num_rows:
                path = write_table(
                    storage,
                    place.out_dir,
                    part_name(place.shard, next_seq, place.attempt),
                    kept.table,
                )
                written.append(path)
                next_seq += 1
            rewrites.append(
                _Rewrite(checkpoint, kept, part_of(_values(table.filter(replaced))), path)
            )
        with session_scope(settings) as session:
            _swap(session, part, rewrites, written[0], place, engine_seconds, next_seq)
    except BaseException:
        # Unrecorded either way (the transaction did not commit): the old rows stand.
        for path in written:
            _delete_quietly(storage, path)
        raise
    for rewrite in rewrites:
        _delete_quietly(storage, rewrite.old.path)
        for line in rewrite.kept.table.column("line").to_pylist():
            if rewrite.path is not None and replacing.get(line) == rewrite.old.path:
                replacing[line] = rewrite.path
    for line in lines:
        replacing.pop(line, None)
    return next_seq


def _swap(
    session: Session,
    part: Part,
    rewrites: list[_Rewrite],
    new_path: str,
    place: commit.PartPlace,
    engine_seconds: float,
    next_seq: int,
) -> None:
    """The one transaction: the new rows in, the replaced rows out."""
    commit.record_part(session, part, place, path=new_path, engine_seconds=engine_seconds)
    kept_seq = place.seq + 1
    for rewrite in rewrites:
        commit.replace_checkpoint(
            session, rewrite.old, path=rewrite.path, kept=rewrite.kept, seq=kept_seq
        )
        if rewrite.path is not None:
            kept_seq += 1
        commit.take_off(
            session,
            shard_id=place.shard_id,
            job_id=place.job_id,
            part=rewrite.removed,
            next_seq=next_seq,
        )
    session.flush()


def _checkpoints_at(settings: Settings, shard_id: int, paths: set[str]) -> list[Checkpoint]:
    if not paths:
        return []
    with session_scope(settings) as session:
        found = list(
            session.scalars(
                select(Checkpoint)
                .where(Checkpoint.shard_id == shard_id, Checkpoint.path.in_(paths))
                .order_by(Checkpoint.seq)
            )
        )
    return found


def _values(table: pa.Table) -> list[Values]:
    columns = [table.column(name).to_pylist() for name in OUTPUT_SCHEMA.names]
    return list(zip(*columns, strict=True))


def _delete_quietly(storage: Storage, path: str) -> None:
    try:
        storage.delete(path)
    except OSError as exc:  # left unrecorded: the shard's resume or the job's end deletes it
        log.warning("could not delete %s (%s)", posixpath.basename(path), exc)
