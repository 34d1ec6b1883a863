"""Job files behind one filesystem abstraction (pyarrow.fs): a local path, a network path the
fleet shares, or object storage (`s3://bucket/prefix`, AWS S3 or an S3-compatible store such as
MinIO), without touching the callers.

Layout under the storage root:
  <job_id>/input/shard-00000.parquet     validated input rows of shard 0
  <job_id>/output/part-s00000-a001-00000.parquet   finished rows, one file per checkpoint
  <job_id>/output/_manifest.json, _SUCCESS
  <job_id>/input/tokens-00000.parquet, <job_id>/adapters/   token ids, LoRA adapters
  files/<file_id>.jsonl, files/<job_id>-results/   the Batch API's uploads and result files

S3 filesystems are built here only (`filesystem_for`): the endpoint from BATCHLLM_S3_ENDPOINT,
everything else (credentials, region, AWS_ENDPOINT_URL) read by pyarrow's AWS SDK itself from
the standard AWS variables, or given as pyarrow's URI options (`?region=...`).
"""

from __future__ import annotations

import errno
import functools
import posixpath
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit

import pyarrow.fs as pafs

from batchllm.errors import BatchLLMError

if TYPE_CHECKING:
    from batchllm.settings import Settings

# Stores without a rename: an object is written whole under its final name (a PUT, or a
# multipart upload completed at close, is atomic: readers see all of it or nothing).
_OBJECT_STORES = frozenset({"s3", "gcs", "abfs"})


def is_uri(source: str | Path) -> bool:
    """Whether `source` names a file through a filesystem URI (s3://bucket/key) rather than a
    local path. A Path never does: Path("s3://b/k") has already lost the second slash."""
    return isinstance(source, str) and "://" in source


def endpoint_options(endpoint: str) -> dict[str, str]:
    """pyarrow's S3 options for an endpoint URL: `http://host:port` -> endpoint_override
    host:port, scheme http; without a scheme, https (as pyarrow's default)."""
    endpoint = endpoint.strip()
    if "://" not in endpoint:
        return {"endpoint_override": endpoint.rstrip("/")}
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BatchLLMError(
            f"BATCHLLM_S3_ENDPOINT={endpoint!r}: expected http://host:port or https://host:port"
        )
    if parts.path.strip("/"):
        raise BatchLLMError(
            f"BATCHLLM_S3_ENDPOINT={endpoint!r}: give the server only (no path); the bucket "
            "goes in BATCHLLM_STORAGE (s3://bucket/prefix)"
        )
    return {"endpoint_override": parts.netloc, "scheme": parts.scheme}


def filesystem_for(uri: str, *, s3_endpoint: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a URI and the path inside it. For s3://, `s3_endpoint` names
    an S3-compatible server (the caller's BATCHLLM_S3_ENDPOINT setting; "": none, AWS), unless
    the URI gives its own `endpoint_override`; filesystems are built once per bucket and
    options."""
    parts = urlsplit(uri)
    if parts.scheme != "s3":
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, str(path)
    query = dict(parse_qsl(parts.query))
    if s3_endpoint and "endpoint_override" not in query:
        query.update(endpoint_options(s3_endpoint))
    bucket = parts.netloc.rpartition("@")[2]
    if not bucket:
        raise BatchLLMError(f"{uri}: no bucket (expected s3://bucket/prefix)")
    path = posixpath.join(bucket, parts.path.strip("/")).rstrip("/")
    return _s3_filesystem(parts.netloc, urlencode(sorted(query.items()))), path


def s3_bucket_filesystem(bucket: str, *, s3_endpoint: str) -> pafs.FileSystem:
    """The S3 filesystem of a bucket named by a tenant (an image's), on the deployment's
    endpoint (`s3_endpoint`; "": AWS) and with no other options: unlike `filesystem_for`, no
    query or user part of a URI can choose the server, scheme or credentials."""
    if not bucket or any(c in bucket for c in "/?#@:%"):
        raise BatchLLMError(f"{bucket!r} is not a bucket name")
    options = endpoint_options(s3_endpoint) if s3_endpoint else {}
    return _s3_filesystem(bucket, urlencode(sorted(options.items())))


@functools.lru_cache(maxsize=16)
def _s3_filesystem(netloc: str, query: str) -> pafs.FileSystem:
    """One S3 filesystem per bucket and options: building one starts an AWS client and, for
    AWS without a region, looks the bucket's region up over the network."""
    uri = f"s3://{netloc}" + (f"?{query}" if query else "")
    return pafs.FileSystem.from_uri(uri)[0]


_SHARD_PREFIX = "shard-"
_SHARD_NAME = re.compile(r"shard-(\d+)\.parquet")


# Errors that say the storage is away for now (a network fault, an overloaded or failing S3
# endpoint, a full disk), not that a shard's data or a request is wrong. pyarrow raises a plain
# OSError for S3 and names the cause in its message (AWS's error code, or the HTTP status).
_OUTAGE_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)
_OUTAGE_MARKERS = re.compile(
    r"NETWORK_CONNECTION|SLOW_DOWN|SERVICE_UNAVAILABLE|INTERNAL_FAILURE|REQUEST_TIMEOUT|"
    r"THROTTLING|HTTP status 5\d\d|curlCode|Could not connect|Connection reset"
)


def storage_unavailable(exc: BaseException) -> bool:
    """True when `exc` (or an error it was raised from) says the storage is unavailable for a
    while, which waiting cures; False for an error that would recur."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ConnectionError | TimeoutError):
            return True
        if isinstance(error, OSError) and (
            error.errno in _OUTAGE_ERRNOS or _OUTAGE_MARKERS.search(str(error))
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def token_file_of(shard_path: str) -> str:
    """The token ids file beside an input shard (`.../shard-00003.parquet` ->
    `.../tokens-00003.parquet`)."""
    folder, name = posixpath.split(shard_path)
    return posixpath.join(folder, "tokens-" + name.removeprefix(_SHARD_PREFIX))


class StoredJob(Protocol):
    """What `Storage.for_job` needs of a job (store/models.py's Job)."""

    @property
    def storage_root(self) -> str: ...


class Storage:
    """The job storage at `root`: a local path or a URI; `s3_endpoint` as for
    `filesystem_for` ("": AWS), which an s3:// root must be given (the storage that settings
    name comes from `of` or `for_job`, on their endpoint)."""

    def __init__(self, root: str, *, s3_endpoint: str | None = None) -> None:
        if "://" in root:
            if s3_endpoint is None:
                if root.lower().startswith("s3://"):
                    # Never the environment's: the caller's settings say which server.
                    raise ValueError(f"{root}: an s3:// storage needs its s3_endpoint")
                s3_endpoint = ""  # not used off S3
            self.fs, self.root = filesystem_for(root, s3_endpoint=s3_endpoint)
            self._uri_prefix = root[: root.index("://") + 3]
        else:
            self.fs, self.root = pafs.LocalFileSystem(), str(Path(root).expanduser().resolve())
            self._uri_prefix = ""
        self.root = self.root.rstrip("/") or "/"
        # No rename on an object store: write_bytes puts objects under their final name.
        self.is_object_store = self.fs.type_name in _OBJECT_STORES

    @classmethod
    def of(cls, settings: Settings) -> Storage:
        """The job storage these settings name, on their S3 endpoint if they give one."""
        return cls(settings.resolved_storage, s3_endpoint=settings.resolved_s3_endpoint)

    @classmethod
    def for_job(cls, job: StoredJob, settings: Settings) -> Storage:
        """The storage a job was created in: the root recorded on the job (settings changed
        since do not move its files), on these settings' S3 endpoint. Every reader and writer
        of an existing job's files comes through here."""
        return cls(job.storage_root, s3_endpoint=settings.resolved_s3_endpoint)

    def job_dir(self, job_id: str) -> str:
        return posixpath.join(self.root, job_id)

    def input_dir(self, job_id: str) -> str:
        return posixpath.join(self.job_dir(job_id), "input")

    def input_shard(self, job_id: str, index: int) -> str:
        """Where validation stores the job's input shard `index` (the one place that names
        input shards and their token files: `input_shards`, `token_file_of`)."""
        return posixpath.join(self.input_dir(job_id), f"{_SHARD_PREFIX}{index:05d}.parquet")

    def input_shards(self, job_id: str) -> list[tuple[int, str]]:
        """The job's stored input shards, (index, path) in index order."""
        directory = self.input_dir(job_id)
        found = []
        for name in self.listdir(directory):
            match = _SHARD_NAME.fullmatch(name)
            if match:
                found.append((int(match[1]), posixpath.join(directory, name)))
        return sorted(found)

    def output_dir(self, job_id: str) -> str:
        return posixpath.join(self.job_dir(job_id), "output")

    def batch_results_dir(self, job_id: str) -> str:
        """Where the Batch API writes a batch's output and error files."""
        return posixpath.join(self.root, "files", f"{job_id}-results")

    def display(self, path: str) -> str:
        """The path as a user passes it to a reader (a URI for remote stores)."""
        return path if not self._uri_prefix else self._uri_prefix + path.lstrip("/")

    def makedirs(self, path: str) -> None:
        """A directory; on an object store, where directories are only key prefixes, pyarrow
        checks the bucket and leaves empty marker objects."""
        self.fs.create_dir(path, recursive=True)

    def exists(self, path: str) -> bool:
        """Whether a file or directory is there (on an object store: an object or a prefix)."""
        return bool(self.fs.get_file_info(path).type != pafs.FileType.NotFound)

    def listdir(self, path: str) -> list[str]:
        """The names of the files directly in `path` (on an object store: the objects right
        under the prefix), sorted; [] when there is none."""
        if not self.exists(path):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(path, recursive=False))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.File)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a whole file so that readers never see half of it: on a filesystem through a
        temporary name and a rename; on an object store straight under its final name, where
        the upload appears whole when it completes (a "move" there would copy and delete)."""
        if self.is_object_store:
            with self.fs.open_output_stream(path) as out:
                out.write(data)
            return
        # A name of its own per write: two workers may write the same file at once (both
        # sizing one job's prompts); each rename is whole, the last one wins.
        unique = f".{posixpath.basename(path)}.{uuid.uuid4().hex[:12]}.tmp"
        tmp = posixpath.join(posixpath.dirname(path), unique)
        with self.fs.open_output_stream(tmp) as out:
            out.write(data)
        self.fs.move(tmp, path)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as src:
            return bytes(src.read())

    def delete(self, path: str) -> None:
        if self.exists(path):
            self.fs.delete_file(path)

    def delete_tree(self, path: str) -> bool:
        """Delete a directory and everything in it (on an object store: every object under
        the prefix); False when there was nothing."""
        if not self.exists(path):
            return False
        self.fs.delete_dir(path)
        return True
