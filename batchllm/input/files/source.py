"""A job's input file, resolved once where it comes in.

The front doors (the CLI's FILE, the Client and the pipeline files it runs, the Batch API,
`batchllm bench`'s workload files) turn what they were given (a local path, or a URI such as
s3://bucket/prompts.jsonl) into an InputSource: checked to be a readable file, its format read
off its name, its name as errors give it and as the job records it, the S3 endpoint it is read
through. Everything below (jobs/, job_spec, store/service, input/shards, lines, validate,
table) takes the InputSource and asks none of that again; tests/unit/test_layering.py fails
when a module below the front doors calls resolve_input.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from batchllm.errors import InputError
from batchllm.storage import filesystem_for, is_uri

TABLE_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
_STREAM_BUFFER = 4 << 20  # bytes per ranged read of an input URI


@dataclass(frozen=True, slots=True)
class InputSource:
    """A readable input file. `name`: the URI, or the path as given (how errors name it);
    `recorded`: the URI, or the absolute path (how a job records it); `format`: "jsonl",
    "parquet" or "csv"; `s3_endpoint`: the S3-compatible server of an s3:// URI ("": AWS)."""

    name: str
    recorded: str
    uri: bool
    format: str
    s3_endpoint: str

    def __str__(self) -> str:
        return self.name

    @property
    def table_format(self) -> str | None:
        """ "parquet" or "csv"; None for a JSONL file."""
        return None if self.format == "jsonl" else self.format

    @property
    def local_path(self) -> Path:
        assert not self.uri, f"{self.name} is a URI"
        return Path(self.name)

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        """The URI's filesystem and the path on it."""
        return filesystem_for(self.name, s3_endpoint=self.s3_endpoint)

    @contextmanager
    def open(self) -> Iterator[BinaryIO]:
        """The file opened for reading from its start; a URI is streamed with buffered ranged
        reads, never copied whole. Reading it twice (custom_ids.py) means opening it twice."""
        if not self.uri:
            with self.local_path.open("rb") as handle:
                yield handle
            return
        fs, path = self.filesystem()
        # compression=None: bytes as they are stored, as for a local file (no .gz guessing).
        with (
            fs.open_input_stream(path, compression=None) as stream,
            io.BufferedReader(stream, _STREAM_BUFFER) as handle,
        ):
            yield handle


def resolve_input(source: str | Path | InputSource, *, s3_endpoint: str) -> InputSource:
    """`source` as an InputSource (one already resolved is returned as it is); InputError,
    naming it, when it is missing or a directory (on an object store: a key prefix), or the
    store cannot be asked. Done before anything is created for a job (no job row, no engine)."""
    if isinstance(source, InputSource):
        return source
    if is_uri(source):
        uri = str(source)
        try:
            fs, path = filesystem_for(uri, s3_endpoint=s3_endpoint)
            kind = fs.get_file_info(path).type
        except (OSError, ValueError) as exc:  # pyarrow: ArrowIOError, ArrowInvalid
            raise InputError(f"{uri}: cannot read: {exc}") from exc
        if kind == pafs.FileType.Directory:
            raise InputError(f"{uri}: is a directory, not an input file")
        if kind != pafs.FileType.File:
            raise InputError(f"{uri}: no such file")
        return InputSource(uri, uri, True, _format(urlsplit(uri).path), s3_endpoint)
    local = Path(source)
    if local.is_dir():
        raise InputError(f"{local}: is a directory, not an input file")
    if not local.is_file():
        raise InputError(f"{local}: no such file")
    return InputSource(str(local), str(local.resolve()), False, _format(str(local)), s3_endpoint)


def _format(name: str) -> str:
    return TABLE_FORMATS.get(PurePosixPath(name).suffix.lower(), "jsonl")
