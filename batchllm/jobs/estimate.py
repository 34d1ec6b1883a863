"""A job's cost before it runs (`--dry-run`): the input validated as a job would validate it,
every prompt rendered and tokenized with the model's own tokenizer (no vLLM, no engine), the
output bounded by max_tokens, and the time from the throughput this model reached on this
hardware before (the jobs table). Nothing is stored and no job is created.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from batchllm.engine.hardware import machine_label
from batchllm.engine.images import ImagePrompt
from batchllm.engine.prompts import token_count
from batchllm.engine.sizing import ContextSizer
from batchllm.input.files.source import InputSource
from batchllm.input.formats.rows import POOLING_KINDS, InputRow, stored_row
from batchllm.input.shards import validated_chunks
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.store.db import session_scope
from batchllm.store.service import RecordedThroughput, recorded_throughput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Estimate:
    """What `--dry-run` reports. `max_output_tokens` is an upper bound: every request
    generating its max_tokens (times n), where most stop earlier at an end of text."""

    requests: int
    invalid: int  # refused by validation: they would become error rows
    too_long: int  # prompts at or over the model's context: error rows too
    prompt_tokens: int
    max_output_tokens: int
    hardware: str
    history: RecordedThroughput | None  # earlier jobs of this model on this hardware

    @property
    def max_wall_seconds(self) -> float | None:
        """The time at the recorded throughput for the prompt and the most output: an upper
        bound as the output is. None with no earlier job to go by."""
        if self.history is None:
            return None
        return (self.prompt_tokens + self.max_output_tokens) / self.history.tokens_per_s


def estimate_job(source: InputSource, spec: JobSpec, *, settings: Settings) -> Estimate:
    """Validate and tokenize `source` as a job of `spec` would; create nothing."""
    sizer = ContextSizer(spec.model, spec.sampling, spec.chat_template, settings=settings)
    counts = {"requests": 0, "invalid": 0, "too_long": 0, "prompt": 0, "output": 0}
    chunk: dict[int, InputRow] = {}  # the rows being tokenized, by line

    def count(lines: list[int], prepared: list[list[int] | ImagePrompt | None]) -> None:
        for line, ids in zip(lines, prepared, strict=True):
            if ids is None:  # invalid, or a list embedding input (not counted)
                continue
            row = chunk[line]
            tokens = token_count(ids)  # a prompt's images' tokens too
            # As the engine refuses them: a prompt must leave room for one generated token.
            if tokens > sizer.limit or (row.kind not in POOLING_KINDS and tokens == sizer.limit):
                counts["too_long"] += 1
                continue
            counts["prompt"] += tokens
            counts["output"] += _output_budget(row, spec)

    chunks = validated_chunks(
        source,
        settings=settings,
        table=spec.table,
        adapters=frozenset(spec.adapters),
        task=spec.engine.task,
    )
    for table, problems in chunks:
        counts["requests"] += table.num_rows
        counts["invalid"] += len(problems)
        rows = list(map(stored_row, *table.to_pydict().values(), [None] * table.num_rows))
        chunk = {row.line: row for row in rows}
        sizer.add(rows, count)
    history = None
    hardware = machine_label()
    with session_scope(settings) as session:
        history = recorded_throughput(session, spec.model, hardware)
    return Estimate(
        requests=counts["requests"],
        invalid=counts["invalid"],
        too_long=counts["too_long"],
        prompt_tokens=counts["prompt"],
        max_output_tokens=counts["output"],
        hardware=hardware,
        history=history,
    )


def _output_budget(row: InputRow, spec: JobSpec) -> int:
    """The most tokens a row may generate: its max_tokens times its samples (0 to embed)."""
    if row.kind in POOLING_KINDS:
        return 0
    overrides = row.overrides()
    max_tokens = overrides.get("max_tokens", spec.sampling.max_tokens)
    return int(max_tokens) * int(overrides.get("n", spec.sampling.n))
