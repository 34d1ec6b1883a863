"""A job's rows as the next job's input (`run|submit --from JOB`, `Client.run(JobRows(...))`).

The parent's output rows of the statuses asked for (ok by default), in its line order, become a
temporary Parquet table the child reads as any table input: `custom_id` (the child's id column,
so a child row joins back on it), the parent's output columns (`text`, `finish_reason`,
`structured_ok`, `reasoning`, `tool_calls`, `embedding`, `error`, `status`), `parent_line` and
`prompt` (what the parent was asked: a prompt, a chat's last user message, an embedding input).
The child's prompt is `text` unless `--prompt-template` builds it from these columns. Read one
parent input shard at a time and put in line order with bounded memory; the child stores its own copy
and records its parent (store/service.py, `job_parents`). Only a completed parent is read: one
that failed, was cancelled or expired is retried (`batchllm retry`) first.
"""

from __future__ import annotations

import json
import posixpath
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchllm.errors import InputError, JobStateError
from batchllm.external_sort import ExternalSort
from batchllm.input.files.source import InputSource
from batchllm.input.job_rows import CARRIED, ID_COLUMN, JobRows
from batchllm.output.parts import OUTPUT_SCHEMA, list_parts, shard_of_part
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.states import JobStatus


@contextmanager
def parent_input(rows: JobRows, settings: Settings) -> Iterator[InputSource]:
    """The parent's rows as a resolved Parquet input, removed on exit (the child keeps its
    own copy). JobNotFound for an unknown job; JobStateError for one not completed;
    InputError when it has no row of those statuses."""
    with session_scope(settings) as session:
        parent = service.get_job(session, rows.job)
        status, parent_id = parent.status, parent.id
    if status is not JobStatus.COMPLETED:
        raise JobStateError(
            f"--from {parent_id}: the job is {status.value}; its rows feed another job once "
            "it completed (`batchllm wait`, or `batchllm retry` a failed one)"
        )
    storage = Storage.for_job(parent, settings)
    with tempfile.TemporaryDirectory(prefix="batchllm-from-") as scratch:
        path = Path(scratch) / f"{parent_id}.parquet"
        if not write_parent_rows(storage, parent_id, rows.statuses, path):
            raise InputError(
                f"--from {parent_id}: the job has no row of status {', '.join(rows.statuses)}"
            )
        # Written just now, so nothing is left to resolve: a local Parquet file, recorded as
        # the rows it holds (`--from JOB`), not as this temporary path.
        yield InputSource(
            name=str(path),
            recorded=rows.recorded,
            uri=False,
            format="parquet",
            s3_endpoint=settings.resolved_s3_endpoint,
        )


def write_parent_rows(storage: Storage, job_id: str, statuses: tuple[str, ...], path: Path) -> int:
    """Write the job's output rows of these statuses, in line order, with the prompt each was
    asked, to a Parquet file at `path`; returns how many. One input shard at a time: its
    prompts and the rows of its own part files; a shard's lines are not a range of the file
    (input/shards.py places them by prompt), so the rows are put back in line order by an
    external sort, and memory stays bounded whatever the job's size."""
    out_dir = storage.output_dir(job_id)
    parts_of: dict[int, list[str]] = {}
    for name in list_parts(storage, out_dir):  # one listing, not one a shard
        parts_of.setdefault(shard_of_part(name), []).append(posixpath.join(out_dir, name))
    wanted = pc.field("status").isin(list(statuses))
    written = 0
    writer: pq.ParquetWriter | None = None
    with ExternalSort([("parent_line", "ascending")], memory_bytes=_SORT_BYTES) as in_order:
        for index, asked in _input_shards(storage, job_id):
            if index not in parts_of:
                continue
            output = ds.dataset(
                parts_of[index], schema=OUTPUT_SCHEMA, filesystem=storage.fs, format="parquet"
            )
            rows = output.to_table(columns=[ID_COLUMN, "line", *CARRIED], filter=wanted)
            if rows.num_rows:
                in_order.add(_with_prompts(rows, asked))
        try:
            for chunk in in_order.sorted_tables():
                if writer is None:
                    writer = pq.ParquetWriter(path, chunk.schema)
                writer.write_table(chunk)
                written += chunk.num_rows
        finally:
            if writer is not None:
                writer.close()
    return written


# What the rows wait in memory before the sort spills them to a temporary file.
_SORT_BYTES = 256 * 1024 * 1024


def _input_shards(storage: Storage, job_id: str) -> Iterator[tuple[int, pa.Table]]:
    """The job's stored input shards in order, each with its index: the columns a prompt is
    read from."""
    for index, path in storage.input_shards(job_id):
        with storage.fs.open_input_file(path) as handle:
            yield (
                index,
                pq.read_table(handle, columns=["line", "kind", "prompt", "messages", "inputs"]),
            )


def _with_prompts(rows: pa.Table, asked: pa.Table) -> pa.Table:
    """Output rows with their parent line and the text their line asked."""
    lines = rows.column("line").to_pylist()
    where = {line: at for at, line in enumerate(asked.column("line").to_pylist())}
    stored = asked.take(pa.array([where[line] for line in lines], pa.int64())).to_pylist()
    columns: dict[str, Any] = {
        ID_COLUMN: rows.column(ID_COLUMN),
        "parent_line": rows.column("line"),
        "prompt": pa.array([asked_text(row) for row in stored], pa.string()),
    }
    columns.update({name: rows.column(name) for name in CARRIED})
    return pa.table(columns)


def asked_text(row: dict[str, Any]) -> str | None:
    """A stored input row's question: its prompt, its last user message's text, or its
    embedding inputs (joined by newlines)."""
    if row["prompt"] is not None:
        return str(row["prompt"])
    if row["messages"] is not None:
        for message in reversed(json.loads(row["messages"])):
            if message.get("role") == "user":
                return _content_text(message.get("content"))
        return None
    if row["inputs"] is not None:
        return "\n".join(str(text) for text in json.loads(row["inputs"]))
    return None


def _content_text(content: Any) -> str | None:
    """A message's text: a string as it is; the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict)]
        texts = [text for text in texts if text]
        return "\n".join(texts) if texts else None
    return None
