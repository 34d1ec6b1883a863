"""Files of the Batch API (`/v1/files`): uploads streamed into the job storage under
`files/<id>`, and the output and error files batches write there. Rows in the `files` table
say who owns each one and where it is: a path in the job storage's filesystem (a local path,
or `bucket/key` on S3), which `Storage.display` turns into what a reader opens."""

from __future__ import annotations

import io
import posixpath
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchllm.errors import BatchLLMError
from batchllm.storage import Storage
from batchllm.store.models import StoredFile

_CHUNK = 1 << 20


class FileTooLarge(BatchLLMError):
    """An upload over the byte or line limit; nothing of it is kept."""

    def __init__(self, message: str, *, over_bytes: bool) -> None:
        super().__init__(message)
        self.over_bytes = over_bytes


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def file_path(storage: Storage, file_id: str) -> str:
    return posixpath.join(storage.root, "files", file_id + ".jsonl")


def store_upload(
    storage: Storage,
    chunks: Iterable[bytes],
    *,
    max_bytes: int,
    max_lines: int,
) -> tuple[str, str, int, int]:
    """Stream `chunks` into a new file in the storage, counting bytes and lines as they pass;
    FileTooLarge (and the partial file deleted) as soon as a limit is crossed. Returns
    (file id, path, bytes, lines)."""
    file_id = new_file_id()
    path = file_path(storage, file_id)
    storage.makedirs(posixpath.dirname(path))
    size = lines = 0
    last = b"\n"
    try:
        with storage.fs.open_output_stream(path) as out:
            for chunk in chunks:
                if not chunk:
                    continue
                size += len(chunk)
                lines += chunk.count(b"\n")
                last = chunk[-1:]
                if size > max_bytes:
                    raise FileTooLarge(
                        f"the file is over the limit of {max_bytes:,} bytes", over_bytes=True
                    )
                if lines > max_lines:
                    raise FileTooLarge(f"the file has over {max_lines:,} lines", over_bytes=False)
                out.write(chunk)
        if last != b"\n":  # a last line without its newline still counts
            lines += 1
            if lines > max_lines:
                raise FileTooLarge(f"the file has over {max_lines:,} lines", over_bytes=False)
    except BaseException:
        storage.delete(path)
        raise
    return file_id, path, size, lines


@contextmanager
def open_stored(storage: Storage, path: str) -> Iterator[BinaryIO]:
    """A stored file opened for reading, buffered: reading it line by line stays cheap on an
    object store too (ranged reads of _CHUNK bytes)."""
    with (
        storage.fs.open_input_stream(path, compression=None) as stream,
        io.BufferedReader(stream, _CHUNK) as handle,
    ):
        yield handle


def read_chunks(storage: Storage, path: str) -> Iterator[bytes]:
    """A stored file's bytes, a chunk at a time (for a streamed download). The file is opened
    now, so a missing one raises FileNotFoundError here rather than once the bytes flow."""
    src = storage.fs.open_input_stream(path)

    def chunks() -> Iterator[bytes]:
        with src:
            while True:
                chunk = src.read(_CHUNK)
                if not chunk:
                    return
                yield bytes(chunk)

    return chunks()


def get_file(session: Session, owner: str, file_id: str) -> StoredFile | None:
    """The file if it exists and `owner` owns it: another tenant's id looks like no file."""
    row = session.get(StoredFile, file_id)
    return row if row is not None and row.owner == owner else None


def list_files(
    session: Session,
    owner: str,
    purpose: str | None = None,
    *,
    after: StoredFile | None = None,
    limit: int | None = None,
) -> list[StoredFile]:
    """The owner's files, newest first; `after` one of them: those listed after it."""
    query = select(StoredFile).where(StoredFile.owner == owner)
    if purpose:
        query = query.where(StoredFile.purpose == purpose)
    if after is not None:
        query = query.where(
            (StoredFile.created_at < after.created_at)
            | ((StoredFile.created_at == after.created_at) & (StoredFile.id < after.id))
        )
    query = query.order_by(StoredFile.created_at.desc(), StoredFile.id.desc()).limit(limit)
    return list(session.scalars(query))
