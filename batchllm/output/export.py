"""Copying a finished job's output dataset to a place the user chose (`run --output`)."""

from __future__ import annotations

import posixpath
from pathlib import Path

from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store.models import Job


def copy_output(job: Job, destination: Path, *, settings: Settings) -> None:
    storage = Storage.for_job(job, settings)
    source = storage.output_dir(job.id)
    destination.mkdir(parents=True, exist_ok=True)
    for name in storage.listdir(source):
        if name.startswith("."):
            continue
        (destination / name).write_bytes(storage.read_bytes(posixpath.join(source, name)))
