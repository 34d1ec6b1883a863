"""/v1/batches: create, retrieve, list (cursor pages), cancel, delete (batchllm's extension);
and /v1/models."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from batchllm.api import batches, keys
from batchllm.api.auth import current_owner
from batchllm.api.errors import ApiError, check_limit, not_found
from batchllm.api.files_routes import content_missing, owned_file
from batchllm.api.objects import batch_object, page
from batchllm.errors import BatchLLMError, JobNotFound, JobStateError
from batchllm.input.endpoints import URLS
from batchllm.input.schemas import PRIORITIES
from batchllm.input.unicode_text import UNENCODABLE, unencodable_field
from batchllm.jobs.retry import retry_job
from batchllm.jobs.submit import submit_job
from batchllm.output.deletion import delete_job
from batchllm.storage import Storage
from batchllm.store import recovery, service
from batchllm.store.db import session_scope
from batchllm.store.models import Batch, Job, job_id_of, utcnow

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


@router.post("/v1/batches")
def create_batch(
    request: Request, body: CreateBatch, owner: str = Depends(current_owner)
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
        models, errors = batches.scan_batch_file(
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
    unserved = request.app.state.served.refusal(model)
    if unserved is not None:
        raise ApiError(400, unserved, param="body.model", code="model_not_found")

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
        )

    try:
        job = submit_job(
            storage.display(stored.path),  # a URI on an object store, which the reader opens
            batches.spec_for(model, body.endpoint, metadata, settings),
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
    return _render(settings, owner, job.id)


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
    """The batch as OpenAI's object, read in one session: a poll is the request a server
    answers most (it cost three sessions and six statements, a third of them for expiry and
    for other jobs' cancels)."""
    with session_scope(settings) as session:
        batch = _owned_batch(session, batch_id, owner)
        job = batch.job
        due = not expiry_checked and _past_window(job)
        unwritten = job.status.is_final and batch.output_file_id is None and job.request_total
        if not due and not unwritten:
            return batch_object(batch, job)
        session.expunge_all()
    if due:
        # Read at the moment it is asked for: a batch past its window is expired now, whether
        # or not the server's own round (every BATCHLLM_RECONCILE_SECONDS) has come since.
        _expire_now(settings, [job.id])
    else:
        batches.write_result_files(settings, batch, job)
    return _render(settings, owner, batch_id, expiry_checked=True)


def _past_window(job: Job) -> bool:
    """Unfinished and past its completion window: what expiry ends (store/recovery.py)."""
    return not job.status.is_final and job.expires_at is not None and job.expires_at < utcnow()


def _expire_now(settings, job_ids: list[str]) -> None:
    with session_scope(settings) as session:
        for job_id in job_ids:
            recovery.expire_jobs(session, settings.lease_seconds, job_id)


@router.get("/v1/batches/{batch_id}")
def retrieve_batch(
    request: Request, batch_id: str, owner: str = Depends(current_owner)
) -> dict[str, Any]:
    return _render(request.app.state.settings, owner, batch_id)


@router.get("/v1/batches")
def list_batches(
    request: Request,
    response: Response,
    limit: int = 20,
    after: str | None = None,
    owner: str = Depends(current_owner),
) -> dict[str, Any]:
    check_limit(limit, 100)
    settings = request.app.state.settings
    page_of_batches = _list_page(settings, owner, limit, after, response)
    if page_of_batches is None:  # a batch on it was past its window: read once it has ended
        page_of_batches = _list_page(settings, owner, limit, after, response, expire=False)
    assert page_of_batches is not None
    return page_of_batches


def _list_page(
    settings, owner: str, limit: int, after: str | None, response: Response, *, expire=True
) -> dict[str, Any] | None:
    """A page of the owner's batches, newest first; None when a batch on it was past its
    window and `expire`: it is expired now, and the page is to be read again."""
    with session_scope(settings) as session:
        query = (
            select(Batch)
            .where(Batch.owner == owner)
            .order_by(Batch.created_at.desc(), Batch.job_id.desc())
            # The page's jobs in one query, not one per batch (measured: 25 statements).
            .options(selectinload(Batch.job))
        )
        if after is not None:
            cursor = _owned_batch(session, after, owner)
            query = query.where(
                (Batch.created_at < cursor.created_at)
                | ((Batch.created_at == cursor.created_at) & (Batch.job_id < cursor.job_id))
            )
        rows = list(session.scalars(query.limit(limit + 1)))
        due = [batch.job_id for batch in rows if _past_window(batch.job)]
        if due and expire:
            session.rollback()
            _expire_now(settings, due)
            return None
        # The key's enqueued work against its quota, for a client pacing its creates.
        response.headers[ENQUEUED_HEADER] = str(batches.enqueued_rows(session, owner))
        response.headers[f"{ENQUEUED_HEADER}-limit"] = str(settings.api_max_enqueued_rows)
        return page(rows, limit, lambda b: batch_object(b, b.job))


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
