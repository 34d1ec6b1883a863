"""The Parquet contract: one row per input line, the same schema for success and error rows.

A job's output directory holds part files `part-s<shard>-a<attempt>-<seq>.parquet`, plus `_manifest.json`
and `_SUCCESS` once the job is finalized. Names starting with `_` or `.` are skipped by pyarrow,
pandas and Spark dataset readers, so the directory reads as one table without options; Polars
(2.x refuses a directory of mixed extensions) and DuckDB take the glob `<dir>/*.parquet`.
Part files appear atomically (on a filesystem written under a dot-name, then renamed; on an
object store, which has no rename, uploaded under the final name, which shows the whole object
or nothing), so the results of a running job can be read at any time. The checkpoint row is the
commit record: a part no checkpoint records (its worker died between the upload and the commit)
is deleted when the shard resumes and again when the job is finalized, so a finished job reads
as exactly one row per input line.
"""

from __future__ import annotations

import io
import json
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.storage import Storage

if TYPE_CHECKING:
    import pyarrow.dataset as ds

# Version 2 appended nullable columns (structured_ok, logprobs, choices, adapter, embedding,
# embeddings), version 3 error_code (row_errors.py), version 4 reasoning,
# reasoning_tokens and tool_calls, version 5 scores, label and probs; a reader of an older
# version keeps working, since no column moved or changed type.
SCHEMA_VERSION = 5

TOP_LOGPROB = pa.struct([pa.field("token", pa.string()), pa.field("logprob", pa.float32())])
TOKEN_LOGPROBS = pa.list_(
    pa.struct(
        [
            pa.field("token", pa.string()),
            pa.field("logprob", pa.float32()),
            pa.field("top_logprobs", pa.list_(TOP_LOGPROB)),
        ]
    )
)
CHOICE = pa.struct(
    [
        pa.field("index", pa.int32()),
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("logprobs", TOKEN_LOGPROBS),
    ]
)

TOOL_CALL = pa.struct(
    [
        pa.field("id", pa.string()),
        pa.field("name", pa.string()),
        pa.field("arguments", pa.string()),  # JSON text, as OpenAI returns it
        pa.field("arguments_valid", pa.bool_()),  # false: the text does not parse as JSON
    ]
)

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("custom_id", pa.string(), nullable=False),
        pa.field("line", pa.int64(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("error", pa.string()),
        # version 2
        pa.field("structured_ok", pa.bool_()),
        pa.field("logprobs", TOKEN_LOGPROBS),
        pa.field("choices", pa.list_(CHOICE)),
        pa.field("adapter", pa.string()),  # the LoRA adapter; null for the base model
        pa.field("embedding", pa.list_(pa.float32())),  # an embedding line's one input
        pa.field("embeddings", pa.list_(pa.list_(pa.float32()))),  # its list input
        # version 3
        pa.field("error_code", pa.string()),  # why an error row failed (row_errors.py)
        # version 4
        pa.field("reasoning", pa.string()),  # a reasoning model's thinking (--reasoning-parser)
        pa.field("reasoning_tokens", pa.int32()),  # its share of completion_tokens
        pa.field("tool_calls", pa.list_(TOOL_CALL)),
        # version 5
        # A score line's score per text_2 (a rerank line's per document), in their order.
        pa.field("scores", pa.list_(pa.float64())),
        pa.field("label", pa.string()),  # a classify line's most likely class
        pa.field("probs", pa.list_(pa.float32())),  # its probability per class
    ],
    metadata={"batchllm.schema_version": str(SCHEMA_VERSION)},
)

MANIFEST_NAME = "_manifest.json"
_REPEATING = ["status", "finish_reason", "error", "adapter", "error_code"]
_WITH_STATISTICS = ["custom_id", "line", "status", "prompt_tokens", "completion_tokens"]
SUCCESS_NAME = "_SUCCESS"

# One output row's values, in OUTPUT_SCHEMA's column order.
Values = tuple[Any, ...]
_NULL_ROW: dict[str, Any] = dict.fromkeys(OUTPUT_SCHEMA.names)


def _row(**values: Any) -> Values:
    """A row from its non-null columns by name, in OUTPUT_SCHEMA's order. (Answers, the hot
    path, are written as a tuple instead: test_output_row_layout pins it to the schema.)"""
    unknown = values.keys() - _NULL_ROW.keys()
    if unknown:
        raise KeyError(f"not output columns: {sorted(unknown)}")
    return tuple({**_NULL_ROW, **values}.values())


def generated_tokens(choices: list[dict[str, Any]] | None, completion_tokens: int | None) -> int:
    if choices:
        return sum(c["completion_tokens"] or 0 for c in choices)
    return completion_tokens or 0


class OutputBuffer:
    """A shard's finished rows waiting for their commit, kept as value tuples in
    OUTPUT_SCHEMA's order: building an object per result and reading it back field by field
    into columns was about a quarter of the feed's own per-row work."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[Values] = []

    def __len__(self) -> int:
        return len(self.rows)

    def answer(
        self,
        custom_id: str,
        line: int,
        text: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        structured_ok: bool | None,
        logprobs: list[dict[str, Any]] | None,
        choices: list[dict[str, Any]] | None,
        adapter: str | None,
        reasoning: str | None = None,
        reasoning_tokens: int | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> None:
        """A generated answer."""
        self.rows.append(
            (
                custom_id,
                line,
                "ok",
                text,
                finish_reason,
                prompt_tokens,
                completion_tokens,
                None,
                structured_ok,
                logprobs,
                choices,
                adapter,
                None,
                None,
                None,
                reasoning,
                reasoning_tokens,
                tool_calls,
                None,
                None,
                None,
            )
        )

    def embedding(
        self,
        custom_id: str,
        line: int,
        prompt_tokens: int,
        embedding: list[float] | None,
        embeddings: list[list[float]] | None,
    ) -> None:
        """An embedding line's vector (one input) or vectors (a list input)."""
        self._add(custom_id, line, "ok", prompt_tokens, embedding=embedding, embeddings=embeddings)

    def scored(self, custom_id: str, line: int, prompt_tokens: int, scores: list[float]) -> None:
        """A score or rerank line's scores, one per document in its order."""
        self._add(custom_id, line, "ok", prompt_tokens, scores=scores)

    def classified(
        self, custom_id: str, line: int, prompt_tokens: int, label: str | None, probs: list[float]
    ) -> None:
        """A classify line's class and its probability per class."""
        self._add(custom_id, line, "ok", prompt_tokens, label=label, probs=probs)

    def failed(
        self,
        custom_id: str,
        line: int,
        error: str,
        code: str,
        prompt_tokens: int | None = None,
    ) -> None:
        """An error row; `code` is one of row_errors.py's."""
        self._add(custom_id, line, "error", prompt_tokens, error=error, error_code=code)

    def _add(
        self, custom_id: str, line: int, status: str, prompt_tokens: int | None, **values: Any
    ) -> None:
        """A row from its non-null columns by name (answers, the hot path, skip this)."""
        self.rows.append(
            _row(
                custom_id=custom_id,
                line=line,
                status=status,
                prompt_tokens=prompt_tokens,
                **values,
            )
        )

    def take(self) -> list[Values]:
        """The buffered rows; the buffer is empty afterwards."""
        rows, self.rows = self.rows, []
        return rows


PART_COUNTS = (
    "rows_ok",
    "rows_failed",
    "prompt_tokens",
    "completion_tokens",
    "structured_rows",
    "structured_valid",
    "cached_tokens",
)


@dataclass(frozen=True, slots=True)
class Part:
    """One part file's rows as a table, and the counts its checkpoint adds."""

    table: pa.Table
    rows_ok: int
    rows_failed: int
    prompt_tokens: int
    completion_tokens: int  # over every sample of a row
    structured_rows: int  # rows that ran under a structured output constraint
    structured_valid: int  # of those, the ones whose answer satisfies it
    # Prompt tokens of these rows served from the engine's prefix cache. Not an output column
    # (the schema stays as it is), so only the part knows it, from the runner.
    cached_tokens: int = 0

    def counts(self) -> dict[str, int]:
        """Its counts by name, as its checkpoint records them (output/commit.py)."""
        return {name: getattr(self, name) for name in PART_COUNTS}


def part_of(rows: list[Values], cached_tokens: int = 0) -> Part:
    """The table and counts of these rows, computed a column at a time; `cached_tokens`
    (the rows' prefix-cache hits) as the runner counted them."""
    columns: dict[str, tuple[Any, ...]] = (
        dict(zip(OUTPUT_SCHEMA.names, zip(*rows, strict=True), strict=True))
        if rows
        else dict.fromkeys(OUTPUT_SCHEMA.names, ())
    )
    table = pa.Table.from_arrays(
        [_array(columns[field.name], field.type) for field in OUTPUT_SCHEMA],
        schema=OUTPUT_SCHEMA,
    )
    ok = columns["status"].count("ok")
    structured = columns["structured_ok"]
    return Part(
        table=table,
        rows_ok=ok,
        rows_failed=len(rows) - ok,
        prompt_tokens=sum(filter(None, columns["prompt_tokens"])),
        completion_tokens=_completion_tokens(columns["choices"], columns["completion_tokens"]),
        structured_rows=len(structured) - structured.count(None),
        structured_valid=structured.count(True),
        cached_tokens=cached_tokens,
    )


def _array(values: tuple[Any, ...], type_: pa.DataType) -> pa.Array:
    # Most columns of a part are all null (errors, logprobs, choices, embeddings...): skip
    # converting them value by value.
    if values.count(None) == len(values):
        return pa.nulls(len(values), type_)
    return pa.array(values, type_)


def _completion_tokens(
    choices: tuple[list[dict[str, Any]] | None, ...], completion_tokens: tuple[int | None, ...]
) -> int:
    if choices.count(None) == len(choices):  # no row has several samples
        return sum(filter(None, completion_tokens))
    return sum(map(generated_tokens, choices, completion_tokens))


def part_name(shard: int, seq: int, attempt: int | None = None) -> str:
    """`part-s<shard>-<seq>`, or with the attempt `part-s<shard>-a<attempt>-<seq>`: a worker that
    lost its shard can then never overwrite a file of the worker that took the shard over."""
    middle = f"a{attempt:03d}-" if attempt is not None else ""
    return f"part-s{shard:05d}-{middle}{seq:05d}.parquet"


def part_prefix(shard: int) -> str:
    """The start every part file name of one shard shares."""
    return f"part-s{shard:05d}-"


def shard_of_part(name: str) -> int:
    """The shard index a part file name (from `part_name`) carries."""
    match = _PART_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"not a part file name: {name}")
    return int(match[1])


def attempt_of_part(name: str) -> int:
    """The shard attempt a part file name carries (0 for a name from before attempts)."""
    match = _PART_ATTEMPT.fullmatch(name)
    return int(match[1]) if match else 0


def list_parts(storage: Storage, out_dir: str, *, shard: int | None = None) -> list[str]:
    """The names of the part files in a job's output directory (of one shard, if given), in
    name order: every reader of parts lists them here, so the naming lives in this module.
    One shard's files are found by listing the whole directory: pyarrow's filesystems list
    directories, not key prefixes (on S3 a resume of a large job reads thousands of names)."""
    prefix = "part-" if shard is None else part_prefix(shard)
    return sorted(
        name
        for name in storage.listdir(out_dir)
        if name.startswith(prefix) and _PART_NAME.fullmatch(name)
    )


_PART_NAME = re.compile(r"part-s(\d+)-.*\.parquet")
_PART_ATTEMPT = re.compile(r"part-s\d+-a(\d+)-\d+\.parquet")


def write_table(storage: Storage, out_dir: str, name: str, table: pa.Table) -> str:
    """Write one part file atomically; returns its path."""
    sink = io.BytesIO()
    pq.write_table(
        table,
        sink,
        compression="zstd",
        # Dictionaries where values repeat, min/max statistics of the short columns (readers
        # filter on line, custom_id and status); the answers' statistics cost write time and
        # no reader uses them.
        use_dictionary=_REPEATING,
        write_statistics=_WITH_STATISTICS,
    )
    path = posixpath.join(out_dir, name)
    storage.write_bytes(path, sink.getvalue())
    return path


def remove_unrecorded_parts(
    storage: Storage,
    out_dir: str,
    recorded: Iterable[str],
    *,
    shard: int | None = None,
    up_to_attempt: int | None = None,
) -> list[str]:
    """Delete the part files (of one shard, if given) that no checkpoint records (`recorded`:
    their paths or names): written by a worker that died between the file and its commit, or
    that lost its shard; their rows run again (or ran) elsewhere. With `up_to_attempt` (a
    shard run's resume), files of later attempts are kept: `recorded` was read when this run
    claimed the shard, and a run that lost the shard since (paused past its lease) must not
    delete what the run that took it over wrote and recorded after that read. Returns the names
    deleted."""
    keep = {posixpath.basename(path) for path in recorded}
    removed = [
        name
        for name in list_parts(storage, out_dir, shard=shard)
        if name not in keep and (up_to_attempt is None or attempt_of_part(name) <= up_to_attempt)
    ]
    for name in removed:
        storage.delete(posixpath.join(out_dir, name))
    return removed


def read_lines(storage: Storage, path: str) -> list[int]:
    """The input line numbers a committed part file holds (for resume)."""
    with storage.fs.open_input_file(path) as src:
        return [int(n) for n in pq.read_table(src, columns=["line"]).column("line").to_pylist()]


def write_manifest(storage: Storage, out_dir: str, manifest: dict[str, Any]) -> None:
    body = {"schema_version": SCHEMA_VERSION, **manifest}
    storage.write_bytes(
        posixpath.join(out_dir, MANIFEST_NAME),
        json.dumps(body, indent=2, sort_keys=True, default=str).encode(),
    )
    storage.write_bytes(posixpath.join(out_dir, SUCCESS_NAME), b"")


def read_output(storage: Storage, out_dir: str) -> pa.Table:
    """All committed rows of a job's output as one table."""
    if not list_parts(storage, out_dir):
        return OUTPUT_SCHEMA.empty_table()
    return output_dataset(storage, out_dir).to_table()


def output_dataset(storage: Storage, out_dir: str) -> ds.Dataset:
    """A job's committed part files as one pyarrow dataset with the contract's schema."""
    import pyarrow.dataset as ds

    paths = [posixpath.join(out_dir, name) for name in list_parts(storage, out_dir)]
    return ds.dataset(paths, schema=OUTPUT_SCHEMA, filesystem=storage.fs, format="parquet")
