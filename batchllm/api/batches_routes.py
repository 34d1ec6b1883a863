"""/v1/batches: create, retrieve, list (cursor pages), cancel, delete (batchllm's extension);
and /v1/models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import bindparam, select

from batchllm.api import batches, enqueued, keys
from batchllm.api.auth import current_owner
from batchllm.api.errors import ApiError, check_limit, not_found
from batchllm.api.files_routes import content_missing, owned_file
from batchllm.api.objects import BATCH_BY_ID, batch_object, batch_rows, page
from batchllm.api.polls import on_poll_threads
from batchllm.errors import BatchLLMError, JobNotFound, JobStateError
from batchllm.input.files.source import resolve_input
from batchllm.input.formats.unicode_text import UNENCODABLE, unencodable_field
from batchllm.input.parsing.endpoints import URLS
from batchllm.jobs.retry import retry_job
from batchllm.jobs.submit import submit_job
from batchllm.output.deletion import delete_job
from batchllm.spec import PRIORITIES
from batchllm.storage import Storage
from batchllm.store import recovery, service
from batchllm.store.db import read_connection, session_scope
from batchllm.store.models import Batch, job_id_of, utcnow

router = APIRouter()
_MAX_METADATA = 16


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer SDK fields (e.g. output_expires_after)

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _check_request(body: CreateBatch) -> dict[str, str]:
    unencodable = unencodable_field(body.model_dump())
    if unencodable is not None:  # JSON allows a lone surrogate; no response could echo it
        raise ApiError(
            400, f"{unencodable}: {UNENCODABLE}", param=unencodable, code="invalid_value"
        )
    if body.endpoint not in URLS:
        raise ApiError(
            400,
            f"endpoint {body.endpoint!r}: one of {', '.join(URLS)}",
            param="endpoint",
            code="invalid_value",
        )
    if batches.window_seconds(body.completion_window) is None:
        raise ApiError(
            400,
            f"completion_window {body.completion_window!r}: 24h, or a shorter window such "
            "as 1h, 30m, 90s",
            param="completion_window",
            code="invalid_value",
        )
    metadata = body.metadata or {}
    if len(metadata) > _MAX_METADATA or any(
        len(k) > 64 or len(v) > 512 for k, v in metadata.items()
    ):
        raise ApiError(
            400,
            "metadata: at most 16 pairs, keys up to 64 and values up to 512 characters",
            param="metadata",
            code="invalid_value",
        )
    if metadata.get("priority", "normal") not in PRIORITIES:
        raise ApiError(
            400,
            f"metadata.priority {metadata['priority']!r}: one of {', '.join(PRIORITIES)}",
            param="metadata.priority",
            code="invalid_value",
        )
    return metadata


ENQUEUED_HEADER = "x-batchllm-enqueued-rows"
# The key's enqueued prompt tokens per model (a JSON object) and its limit per model.
TOKENS_HEADER = "x-batchllm-enqueued-tokens"


@router.post("/v1/batches")
def create_batch(
    request: Request, response: Response, body: CreateBatch, owner: str = Depends(current_owner)
) -> dict[str, Any]:
    settings = request.app.state.settings
    metadata = _check_request(body)
    with session_scope(settings) as session:
        stored = owned_file(session, body.input_file_id, owner)
        session.expunge(stored)
        # Refused here before any work; the count that holds is taken with the insert.
        batches.check_active_batches(session, owner, settings.api_max_active_batches)
        batches.check_enqueued_rows(session, owner, stored.lines, settings.api_max_enqueued_rows)
        notify = keys.webhook_of(session, owner)
    storage = Storage.of(settings)
    try:
        models, errors, prompt_tokens = batches.scan_batch_file(
            storage, stored.path, body.endpoint, settings.max_line_bytes
        )
    except FileNotFoundError:
        raise content_missing(stored.id) from None
    if not models:
        raise ApiError(
            400,
            "no line of the file names a model (body.model)",
            param="input_file_id",
            code="missing_model",
        )
    if len(models) > 1:
        errors += batches.mixed_model_errors(storage, stored.path, models, settings.max_line_bytes)
    # The first model the file names: the one the model_mismatch errors hold the others to.
    model = models[0]
    if errors:
        return _refused(settings, owner, stored, model, body, metadata, errors, notify)
    unserved = request.app.state.served.refusal(model)
    if unserved is not None:
        raise ApiError(400, unserved, param="body.model", code="model_not_found")
    # As OpenAI: a batch over the key's enqueued-token limit is created, and failed with the
    # error (not refused 429, which the openai SDK would send again twice and a client written
    # for OpenAI does not expect). The count that holds is taken with the insert.
    with session_scope(settings) as session:
        limit = enqueued.token_limit(session, owner, settings)
        over = enqueued.over_token_limit(session, owner, model, prompt_tokens, limit)
    if over is not None:
        return _refused(settings, owner, stored, model, body, metadata, [over], notify)
    job_id = _submit(settings, owner, stored, model, body, metadata, prompt_tokens, notify)
    _token_headers(settings, owner, response, model)
    return _render(settings, owner, job_id)


def _refused(settings, owner, stored, model, body, metadata, errors, notify) -> dict[str, Any]:
    """A batch failed as a whole at create (its errors listed), as OpenAI's validation fails
    one."""
    job_id = batches.refuse_batch(
        settings,
        stored,
        model,
        body.endpoint,
        metadata,
        errors,
        owner=owner,
        window=body.completion_window,
        notify=notify,
    )
    return _render(settings, owner, job_id)


def _submit(settings, owner, stored, model, body, metadata, prompt_tokens, notify) -> str:
    """Submit the batch's job, its batch recorded (and the quotas counted under their lock)
    before its first task goes out; the job's id. A batch over the token limit by then is
    recorded failed, as a batch refused early is (its id then)."""
    recording: list[str] = []

    def record(job_id: str) -> None:
        recording.append(job_id)
        batches.record_batch(
            settings,
            job_id,
            owner=owner,
            endpoint=body.endpoint,
            window=body.completion_window,
            input_file_id=stored.id,
            max_active=settings.api_max_active_batches,
            lines=stored.lines,
            tokens=(model, prompt_tokens),
        )

    try:
        spec = batches.spec_for(model, body.endpoint, metadata, settings)
        source = resolve_input(
            Storage.of(settings).display(stored.path),  # a URI on an object store
            s3_endpoint=settings.resolved_s3_endpoint,
        )
        job = submit_job(
            source,
            spec,
            settings=settings,
            expires_at=batches.expiry(body.completion_window),
            before_dispatch=record,
            notify=notify,
        )
    except BatchLLMError as exc:
        raise ApiError(503, str(exc), code="service_unavailable") from None
    except batches.QuotaExceeded:  # when recorded: concurrent creates took the last slot
        if recording:
            batches.drop_unrecorded(settings, recording[0])
        raise
    except enqueued.TokenLimitExceeded as over:  # the same race, for the room in tokens
        # Failed as a batch refused early is (no lines, no files), not a job with shards that
        # never ran: the job made is dropped and the failed batch recorded in its place.
        batches.drop_unrecorded(settings, recording[0])
        return batches.refuse_batch(
            settings,
            stored,
            model,
            body.endpoint,
            metadata,
            [over.error],
            owner=owner,
            window=body.completion_window,
            notify=notify,
        )
    return job.id


def _token_headers(settings, owner: str, response: Response, model: str | None = None) -> None:
    """The key's enqueued prompt tokens against its limit: for `model` (a created batch's), or
    per model as a JSON object (a list), for a client pacing its creates."""
    with session_scope(settings) as session:
        limit = enqueued.token_limit(session, owner, settings)
        if model is None:
            by_model = enqueued.enqueued_tokens_by_model(session, owner)
            response.headers[TOKENS_HEADER] = json.dumps(by_model, separators=(",", ":"))
        else:
            response.headers[TOKENS_HEADER] = str(enqueued.enqueued_tokens(session, owner, model))
    response.headers[f"{TOKENS_HEADER}-limit"] = str(limit)


def _owned_batch(session, batch_id: str, owner: str) -> Batch:
    """The batch by its id (`batch_...`) or its job's (`job_...`), or 404 alike when it does
    not exist and when another key owns it."""
    batch = session.get(Batch, job_id_of(batch_id))
    if batch is None or batch.owner != owner:
        raise not_found("batch", batch_id)
    return batch


@contextmanager
def _refused_as(code: str) -> Iterator[None]:
    """A JobStateError (the batch's state refuses the change) as OpenAI's 409, with `code`."""
    try:
        yield
    except JobStateError as exc:
        raise ApiError(409, str(exc), code=code) from None


def _render(settings, owner: str, batch_id: str, *, expiry_checked: bool = False) -> dict[str, Any]:
    """The batch (by its id or its job's) as OpenAI's object, read in one session and one
    statement of columns: a poll is the request a server answers most (it cost three sessions
    and six statements, a third of them for expiry and for other jobs' cancels)."""
    job_id = job_id_of(batch_id)
    with read_connection(settings) as connection:
        row = connection.execute(BATCH_BY_ID, {"job_id": job_id}).one_or_none()
        if row is None or row.owner != owner:
            raise not_found("batch", batch_id)
        due = not expiry_checked and _past_window(row)
        unwritten = row.status.is_final and row.output_file_id is None and row.request_total
        if not due and not unwritten:
            return batch_object(row, row)
    if due:
        # Read at the moment it is asked for: a batch past its window is expired now, whether
        # or not the server's own round (every BATCHLLM_RECONCILE_SECONDS) has come since.
        _expire_now(settings, [job_id])
    else:  # once per batch: its job ended and its files are not written yet
        with session_scope(settings) as session:
            batch = _owned_batch(session, job_id, owner)
            job = batch.job
            session.expunge_all()
        batches.write_result_files(settings, batch, job)
    return _render(settings, owner, batch_id, expiry_checked=True)


def _past_window(job: Any) -> bool:
    """Unfinished and past its completion window: what expiry ends (store/recovery.py)."""
    return not job.status.is_final and job.expires_at is not None and job.expires_at < utcnow()


def _expire_now(settings, job_ids: list[str]) -> None:
    with session_scope(settings) as session:
        for job_id in job_ids:
            recovery.expire_jobs(session, settings.lease_seconds, job_id)


# The two routes a polling client calls answer JSONResponse themselves: FastAPI's check of a
# returned dict against the route's annotation (pydantic, per request) was 7% of a polled
# server's CPU, for objects that are plain JSON already.
# Both run on the poll threads (api/polls.py), apart from the other routes' request threads.
@router.get("/v1/batches/{batch_id}", response_model=None)
async def retrieve_batch(
    request: Request, batch_id: str, owner: str = Depends(current_owner)
) -> JSONResponse:
    settings = request.app.state.settings
    return JSONResponse(await on_poll_threads(request, _render, settings, owner, batch_id))


@router.get("/v1/batches", response_model=None)
async def list_batches(
    request: Request,
    limit: int = 20,
    after: str | None = None,
    owner: str = Depends(current_owner),
) -> JSONResponse:
    check_limit(limit, 100)
    settings = request.app.state.settings
    headers: dict[str, str] = {}
    page_of_batches = await on_poll_threads(
        request, _read_page, settings, owner, limit, after, headers
    )
    return JSONResponse(page_of_batches, headers=headers)


def _read_page(
    settings, owner: str, limit: int, after: str | None, headers: dict[str, str]
) -> dict[str, Any]:
    page_of_batches = _list_page(settings, owner, limit, after, headers)
    if page_of_batches is None:  # a batch on it was past its window: read once it has ended
        page_of_batches = _list_page(settings, owner, limit, after, headers, expire=False)
    assert page_of_batches is not None
    return page_of_batches


# A page of a key's batches, newest first: the statements built once and bound per request
# (building them cost more than running them).
_PAGE = (
    batch_rows()
    .where(Batch.owner == bindparam("owner"))
    .order_by(Batch.created_at.desc(), Batch.job_id.desc())
    .limit(bindparam("limit"))
)
_PAGE_AFTER = _PAGE.where(
    (Batch.created_at < bindparam("created_at"))
    | ((Batch.created_at == bindparam("created_at")) & (Batch.job_id < bindparam("job_id")))
)
_CURSOR = select(Batch.created_at, Batch.job_id).where(
    Batch.job_id == bindparam("job_id"), Batch.owner == bindparam("owner")
)


def _list_page(
    settings, owner: str, limit: int, after: str | None, headers: dict[str, str], *, expire=True
) -> dict[str, Any] | None:
    """A page of the owner's batches, newest first, and its `headers`; None when a batch on it
    was past its window and `expire`: it is expired now, and the page is to be read again."""
    with read_connection(settings) as connection:
        values: dict[str, Any] = {"owner": owner, "limit": limit + 1}
        query = _PAGE
        if after is not None:
            cursor = connection.execute(
                _CURSOR, {"job_id": job_id_of(after), "owner": owner}
            ).one_or_none()
            if cursor is None:
                raise not_found("batch", after)
            query = _PAGE_AFTER
            values.update(created_at=cursor.created_at, job_id=cursor.job_id)
        rows = list(connection.execute(query, values))
        due = [row.job_id for row in rows if _past_window(row)]
        if due and expire:
            connection.rollback()
            _expire_now(settings, due)
            return None
        # The key's enqueued work against its quota, for a client pacing its creates.
        headers[ENQUEUED_HEADER] = str(enqueued.enqueued_rows(connection, owner))
        headers[f"{ENQUEUED_HEADER}-limit"] = str(settings.api_max_enqueued_rows)
        by_model = enqueued.enqueued_tokens_by_model(connection, owner)
        headers[TOKENS_HEADER] = json.dumps(by_model, separators=(",", ":"))
        headers[f"{TOKENS_HEADER}-limit"] = str(enqueued.token_limit(connection, owner, settings))
        return page(rows, limit, lambda row: batch_object(row, row))


@router.post("/v1/batches/{batch_id}/cancel")
def cancel_batch(
    request: Request, batch_id: str, owner: str = Depends(current_owner)
) -> dict[str, Any]:
    settings = request.app.state.settings
    job_id = job_id_of(batch_id)
    with session_scope(settings) as session:
        _owned_batch(session, job_id, owner)
        with _refused_as("batch_not_cancellable"):
            service.cancel_job(session, job_id, lease_seconds=settings.lease_seconds)
    return _render(settings, owner, job_id)


@router.post("/v1/batches/{batch_id}/retry")
def retry_batch(
    request: Request, batch_id: str, owner: str = Depends(current_owner)
) -> dict[str, Any]:
    """batchllm's extension: run an ended batch's unanswered lines and engine failures again
    on the fleet, into the same batch (`batchllm retry`). Its output and error files are
    written again when the retry ends."""
    settings = request.app.state.settings
    job_id = job_id_of(batch_id)
    with session_scope(settings) as session:
        batch = _owned_batch(session, job_id, owner)
        # Before the retry starts, so its end can never be read with the old files (a refused
        # retry only makes the next read write the same files again).
        batch.output_file_id = batch.error_file_id = None
    with _refused_as("batch_not_retryable"):
        retry_job(job_id, settings=settings)
    return _render(settings, owner, job_id)


@router.delete("/v1/batches/{batch_id}")
def delete_batch(
    request: Request, batch_id: str, owner: str = Depends(current_owner)
) -> dict[str, Any]:
    """batchllm's extension (OpenAI has no such route): delete an ended batch, its job's
    rows and files and its output and error files; 409 while it runs (cancel it first)."""
    settings = request.app.state.settings
    with session_scope(settings) as session:
        deleted = _owned_batch(session, batch_id, owner).batch_id
    try:
        with _refused_as("batch_not_deletable"):
            delete_job(settings, job_id_of(batch_id))
    except JobNotFound:  # deleted meanwhile
        raise not_found("batch", batch_id) from None
    return {"id": deleted, "object": "batch.deleted", "deleted": True}


@router.get("/v1/models")
def list_models(request: Request, owner: str = Depends(current_owner)) -> dict[str, Any]:
    """The models a batch may name: those BATCHLLM_SERVED_MODELS lists, those of live workers
    and those served within BATCHLLM_SERVED_MODEL_RETENTION_SECONDS (api/served.py)."""
    served = request.app.state.served.names()
    return {
        "object": "list",
        "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "batchllm"}
            for model in sorted(served)
        ],
    }
