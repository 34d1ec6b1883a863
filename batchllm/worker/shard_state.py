"""Per-shard bookkeeping while it runs: pending rows, buffered results, checkpoint commits."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from batchllm.errors import ShardLost
from batchllm.jobs import checkpoints
from batchllm.jobs.db import get_one, session_scope
from batchllm.jobs.inputs import iter_shard_rows
from batchllm.jobs.models import Shard
from batchllm.jobs.output import (
    OutputBuffer,
    Part,
    part_name,
    part_of,
    read_lines,
    remove_unrecorded_parts,
    write_table,
)
from batchllm.jobs.rows import InputRow
from batchllm.jobs.schemas import JobSpec
from batchllm.jobs.storage import Storage
from batchllm.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class ShardState:
    shard_id: int
    index: int
    job_id: str
    spec: JobSpec
    input_path: str
    out_dir: str
    attempt: int  # this run's claim; fences every write against a worker that took over
    next_seq: int
    done_lines: set[int]
    buffer: OutputBuffer = field(default_factory=OutputBuffer)
    inflight: int = 0
    fed_all: bool = False
    last_commit: float = field(default_factory=time.monotonic)
    step_seconds: float = 0.0  # engine time to attribute to the next checkpoint

    @property
    def finished(self) -> bool:
        return self.fed_all and self.inflight == 0

    def rows(self, storage: Storage) -> Iterator[InputRow]:
        """The shard's rows still to do, prefix-grouped when the job asks for it."""
        rows = iter_shard_rows(storage, self.input_path, with_token_ids=True)
        if self.done_lines:  # resumed: skip the rows its checkpoints hold
            rows = (r for r in rows if r.line not in self.done_lines)
        if not self.spec.engine.group_prefixes:
            return rows
        # Sorting by the prompt text puts requests sharing a prefix (a system prompt, a few-shot
        # header) next to each other, so vLLM's prefix cache still holds it for the next one.
        # The shard is bounded by --shard-size, so holding it in memory is bounded too.
        # Two stable sorts, by text then by kind, order the rows as one by (kind, text) would,
        # without a key tuple per row and with CPython's fast path for all-str keys.
        ordered = sorted(rows, key=_prompt_text)
        ordered.sort(key=attrgetter("kind"))
        return iter(ordered)

    def commit(self, storage: Storage, settings: Settings) -> Part | None:
        """Write buffered rows as one part file, then record the checkpoint. Returns the part
        committed, None when there was nothing to commit."""
        if not self.buffer:
            return None
        part = part_of(self.buffer.take())
        name = part_name(self.index, self.next_seq, self.attempt)
        path = write_table(storage, self.out_dir, name, part.table)
        try:
            with session_scope(settings) as session:
                checkpoints.record_checkpoint(
                    session,
                    shard_id=self.shard_id,
                    job_id=self.job_id,
                    seq=self.next_seq,
                    path=path,
                    rows_ok=part.rows_ok,
                    rows_failed=part.rows_failed,
                    prompt_tokens=part.prompt_tokens,
                    completion_tokens=part.completion_tokens,
                    structured_rows=part.structured_rows,
                    structured_valid=part.structured_valid,
                    engine_seconds=self.step_seconds,
                    attempt=self.attempt,
                )
        except ShardLost:
            storage.delete(path)  # its rows belong to the worker that took the shard over
            raise
        self.next_seq += 1
        self.step_seconds = 0.0
        self.last_commit = time.monotonic()
        return part


def load_shard_state(storage: Storage, settings: Settings, shard_id: int) -> ShardState:
    """State of a claimed shard, resuming from its checkpoints.

    Part files of this shard that no checkpoint records were written by a worker that died
    between the file and the database commit: they are deleted, and their rows run again.
    """
    with session_scope(settings) as session:
        shard = get_one(session, Shard, shard_id)
        job = shard.job
        committed = checkpoints.checkpoints_of(session, shard_id)
        spec = JobSpec.model_validate(job.spec)
        index, job_id, input_path, next_seq = shard.index, job.id, shard.input_path, shard.next_seq
        attempt = shard.attempts
    out_dir = storage.output_dir(job_id)
    for name in remove_unrecorded_parts(
        storage, out_dir, (c.path for c in committed), prefix=f"part-s{index:05d}-"
    ):
        log.warning("shard %d: removed uncommitted part file %s", index, name)
    done: set[int] = set()
    for checkpoint in committed:
        done.update(read_lines(storage, checkpoint.path))
    if done:
        log.info("shard %d: resuming, %d rows already committed", index, len(done))
    return ShardState(
        shard_id=shard_id,
        index=index,
        job_id=job_id,
        spec=spec,
        input_path=input_path,
        out_dir=out_dir,
        attempt=attempt,
        next_seq=next_seq,
        done_lines=done,
    )


def _prompt_text(row: InputRow) -> str:
    return row.messages or row.prompt or ""


def sampling_for(spec: JobSpec, row: InputRow) -> dict[str, Any]:
    return spec.sampling.merged(row.overrides())
