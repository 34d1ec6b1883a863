"""A job's rows as they are committed (`batchllm results --partial/--follow`,
`Client.iter_results`): read a part file at a time, a record batch at a time, so memory stays
flat whatever the job's size.

Only committed parts are read: the part files `list_parts` names that a checkpoint records. A
file without its checkpoint yet (its worker is between the upload and the commit, or died
there) may be deleted and its rows run again, so reading it could show a row twice.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import select
from sqlalchemy.orm import Session

from batchllm.errors import BatchLLMError
from batchllm.output.parts import OUTPUT_SCHEMA, list_parts
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Checkpoint, Shard

BATCH_ROWS = 4096  # rows per record batch handed out: a few MB at most for text rows


def committed_parts(session: Session, storage: Storage, job_id: str) -> list[str]:
    """The names of the job's part files that a checkpoint records, in name order."""
    recorded = {
        posixpath.basename(path)
        for path in session.scalars(
            select(Checkpoint.path).join(Shard).where(Shard.job_id == job_id)
        )
    }
    return [name for name in list_parts(storage, storage.output_dir(job_id)) if name in recorded]


def check_columns(columns: Sequence[str] | None) -> list[str] | None:
    """The columns asked for, each one of the Parquet contract's; BatchLLMError names the
    first unknown one."""
    if columns is None:
        return None
    for name in columns:
        if name not in OUTPUT_SCHEMA.names:
            raise BatchLLMError(
                f"no output column {name!r}; the columns are {', '.join(OUTPUT_SCHEMA.names)}"
            )
    return list(columns)


def iter_committed_batches(
    settings: Settings,
    job_ref: str,
    *,
    columns: Sequence[str] | None = None,
    follow: bool = False,
    poll: float = 1.0,
    batch_rows: int = BATCH_ROWS,
) -> Iterator[pa.RecordBatch]:
    """The job's committed rows as record batches, each part file once. With `follow`, keep
    looking for newly committed parts every `poll` seconds until the job ends, then hand out
    the parts committed before its end and stop."""
    wanted = check_columns(columns)
    seen: set[str] = set()
    storage: Storage | None = None
    while True:
        with session_scope(settings) as session:
            job = service.get_job(session, job_ref)
            job_ref = job.id
            # The state is read before the checkpoints: every part committed before the job
            # ended is then in this listing, the last one.
            ended = job.status.is_final
            if storage is None:
                # The storage the job was created in, which later settings do not move.
                storage = Storage.for_job(job, settings)
            new = [name for name in committed_parts(session, storage, job_ref) if name not in seen]
        for name in new:
            seen.add(name)
            yield from _part_batches(storage, storage.output_dir(job_ref), name, wanted, batch_rows)
        if not follow or ended:
            return
        time.sleep(poll)


def _part_batches(
    storage: Storage, out_dir: str, name: str, columns: list[str] | None, batch_rows: int
) -> Iterator[pa.RecordBatch]:
    with storage.fs.open_input_file(posixpath.join(out_dir, name)) as source:
        for batch in pq.ParquetFile(source).iter_batches(batch_size=batch_rows, columns=columns):
            if batch.num_rows:
                yield batch
