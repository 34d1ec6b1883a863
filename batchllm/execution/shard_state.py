"""Per-shard bookkeeping while it runs: pending rows, buffered results, checkpoint commits."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from batchllm.input.formats.rows import InputRow
from batchllm.input.shards import iter_shard_rows
from batchllm.output import commit, replace
from batchllm.output.parts import OutputBuffer, Part, part_of
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store.db import get_one, session_scope
from batchllm.store.models import Shard

log = logging.getLogger(__name__)


@dataclass
class ShardState:
    shard_id: int
    index: int
    job_id: str
    spec: JobSpec
    input_path: str
    out_dir: str
    storage: Storage  # the job's (Storage.for_job)
    attempt: int  # this run's claim; fences every write against a worker that took over
    next_seq: int
    done_lines: set[int]
    job_attempt: int = 1  # the job's run (a retry's is 2, 3...)
    # A retry's lines whose earlier row its new row replaces -> the part holding that row.
    replacing: dict[int, str] = field(default_factory=dict)
    buffer: OutputBuffer = field(default_factory=OutputBuffer)
    cached_tokens: int = 0  # the buffered rows' prefix-cache hits (no output column holds them)
    inflight: int = 0
    fed_all: bool = False
    # Rows were aborted before they ran (a stop's drain hands them back): the shard cannot
    # finish in this run, however many of its other rows do.
    rows_dropped: bool = False
    # Stored token ids checked against the engine's tokenizer (runner._checked_ids), and
    # found different: the shard's rows are tokenized by the engine.
    ids_checked: bool = False
    ids_dropped: bool = False
    last_commit: float = field(default_factory=time.monotonic)
    step_seconds: float = 0.0  # engine time to attribute to the next checkpoint

    @property
    def finished(self) -> bool:
        return self.fed_all and self.inflight == 0 and not self.rows_dropped

    def rows(self) -> Iterator[InputRow]:
        """The shard's rows still to do, prefix-grouped when the job asks for it."""
        rows = iter_shard_rows(self.storage, self.input_path, with_token_ids=True)
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

    def commit(self, settings: Settings) -> Part | None:
        """Write buffered rows as one part file, then record the checkpoint. Returns the part
        committed, None when there was nothing to commit."""
        if not self.buffer:
            return None
        part = part_of(self.buffer.take(), self.cached_tokens)
        self.cached_tokens = 0
        place = commit.PartPlace(  # in PartPlace's field order
            self.shard_id,
            self.index,
            self.job_id,
            self.out_dir,
            self.next_seq,
            self.attempt,
            self.job_attempt,
        )
        if self.replacing:
            self.next_seq = replace.commit_replacing_part(
                self.storage,
                settings,
                part,
                self.replacing,
                place,
                engine_seconds=self.step_seconds,
            )
        else:
            commit.commit_part(
                self.storage, settings, part, place, engine_seconds=self.step_seconds
            )
            self.next_seq += 1
        self.step_seconds = 0.0
        self.last_commit = time.monotonic()
        return part


def load_shard_state(settings: Settings, shard_id: int) -> ShardState:
    """State of a claimed shard, resuming from its checkpoints (commit.resume_shard), in its
    job's storage."""
    with session_scope(settings) as session:
        shard = get_one(session, Shard, shard_id)
        job = shard.job
        committed = commit.checkpoints_of(session, shard_id)
        spec = JobSpec.model_validate(job.spec)
        index, job_id, input_path, next_seq = shard.index, job.id, shard.input_path, shard.next_seq
        attempt = shard.attempts
        job_attempt = job.attempt
        all_errors = bool(job.attempts and job.attempts[-1].get("all_errors"))
        storage = Storage.for_job(job, settings)
    out_dir = storage.output_dir(job_id)
    done = commit.resume_shard(storage, out_dir, index, committed, attempt)
    replacing: dict[int, str] = {}
    if job_attempt > 1:
        replacing = replace.rows_to_replace(
            storage,
            committed,
            before_attempt=job_attempt,
            all_errors=all_errors,
            input_path=input_path,
        )
        done.difference_update(replacing)
        log.info("shard %d: retry %d runs %d rows again", index, job_attempt, len(replacing))
    if done:
        log.info("shard %d: resuming, %d rows already committed", index, len(done))
    return ShardState(
        shard_id=shard_id,
        index=index,
        job_id=job_id,
        spec=spec,
        input_path=input_path,
        out_dir=out_dir,
        storage=storage,
        attempt=attempt,
        next_seq=next_seq,
        done_lines=done,
        job_attempt=job_attempt,
        replacing=replacing,
    )


def _prompt_text(row: InputRow) -> str:
    return row.messages or row.prompt or ""


def sampling_for(spec: JobSpec, row: InputRow) -> dict[str, Any]:
    """A row's full settings: the job's defaults under the line's own, with the job's output
    parsers (the engine splits thinking and tool calls off the text with them)."""
    merged = spec.sampling.merged(row.overrides())
    if spec.reasoning_parser is not None:
        merged["reasoning_parser"] = spec.reasoning_parser
    if spec.tool_call_parser is not None:
        merged["tool_call_parser"] = spec.tool_call_parser
    return merged
