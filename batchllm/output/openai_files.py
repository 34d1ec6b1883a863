"""A finished job as OpenAI Batch API files: `output.jsonl` and `errors.jsonl` (`batchllm export`).

One line per output row, in input line order: ok rows go to the output file, error rows to the
error file, each as OpenAI writes them (`{"id": "batch_req_...", "custom_id", "response",
"error"}`). The line's endpoint is not stored (an OpenAI line's url is dropped at validation),
so it follows from the stored row kind (input/parsing/endpoints.py): chat -> chat.completion,
prompt -> text_completion, embed -> an embeddings list, score -> vLLM's ScoreResponse or
RerankResponse (the row's stored shape says which), classify -> vLLM's ClassificationResponse. Plain
`prompt`/`messages`/`input` lines export by their form the same way.

Read one shard at a time: its part files (`part-s<shard>-...`) matched by line to the shard's
stored rows (line, kind, custom_id), then put in line order by an external sort (a shard's lines
are not a range of the file: input/shards.py places them by prompt). Memory stays bounded
(batchllm/external_sort.py) whatever the job's size; the JSON goes straight to the files.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import posixpath
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from itertools import accumulate
from pathlib import Path
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm.errors import JobStateError
from batchllm.external_sort import ExternalSort
from batchllm.input.formats.rows import refusal_code
from batchllm.input.parsing.endpoints import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS
from batchllm.input.parsing.problems import (
    DUPLICATE_CUSTOM_ID,
    INVALID_JSON,
    INVALID_VALUE,
    MISSING_REQUIRED_PARAMETER,
    UNKNOWN_PARAMETER,
)
from batchllm.output.parts import OUTPUT_SCHEMA, list_parts, shard_of_part
from batchllm.output.pooling_bodies import classify_body, score_body
from batchllm.output.responses_body import (
    chat_message,
    completion_details,
    is_responses,
    response_body,
)
from batchllm.row_errors import code_of
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store.models import Job, JobStatus

OUTPUT_NAME = "output.jsonl"
ERRORS_NAME = "errors.jsonl"

_BATCH_ROWS = 1024  # rows turned into Python objects at a time
_WRITE_BUFFER = 1 << 20
_FIELD_PREFIX = re.compile(r"field '(.+?)': ", re.DOTALL)  # InputRow.from_item's wording
# OpenAI's stand-in for a log probability too small to report; JSON has no -Infinity, and vLLM
# gives -inf for tokens a constraint or top-k masked.
_VERY_UNLIKELY = -9999.0

# An input shard stored before validation stored the codes keeps only an invalid line's
# message: the code is read back from the wording of batchllm's reader and pydantic then.
_INVALID_CODES_BY_WORDING = (
    ("duplicate custom_id", DUPLICATE_CUSTOM_ID),
    ("malformed JSON", INVALID_JSON),
    ("not valid UTF-8", INVALID_JSON),
    ("Field required", MISSING_REQUIRED_PARAMETER),
    ("Extra inputs are not permitted", UNKNOWN_PARAMETER),
)


_NOT_RUN = "not_run"  # the status of a line without an output row (never ran)
# The stored input row's columns beside an output row while the export reads it.
_KIND, _STORED_ID, _SETTINGS, _INPUTS = "_kind", "_stored_custom_id", "_settings", "_inputs"
_SORT_BYTES = 256 * 1024 * 1024  # rows held before the line sort spills them to a file


@dataclass
class ExportCounts:
    output_path: Path | str  # a local Path, or the path in the storage written to
    errors_path: Path | str
    output: int = 0  # lines written to output.jsonl (ok rows)
    errors: int = 0  # lines written to errors.jsonl (error rows)
    not_run: int = 0  # input lines without a row: a cancelled or failed job never ran them


def export_openai(
    job: Job, out_dir: Path, *, settings: Settings, overwrite: bool = False
) -> ExportCounts:
    """Write the job's rows as OpenAI batch output and error files into `out_dir` (created if
    missing). JobStateError when the job is not finished or has no output; FileExistsError
    when either file exists and not `overwrite`. Both files appear only when complete."""
    storage, shards = _exportable(job, settings)
    counts = ExportCounts(out_dir / OUTPUT_NAME, out_dir / ERRORS_NAME)
    existing = [p for p in (counts.output_path, counts.errors_path) if Path(p).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists")
    target = Storage(str(out_dir))
    _write_files(job, storage, shards, target, target.root, counts)
    return counts


def export_openai_to(
    job: Job, target: Storage, directory: str, *, settings: Settings
) -> ExportCounts:
    """The same two files into `directory`, a path in the storage `target` (e.g. a prefix in
    a bucket), replacing any there; their paths in `target` are in the counts."""
    storage, shards = _exportable(job, settings)
    counts = ExportCounts(
        posixpath.join(directory, OUTPUT_NAME), posixpath.join(directory, ERRORS_NAME)
    )
    _write_files(job, storage, shards, target, directory, counts)
    return counts


def _exportable(job: Job, settings: Settings) -> tuple[Storage, list[_Shard]]:
    if not job.status.is_final:
        raise JobStateError(
            f"job {job.id} is {job.status.value}; only a finished job (completed, cancelled "
            "or failed) can be exported"
        )
    storage = Storage.for_job(job, settings)
    shards = _shards(storage, job.id)
    if not shards:
        raise JobStateError(
            f"job {job.id} {job.status.value} before it stored any input; it has no output"
        )
    return storage, shards


def _write_files(
    job: Job,
    storage: Storage,
    shards: list[_Shard],
    target: Storage,
    directory: str,
    counts: ExportCounts,
) -> None:
    """A reader never sees, and a failed export never leaves, a truncated file under a final
    name: on a filesystem the files are written under temporary names (unique, for exports
    running side by side) and renamed once complete; on an object store, which cannot rename,
    each is uploaded under its final name, where it appears whole when the upload completes,
    and deleted again when the export fails."""
    final = [posixpath.join(directory, name) for name in (OUTPUT_NAME, ERRORS_NAME)]
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    names = final
    if not target.is_object_store:
        names = [posixpath.join(directory, f".{posixpath.basename(p)}.{token}.tmp") for p in final]
    target.makedirs(directory)
    lines = _LineMaker(job)
    # Every input line is in one of the two files once the job has ended: the lines a cancelled
    # or expired batch never ran are error lines, with OpenAI's codes for each.
    not_run_line = {
        JobStatus.EXPIRED: lines.expired,
        JobStatus.CANCELLED: lines.cancelled,
    }.get(job.status)
    try:
        with _text_output(target, names[0]) as output, _text_output(target, names[1]) as errors:
            for kind, row in _job_rows(storage, shards):
                if row["status"] == _NOT_RUN:
                    counts.not_run += 1
                    if not_run_line is not None:
                        _write(errors, not_run_line(row))
                        counts.errors += 1
                elif row["status"] == "ok":
                    _write(output, lines.ok(kind, row))
                    counts.output += 1
                else:
                    _write(errors, lines.error(kind, row))
                    counts.errors += 1
        for name, path in zip(names, final):
            if name != path:
                target.fs.move(name, path)
    except BaseException:
        for name in names:
            target.delete(name)
        raise


def _text_output(target: Storage, path: str) -> TextIO:
    stream = target.fs.open_output_stream(path, compression=None, buffer_size=_WRITE_BUFFER)
    return io.TextIOWrapper(stream, encoding="utf-8", newline="\n")


def _write(out: TextIO, line: dict[str, Any]) -> None:
    out.write(json.dumps(line, ensure_ascii=False, allow_nan=False))
    out.write("\n")


# -- reading rows in line order, a shard at a time -------------------------------------------


@dataclass
class _Shard:
    input_path: str
    parts: list[str]


def _shards(storage: Storage, job_id: str) -> list[_Shard]:
    """The job's input shards in order, each with its output part files."""
    out_dir = storage.output_dir(job_id)
    parts: dict[int, list[str]] = {}
    for name in list_parts(storage, out_dir):
        parts.setdefault(shard_of_part(name), []).append(posixpath.join(out_dir, name))
    return [_Shard(path, parts.get(index, [])) for index, path in storage.input_shards(job_id)]


def _job_rows(storage: Storage, shards: list[_Shard]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind, output row) per input line, in line order; a line that never ran gets a row
    with status _NOT_RUN (its line and custom_id only)."""
    with ExternalSort([("line", "ascending")], memory_bytes=_SORT_BYTES) as in_order:
        for shard in shards:
            in_order.add(_shard_table(storage, shard))
        for table in in_order.sorted_tables():
            for batch in table.to_batches(max_chunksize=_BATCH_ROWS):
                for row in batch.to_pylist():
                    yield _with_input(row)


def _with_input(row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An output row with what its stored input row tells the export (its kind first)."""
    kind, settings, inputs = row.pop(_KIND), row.pop(_SETTINGS), row.pop(_INPUTS)
    stored_id = row.pop(_STORED_ID)
    if row["status"] is None:  # no output row: the line never ran
        return kind, {"line": row["line"], "custom_id": stored_id, "status": _NOT_RUN}
    if kind == "chat" and is_responses(settings):
        kind = "responses"  # a /v1/responses line, answered with a Response
        row["settings"] = settings
    elif kind == "score":  # its body needs its shape and a rerank its documents
        row["settings"], row["inputs"] = settings, inputs
    elif kind == "invalid":  # the code validation stored with it (input/formats/rows.py)
        row["invalid_code"] = refusal_code(settings)
    return kind, row


def _shard_table(storage: Storage, shard: _Shard) -> pa.Table:
    """One output row per stored input row of the shard (a null row where the line never
    ran), with the input row's kind, settings, inputs and custom_id beside it. Read through
    the contract's schema, so part files of schema version 1 read with the newer columns
    null. A shard's lines are not a range of the file (input/shards.py places them by prompt):
    rows are matched by line, not merged in order."""
    with storage.fs.open_input_file(shard.input_path) as src:
        stored = pq.read_table(src, columns=["line", "kind", "custom_id", "sampling", "inputs"])
    output = _unique_lines(_read_parts(storage, shard.parts))
    taken = output.take(pc.index_in(stored.column("line"), value_set=output.column("line")))
    taken = taken.set_column(taken.schema.get_field_index("line"), "line", stored.column("line"))
    for name, column in (
        (_KIND, "kind"),
        (_STORED_ID, "custom_id"),
        (_SETTINGS, "sampling"),
        (_INPUTS, "inputs"),
    ):
        taken = taken.append_column(name, stored.column(column))
    return taken


def _read_parts(storage: Storage, parts: list[str]) -> pa.Table:
    if not parts:
        return OUTPUT_SCHEMA.empty_table()
    import pyarrow.dataset as ds  # imports pandas: only where a dataset is read

    return ds.dataset(
        parts, schema=OUTPUT_SCHEMA, filesystem=storage.fs, format="parquet"
    ).to_table()


def _unique_lines(rows: pa.Table) -> pa.Table:
    """One row per line: a part file no checkpoint records (its worker died before the
    commit) is deleted when a job completes, but may stay in a job that was cancelled or
    failed meanwhile; both rows answer the same request, the first is kept."""
    if rows.num_rows < 2:
        return rows
    rows = rows.take(pc.sort_indices(rows, [("line", "ascending")]))
    lines = rows.column("line")
    first = pc.not_equal(lines.slice(1), lines.slice(0, len(lines) - 1))
    keep = pa.concat_arrays([pa.array([True]), first.combine_chunks()])
    return rows.filter(keep)


# -- OpenAI lines ------------------------------------------------------------------------------


class _LineMaker:
    """Builds one job's lines. Ids are derived from the job id and line number, so exporting
    again gives the same files."""

    def __init__(self, job: Job) -> None:
        self.job_id, self.model = job.id, job.model
        self.created = _epoch(job.finished_at or job.created_at)

    def _id(self, prefix: str, line: int) -> str:
        digest = hashlib.blake2b(f"{self.job_id}/{line}/{prefix}".encode(), digest_size=12)
        return prefix + digest.hexdigest()

    def _line(self, row: dict[str, Any], response: Any, error: Any) -> dict[str, Any]:
        return {
            "id": self._id("batch_req_", row["line"]),
            "custom_id": row["custom_id"],
            "response": response,
            "error": error,
        }

    def _response(self, row: dict[str, Any], status_code: int, body: Any) -> dict[str, Any]:
        return {
            "status_code": status_code,
            "request_id": self._id("req_", row["line"]),
            "body": body,
        }

    def ok(self, kind: str, row: dict[str, Any]) -> dict[str, Any]:
        model = row["adapter"] or self.model  # vLLM's server answers with the LoRA's name
        if kind == "embed":
            body = _embedding_body(row, model)
        elif kind == "score":
            body = score_body(
                row, model, self.created, lambda prefix: self._id(prefix, row["line"])
            )
        elif kind == "classify":
            body = classify_body(row, model, self.created, self._id("classify-", row["line"]))
        elif kind == "responses":
            body = response_body(
                row, model, self.created, lambda prefix: self._id(prefix, row["line"])
            )
        else:
            prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
            endpoint = CHAT_COMPLETIONS if kind == "chat" else COMPLETIONS
            body = {
                "id": self._id(prefix, row["line"]),
                "object": endpoint.response_object,
                "created": self.created,
                "model": model,
                "choices": _choices(row, chat=kind == "chat"),
                "usage": _usage(row),
            }
        return self._line(row, self._response(row, 200, body), None)

    def expired(self, row: dict[str, Any]) -> dict[str, Any]:
        """A line an expired batch never ran, as OpenAI reports it."""
        return self._line(
            row,
            None,
            {
                "code": "batch_expired",
                "message": "This request could not be executed before the completion window "
                "expired.",
            },
        )

    def cancelled(self, row: dict[str, Any]) -> dict[str, Any]:
        """A line a cancelled batch never ran."""
        return self._line(
            row,
            None,
            {
                "code": "cancelled",
                "message": "This request was not executed: the batch was cancelled first.",
            },
        )

    def error(self, kind: str, row: dict[str, Any]) -> dict[str, Any]:
        message = row["error"] or "the request failed"
        if kind == "invalid":
            # Refused at validation: OpenAI answers such a request with HTTP 400.
            body = _invalid_body(message, row.get("invalid_code"))
            return self._line(row, self._response(row, 400, body), None)
        # Accepted but failed when run: OpenAI's shape for a request that got no response.
        # The row's own code (schema version 3), or read from the wording of older rows.
        code = code_of(row.get("error_code"), message)
        return self._line(row, None, {"code": code, "message": message})


def _epoch(moment: datetime) -> int:
    return int(moment.timestamp())


def _invalid_code(stored: str | None, message: str) -> str:
    """An invalid line's code: the one validation stored, else read from its first problem's
    wording (the param names the first problem too)."""
    if stored:
        return stored
    first = message.split("; ")[0]
    return next((code for text, code in _INVALID_CODES_BY_WORDING if text in first), INVALID_VALUE)


def _invalid_body(stored: str, code: str | None) -> dict[str, Any]:
    """OpenAI's error body from the stored reason `field 'x': message` and code. A field of the
    OpenAI form is stored as `body.x`; OpenAI names the parameter inside the body: `x`."""
    match = _FIELD_PREFIX.match(stored)
    param = match[1].removeprefix("body.") if match else None
    message = stored[match.end() :] if match else stored
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": _invalid_code(code, message),
        }
    }


def _samples(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every sample of a row: the `choices` column when n > 1, else the row itself."""
    if row["choices"]:
        return list(row["choices"])
    return [
        {
            "index": 0,
            "text": row["text"],
            "finish_reason": row["finish_reason"],
            "completion_tokens": row["completion_tokens"],
            "logprobs": row["logprobs"],
        }
    ]


def _choices(row: dict[str, Any], *, chat: bool) -> list[dict[str, Any]]:
    choices = []
    for sample in _samples(row):
        text, tokens = sample["text"] or "", sample["logprobs"]
        choice: dict[str, Any] = {"index": sample["index"]}
        if chat and not row["choices"]:  # one sample: the row's thinking and tool calls too
            choice["message"] = chat_message(row)
            choice["logprobs"] = _chat_logprobs(tokens) if tokens is not None else None
        elif chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = _chat_logprobs(tokens) if tokens is not None else None
        else:
            choice["text"] = text
            choice["logprobs"] = _completion_logprobs(tokens) if tokens is not None else None
        choice["finish_reason"] = sample["finish_reason"]
        choices.append(choice)
    return choices


def _usage(row: dict[str, Any]) -> dict[str, Any]:
    prompt = row["prompt_tokens"] or 0
    completion = sum(s["completion_tokens"] or 0 for s in _samples(row))
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    details = completion_details(row)
    if details is not None:
        usage["completion_tokens_details"] = details
    return usage


def _logprob(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else _VERY_UNLIKELY


def _chat_token(token: str | None, logprob: float | None) -> dict[str, Any]:
    text = token or ""
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}


def _chat_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat form: per generated token its text, log probability, UTF-8 bytes and the top
    alternatives in the same form."""
    return {
        "content": [
            {
                **_chat_token(t["token"], t["logprob"]),
                "top_logprobs": [
                    _chat_token(a["token"], a["logprob"]) for a in t["top_logprobs"] or []
                ],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def _completion_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """Completions form: parallel lists, the alternatives as {token: logprob}, and each token's
    character offset in the generated text (vLLM's, without echo: from 0)."""
    texts = [t["token"] or "" for t in tokens]
    return {
        "tokens": texts,
        "token_logprobs": [_logprob(t["logprob"]) for t in tokens],
        "top_logprobs": [
            {a["token"] or "": _logprob(a["logprob"]) for a in t["top_logprobs"] or []}
            for t in tokens
        ],
        "text_offset": [0, *accumulate(len(text) for text in texts)][: len(texts)],
    }


def _embedding_body(row: dict[str, Any], model: str) -> dict[str, Any]:
    vectors = row["embeddings"] if row["embeddings"] is not None else [row["embedding"]]
    prompt = row["prompt_tokens"] or 0
    return {
        "object": EMBEDDINGS.response_object,
        "data": [
            {"object": "embedding", "index": i, "embedding": vector}
            for i, vector in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    }
