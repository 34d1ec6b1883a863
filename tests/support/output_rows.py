"""Output rows as named objects, for tests that write part files of their own and record their
checkpoints: production keeps finished rows as value tuples in OUTPUT_SCHEMA's order
(output/parts.py OutputBuffer)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from sqlalchemy.orm import Session

from batchllm.output import commit
from batchllm.output.parts import Values, generated_tokens, part_of, write_table
from batchllm.storage import Storage


@dataclass(slots=True)
class OutputRow:
    custom_id: str
    line: int
    status: str
    text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    structured_ok: bool | None = None  # null: the row had no constraint
    logprobs: list[dict[str, Any]] | None = None
    choices: list[dict[str, Any]] | None = None  # every sample when n > 1
    adapter: str | None = None
    embedding: list[float] | None = None
    embeddings: list[list[float]] | None = None
    error_code: str | None = None  # batchllm/row_errors.py
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {id, name, arguments, arguments_valid}
    scores: list[float] | None = None  # a score or rerank line's, one per document
    label: str | None = None  # a classify line's class
    probs: list[float] | None = None  # and its probability per class

    @property
    def generated_tokens(self) -> int:
        """Tokens generated over every sample of the row (throughput counts all of them)."""
        return generated_tokens(self.choices, self.completion_tokens)

    @classmethod
    def failed(
        cls,
        custom_id: str,
        line: int,
        error: str,
        prompt_tokens: int | None = None,
        code: str | None = None,
    ) -> OutputRow:
        return cls(
            custom_id=custom_id,
            line=line,
            status="error",
            error=error,
            prompt_tokens=prompt_tokens,
            error_code=code,
        )

    def values(self) -> Values:
        return (
            self.custom_id,
            self.line,
            self.status,
            self.text,
            self.finish_reason,
            self.prompt_tokens,
            self.completion_tokens,
            self.error,
            self.structured_ok,
            self.logprobs,
            self.choices,
            self.adapter,
            self.embedding,
            self.embeddings,
            self.error_code,
            self.reasoning,
            self.reasoning_tokens,
            self.tool_calls,
            self.scores,
            self.label,
            self.probs,
        )


def rows_to_table(rows: Iterable[OutputRow]) -> pa.Table:
    return part_of([row.values() for row in rows]).table


def write_part(storage: Storage, out_dir: str, name: str, rows: list[OutputRow]) -> str:
    """Write one part file of these rows atomically; returns its path."""
    return write_table(storage, out_dir, name, rows_to_table(rows))


def record_part(
    session: Session,
    job_id: str,
    shard_id: int,
    seq: int,
    path: str,
    *,
    rows: tuple[int, int],
    tokens: tuple[int, int],
    seconds: float,
    attempt: int | None = None,
) -> None:
    """Record the checkpoint of a part file as the runner does after writing it: `rows` (ok,
    failed) and `tokens` (prompt, completion) are the counts it adds to its shard and job."""
    commit.record_checkpoint(
        session,
        shard_id=shard_id,
        job_id=job_id,
        seq=seq,
        path=path,
        rows_ok=rows[0],
        rows_failed=rows[1],
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        engine_seconds=seconds,
        attempt=attempt,
    )
