"""Creating a batch: the file is checked for what the Batch API requires of a whole batch (one
model, every line for the batch's endpoint), then submitted as a job; its output and error
files are written once it ends."""

from __future__ import annotations

import json
import posixpath
import re
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from batchllm.api import enqueued, files
from batchllm.api.errors import ApiError
from batchllm.input.files.lines import iter_lines
from batchllm.input.formats.unicode_text import may_hold_surrogates, unencodable_field
from batchllm.input.job_spec import build_job_spec
from batchllm.input.parsing.endpoints import batch_task
from batchllm.jobs.create import record_refused_job
from batchllm.output.deletion import delete_job
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store import state_machine
from batchllm.store.db import session_scope
from batchllm.store.locks import lock_name
from batchllm.store.models import Batch, Job, StoredFile, utcnow
from batchllm.store.webhooks import WebhookTarget

# OpenAI accepts only "24h". Shorter windows are accepted too (a deadline for a batch that is
# only worth running soon; the tests expire batches in seconds), longer ones are not: a batch
# holds its input and the fleet's attention for at most a day, as on OpenAI. ASCII digits only
# (\d would take Arabic-Indic digits), and fullmatch (a "$" would take "24h\n").
_WINDOW = re.compile(r"([1-9][0-9]{0,4})([hms])", re.ASCII)
_UNITS = {"h": 3600, "m": 60, "s": 1}
MAX_WINDOW_SECONDS = 24 * 3600
_MAX_LISTED = 100  # batch-level validation errors listed, as lines
# custom_ids are echoed in every output line and kept in the error file: a bounded length, as
# for the other strings the API stores.
MAX_CUSTOM_ID = 512


def window_seconds(window: str) -> int | None:
    """'24h', '1h', '30m' or '90s' in seconds; None when it is not such a window, or one over
    24 hours."""
    match = _WINDOW.fullmatch(window)
    if not match:
        return None
    seconds = int(match[1]) * _UNITS[match[2]]
    return seconds if seconds <= MAX_WINDOW_SECONDS else None


def scan_batch_file(
    storage: Storage, path: str, endpoint: str, max_line_bytes: int
) -> tuple[list[str], list[dict], int]:
    """The models the file's lines name, in the order they first appear (the batch's model is
    the first), batch-level errors (OpenAI's BatchError shape): lines for another endpoint,
    and the lines' prompt tokens as estimated for the enqueued-token limit (api/enqueued.py).
    Lines that do not parse are left to per-line validation, which turns them into error lines
    of the batch's error file."""
    models: dict[str, None] = {}  # insertion-ordered
    errors: list[dict[str, Any]] = []
    prompt_tokens = 0
    with files.open_stored(storage, path) as handle:
        for line in iter_lines(handle, max_line_bytes):
            obj = _decoded(line.raw)
            if not isinstance(obj, dict):
                continue
            custom_id = obj.get("custom_id")
            if (
                isinstance(custom_id, str)
                and len(custom_id) > MAX_CUSTOM_ID
                and len(errors) < _MAX_LISTED
            ):
                errors.append(
                    {
                        "code": "invalid_custom_id",
                        "message": f"the line's custom_id is {len(custom_id):,} characters "
                        f"long; at most {MAX_CUSTOM_ID}",
                        "param": "custom_id",
                        "line": line.number,
                    }
                )
            url = obj.get("url")
            if url is not None and url != endpoint and len(errors) < _MAX_LISTED:
                errors.append(
                    {
                        "code": "invalid_url",
                        "message": f"the line's url {url!r} is not the batch's endpoint "
                        f"{endpoint!r}",
                        "param": "url",
                        "line": line.number,
                    }
                )
            body = obj.get("body")
            prompt_tokens += enqueued.estimate_prompt_tokens(body)
            model = body.get("model") if isinstance(body, dict) else None
            if isinstance(model, str) and model:
                models.setdefault(model)
    return list(models), errors, prompt_tokens


def mixed_model_errors(
    storage: Storage, path: str, models: list[str], max_line_bytes: int
) -> list[dict]:
    """The lines naming another model than the first one the file names."""
    first: str | None = None
    errors: list[dict[str, Any]] = []
    with files.open_stored(storage, path) as handle:
        for line in iter_lines(handle, max_line_bytes):
            obj = _decoded(line.raw)
            body = obj.get("body") if isinstance(obj, dict) else None
            model = body.get("model") if isinstance(body, dict) else None
            if not isinstance(model, str) or not model:
                continue
            if first is None:
                first = model
            elif model != first and len(errors) < _MAX_LISTED:
                errors.append(
                    {
                        "code": "model_mismatch",
                        "message": f"the line names model {model!r}; this batch's lines name "
                        f"{first!r} (one model per batch)",
                        "param": "body.model",
                        "line": line.number,
                    }
                )
    return errors


def _decoded(raw: bytes | None) -> Any:
    """A line's JSON, or None when it does not parse: per-line validation makes such lines
    error lines. RecursionError: JSON nested deeper than Python's stack (a line of 100,000
    `[`)."""
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if may_hold_surrogates(raw) and unencodable_field(obj) is not None:
        return None  # text no UTF-8 encoder takes: validation refuses the line, naming the field
    return obj


def spec_for(model: str, endpoint: str, metadata: dict[str, str], settings: Settings) -> JobSpec:
    # Score and rerank batches embed (an embedding model, input/formats/scoring.py); a
    # cross-encoder's asks for classify in its metadata.
    task = batch_task(endpoint, metadata.get("task"))
    # OpenAI's batch has no priority field, nor output parsers: the metadata keys
    # `priority`, `reasoning_parser`, `tool_call_parser` (and `task`) set them.
    return build_job_spec(
        model,
        settings=settings,
        metadata=metadata,
        task=task,
        priority=metadata.get("priority", "normal"),
        reasoning_parser=metadata.get("reasoning_parser") or None,
        tool_call_parser=metadata.get("tool_call_parser") or None,
    )


def record_batch(
    settings: Settings,
    job_id: str,
    *,
    owner: str,
    endpoint: str,
    window: str,
    input_file_id: str,
    errors: list[dict[str, Any]] | None = None,
    max_active: int | None = None,
    lines: int = 0,
    tokens: tuple[str, int] | None = None,
) -> None:
    """Record the job's batch. With `max_active`, the owner's unfinished batches, enqueued
    lines (the settings' quota; `lines`: this batch's) and enqueued prompt tokens of the
    batch's model (`tokens`: the model and this batch's estimate, reserved on its job) are
    counted and the batch inserted under one lock (QuotaExceeded when over the first two,
    enqueued.TokenLimitExceeded over the third): counted apart, 30 concurrent creates with a
    quota of 3 had 15-27 accepted."""
    with session_scope(settings) as session:
        if max_active is not None or tokens is not None:
            lock_name(session, f"batch-quota:{owner}")
        if max_active is not None:
            check_active_batches(session, owner, max_active)
            check_enqueued_rows(session, owner, lines, settings.api_max_enqueued_rows)
        if tokens is not None:
            model, estimate = tokens
            # Exact when the job's sizing pass tokenized every prompt before its first task
            # (jobs/create.py records it; a job released while validating has none yet).
            counted = session.scalar(select(Job.prompt_tokens_estimate).where(Job.id == job_id))
            estimate = counted if counted is not None else estimate
            limit = enqueued.token_limit(session, owner, settings)
            over = enqueued.over_token_limit(session, owner, model, estimate, limit)
            if over is not None:
                raise enqueued.TokenLimitExceeded(over)
            session.execute(
                update(Job)
                .where(Job.id == job_id, Job.prompt_tokens_estimate.is_(None))
                .values(prompt_tokens_estimate=estimate)
            )
        session.add(
            Batch(
                job_id=job_id,
                owner=owner,
                # Read in the INSERT itself: no round trip more under the quota's lock.
                model=select(Job.model).where(Job.id == job_id).scalar_subquery(),
                endpoint=endpoint,
                completion_window=window,
                input_file_id=input_file_id,
                errors=errors,
            )
        )


class QuotaExceeded(ApiError):
    """A 429 for a key at its unfinished-batch quota."""


def active_batches(session: Session, owner: str) -> int:
    """How many batches `owner` has unfinished (the BATCHLLM_API_MAX_ACTIVE_BATCHES count)."""
    active = session.scalar(
        select(func.count()).select_from(Job).where(*enqueued.unfinished_of(owner))
    )
    return int(active or 0)


def check_active_batches(session: Session, owner: str, limit: int) -> None:
    """QuotaExceeded when `owner` has `limit` unfinished batches."""
    active = active_batches(session, owner)
    if active >= limit:
        raise QuotaExceeded(
            429,
            f"this API key has {active:,} unfinished batches, the most it may have "
            "(BATCHLLM_API_MAX_ACTIVE_BATCHES): wait for one to end, or cancel one",
            code="batch_quota_exceeded",
        )


def check_enqueued_rows(session: Session, owner: str, adding: int, limit: int) -> None:
    """QuotaExceeded when `adding` more lines would take `owner` over its enqueued quota."""
    enqueued_now = enqueued.enqueued_rows(session, owner)
    if enqueued_now + adding > limit:
        raise QuotaExceeded(
            429,
            f"this batch's {adding:,} request lines and the {enqueued_now:,} this API key has "
            f"enqueued in unfinished batches exceed its quota of {limit:,} lines "
            "(BATCHLLM_API_MAX_ENQUEUED_ROWS): wait for batches to finish, or cancel one",
            code="enqueued_rows_quota_exceeded",
        )


def drop_unrecorded(settings: Settings, job_id: str) -> None:
    """End and delete a job whose batch was refused when it came to be recorded (its tasks
    were never sent): the refused create leaves nothing behind."""
    with session_scope(settings) as session:
        state_machine.fail_job(session, job_id, "its batch was refused (quota)")
    delete_job(settings, job_id)


def expiry(window: str) -> datetime:
    seconds = window_seconds(window)
    assert seconds is not None
    return utcnow() + timedelta(seconds=seconds)


def refuse_batch(
    settings: Settings,
    file: StoredFile,
    model: str,
    endpoint: str,
    metadata: dict[str, str],
    errors: list[dict[str, Any]],
    *,
    owner: str,
    window: str,
    notify: WebhookTarget | None = None,
) -> str:
    """Record a batch that failed validation as a whole (status failed, its errors listed)."""
    summary = (
        f"{len(errors)} line(s) failed batch validation, e.g. line {errors[0]['line']}: "
        + (errors[0]["message"])
        if errors[0].get("line") is not None
        else errors[0]["message"]  # the whole batch's error: token_limit_exceeded
    )
    job_id = record_refused_job(
        Storage.of(settings).display(file.path),
        spec_for(model, endpoint, metadata, settings),
        summary,
        settings=settings,
        notify=notify,
    )
    record_batch(
        settings,
        job_id,
        owner=owner,
        endpoint=endpoint,
        window=window,
        input_file_id=file.id,
        errors=errors,
    )
    return job_id


def write_result_files(settings: Settings, batch: Batch, job: Job) -> tuple[str, str]:
    """Export an ended batch's output and error files into the job storage (a directory or a
    bucket) under files/, once: the ids are derived from the batch id, so a second caller finds
    them; and record them as files of its owner."""
    from batchllm.output.openai_files import export_openai_to

    storage = Storage.of(settings)
    directory = storage.batch_results_dir(job.id)
    counts = export_openai_to(job, storage, directory, settings=settings)
    made = [
        StoredFile(
            id=f"file-{job.id.removeprefix('job_')}-{kind}",
            owner=batch.owner,
            filename=f"{batch.batch_id}_{posixpath.basename(path)}",
            purpose="batch_output",
            bytes=storage.fs.get_file_info(path).size,
            lines=lines,  # one JSON object per line
            path=path,
        )
        for kind, path, lines in (
            ("output", str(counts.output_path), counts.output),
            ("errors", str(counts.errors_path), counts.errors),
        )
    ]
    with session_scope(settings) as session:
        for row in made:
            session.merge(row)
        stored = session.get(Batch, job.id)
        if stored is not None:
            stored.output_file_id, stored.error_file_id = made[0].id, made[1].id
    return made[0].id, made[1].id
