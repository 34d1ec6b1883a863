"""/v1/files: upload (streamed to storage, limits enforced while it streams), list, get,
content, delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Form, Request, UploadFile
from fastapi.responses import StreamingResponse

from batchllm.api.auth import current_owner
from batchllm.api.errors import ApiError, not_found
from batchllm.api.objects import file_object, page
from batchllm.jobs import files
from batchllm.jobs.db import session_scope
from batchllm.jobs.models import StoredFile
from batchllm.jobs.storage import Storage

router = APIRouter()
_CHUNK = 1 << 20
# Multipart framing around the file: a Content-Length this far over the limit is refused
# before a byte is read.
_FRAMING = 64 * 1024


@router.post("/v1/files")
def upload(
    request: Request,
    file: UploadFile,
    purpose: str = Form(...),
    owner: str = Depends(current_owner),
) -> dict[str, Any]:
    settings = request.app.state.settings
    if purpose != "batch":
        raise ApiError(400, f"purpose {purpose!r}: only 'batch' is supported", param="purpose")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > settings.api_max_file_bytes + _FRAMING:
        raise ApiError(413, _too_large(settings.api_max_file_bytes), code="file_too_large")
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
            max_bytes=settings.api_max_file_bytes,
            max_lines=settings.api_max_file_lines,
        )
    except files.FileTooLarge as exc:
        raise ApiError(413, f"{exc}; nothing was kept", code="file_too_large") from None
    row = StoredFile(
        id=file_id,
        owner=owner,
        filename=file.filename or "upload.jsonl",
        purpose=purpose,
        bytes=size,
        lines=lines,
        path=path,
    )
    with session_scope(settings) as session:
        session.add(row)
        session.flush()
        return file_object(row)


def _too_large(limit: int) -> str:
    return f"the file is over the limit of {limit:,} bytes (BATCHLLM_API_MAX_FILE_BYTES)"


@router.get("/v1/files")
def list_files(
    request: Request, purpose: str | None = None, owner: str = Depends(current_owner)
) -> dict[str, Any]:
    with session_scope(request.app.state.settings) as session:
        rows = files.list_files(session, owner, purpose)
        return page([file_object(r) for r in rows], has_more=False)


@router.get("/v1/files/{file_id}")
def get_file(request: Request, file_id: str, owner: str = Depends(current_owner)) -> dict[str, Any]:
    with session_scope(request.app.state.settings) as session:
        row = files.get_file(session, owner, file_id)
        if row is None:
            raise not_found("file", file_id)
        return file_object(row)


@router.get("/v1/files/{file_id}/content")
def file_content(
    request: Request, file_id: str, owner: str = Depends(current_owner)
) -> StreamingResponse:
    settings = request.app.state.settings
    with session_scope(settings) as session:
        row = files.get_file(session, owner, file_id)
        if row is None:
            raise not_found("file", file_id)
        path = row.path
    storage = Storage.of(settings)
    return StreamingResponse(
        files.read_chunks(storage, path), media_type="application/octet-stream"
    )


@router.delete("/v1/files/{file_id}")
def delete_file(
    request: Request, file_id: str, owner: str = Depends(current_owner)
) -> dict[str, Any]:
    settings = request.app.state.settings
    with session_scope(settings) as session:
        row = files.get_file(session, owner, file_id)
        if row is None:
            raise not_found("file", file_id)
        path = row.path
        session.delete(row)
    Storage.of(settings).delete(path)
    return {"id": file_id, "object": "file", "deleted": True}
