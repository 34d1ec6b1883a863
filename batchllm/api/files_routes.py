"""/v1/files: upload (streamed to storage, limits enforced while it streams), list, get,
content, delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Form, Request, UploadFile
from fastapi.responses import StreamingResponse
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchllm.api import files
from batchllm.api.auth import current_owner
from batchllm.api.errors import ApiError, check_limit, not_found
from batchllm.api.objects import file_object, page
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import StoredFile

router = APIRouter()
_CHUNK = 1 << 20
_MAX_FILENAME = 512  # the files.filename column: PostgreSQL refuses a longer one
# Control characters in a name end up in logs, terminals and Content-Disposition headers.
_CONTROL = {chr(c) for c in range(32)} | {"\x7f"}


async def one_file_part(request: Request) -> None:
    """FastAPI dependency: an upload with two `file` parts would keep the last one silently."""
    form = await request.form()  # already parsed (and cached) for the route's parameters
    if len(form.getlist("file")) > 1:
        raise ApiError(400, "one `file` part per upload", param="file", code="invalid_value")


@router.post("/v1/files", dependencies=[Depends(one_file_part)])
def upload(
    request: Request,
    file: UploadFile,
    purpose: str = Form(...),
    owner: str = Depends(current_owner),
) -> dict[str, Any]:
    settings = request.app.state.settings
    if purpose != "batch":
        raise ApiError(
            400,
            f"purpose {purpose!r}: only 'batch' is supported",
            param="purpose",
            code="invalid_value",
        )
    filename = _checked_filename(file.filename)
    with session_scope(settings) as session:
        stored = session.scalar(
            select(func.coalesce(func.sum(StoredFile.bytes), 0)).where(
                StoredFile.owner == owner, StoredFile.purpose == "batch"
            )
        )
    room = settings.api_max_stored_bytes - stored
    if room <= 0:
        raise _storage_full(settings.api_max_stored_bytes)
    storage = Storage.of(settings)

    def chunks():
        while True:
            chunk = file.file.read(_CHUNK)
            if not chunk:
                return
            yield chunk

    try:
        file_id, path, size, lines = files.store_upload(
            storage,
            chunks(),
            max_bytes=min(settings.api_max_file_bytes, room),
            max_lines=settings.api_max_file_lines,
        )
    except files.FileTooLarge as exc:
        if exc.over_bytes and room < settings.api_max_file_bytes:
            raise _storage_full(settings.api_max_stored_bytes) from None
        raise ApiError(413, f"{exc}; nothing was kept", code="file_too_large") from None
    row = StoredFile(
        id=file_id,
        owner=owner,
        filename=filename,
        purpose=purpose,
        bytes=size,
        lines=lines,
        path=path,
    )
    with session_scope(settings) as session:
        session.add(row)
        session.flush()
        return file_object(row)


def _checked_filename(name: str | None) -> str:
    if not name:
        return "upload.jsonl"
    if len(name) > _MAX_FILENAME or _CONTROL.intersection(name):
        raise ApiError(
            400,
            f"the file name must be at most {_MAX_FILENAME} characters, without control characters",
            param="file",
            code="invalid_value",
        )
    return name


def _storage_full(limit: int) -> ApiError:
    return ApiError(
        429,
        f"this API key's uploaded files would take over {limit:,} bytes "
        "(BATCHLLM_API_MAX_STORED_BYTES): delete files to make room; nothing was kept",
        code="storage_quota_exceeded",
    )


@router.get("/v1/files")
def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = 10_000,
    after: str | None = None,
    owner: str = Depends(current_owner),
) -> dict[str, Any]:
    """Newest first, in cursor pages as OpenAI's (`limit` up to 10,000, `after` an id)."""
    check_limit(limit, 10_000)
    with session_scope(request.app.state.settings) as session:
        cursor = None if after is None else owned_file(session, after, owner)
        rows = files.list_files(session, owner, purpose, after=cursor, limit=limit + 1)
        return page(rows, limit, file_object)


def owned_file(session: Session, file_id: str, owner: str) -> StoredFile:
    """The file, or 404 alike when it does not exist and when another key owns it."""
    row = files.get_file(session, owner, file_id)
    if row is None:
        raise not_found("file", file_id)
    return row


@router.get("/v1/files/{file_id}")
def get_file(request: Request, file_id: str, owner: str = Depends(current_owner)) -> dict[str, Any]:
    with session_scope(request.app.state.settings) as session:
        return file_object(owned_file(session, file_id, owner))


@router.get("/v1/files/{file_id}/content")
def file_content(
    request: Request, file_id: str, owner: str = Depends(current_owner)
) -> StreamingResponse:
    settings = request.app.state.settings
    with session_scope(settings) as session:
        row = owned_file(session, file_id, owner)
        path = row.path
    try:
        # Opened before the answer starts: a stored copy gone missing is an error status, not
        # a 200 whose body breaks off.
        chunks = files.read_chunks(Storage.of(settings), path)
    except FileNotFoundError:
        raise content_missing(file_id) from None
    return StreamingResponse(chunks, media_type="application/octet-stream")


def content_missing(file_id: str) -> ApiError:
    return ApiError(
        404,
        f"The stored content of file '{file_id}' is missing; upload it again.",
        code="file_content_missing",
    )


@router.delete("/v1/files/{file_id}")
def delete_file(
    request: Request, file_id: str, owner: str = Depends(current_owner)
) -> dict[str, Any]:
    settings = request.app.state.settings
    with session_scope(settings) as session:
        row = owned_file(session, file_id, owner)
        path = row.path
        session.delete(row)
    Storage.of(settings).delete(path)
    return {"id": file_id, "object": "file", "deleted": True}
