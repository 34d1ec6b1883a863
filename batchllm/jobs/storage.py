"""Job files behind one filesystem abstraction (pyarrow.fs), so the fleet can share a network
path today and object storage later without touching the callers.

Layout under the storage root:
  <job_id>/input/shard-00000.parquet     validated input rows of shard 0
  <job_id>/output/part-s00000-a001-00000.parquet   finished rows, one file per checkpoint
  <job_id>/output/_manifest.json, _SUCCESS
"""

from __future__ import annotations

import posixpath
from pathlib import Path

import pyarrow.fs as pafs


class Storage:
    def __init__(self, root: str) -> None:
        if "://" in root:
            self.fs, self.root = pafs.FileSystem.from_uri(root)
            self._uri_prefix = root[: root.index("://") + 3]
        else:
            self.fs, self.root = pafs.LocalFileSystem(), str(Path(root).expanduser().resolve())
            self._uri_prefix = ""
        self.root = self.root.rstrip("/") or "/"

    def job_dir(self, job_id: str) -> str:
        return posixpath.join(self.root, job_id)

    def input_dir(self, job_id: str) -> str:
        return posixpath.join(self.job_dir(job_id), "input")

    def output_dir(self, job_id: str) -> str:
        return posixpath.join(self.job_dir(job_id), "output")

    def display(self, path: str) -> str:
        """The path as a user passes it to a reader (a URI for remote stores)."""
        return path if not self._uri_prefix else self._uri_prefix + path.lstrip("/")

    def makedirs(self, path: str) -> None:
        self.fs.create_dir(path, recursive=True)

    def exists(self, path: str) -> bool:
        return bool(self.fs.get_file_info(path).type != pafs.FileType.NotFound)

    def listdir(self, path: str) -> list[str]:
        if not self.exists(path):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(path, recursive=False))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.File)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write through a temporary name and rename, so readers never see half a file."""
        tmp = posixpath.join(posixpath.dirname(path), "." + posixpath.basename(path) + ".tmp")
        with self.fs.open_output_stream(tmp) as out:
            out.write(data)
        self.fs.move(tmp, path)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as src:
            return bytes(src.read())

    def delete(self, path: str) -> None:
        if self.exists(path):
            self.fs.delete_file(path)
