"""LoRA adapters of a job: copied into the job's storage when the job is created, so every
fleet worker loads them from the paths the job recorded, on demand, with no restart and no
copy of its own on each node."""

from __future__ import annotations

import posixpath
from pathlib import Path

import pyarrow.fs as pafs

from batchllm.errors import InputError
from batchllm.storage import Storage

CONFIG_NAME = "adapter_config.json"


def store_adapters(storage: Storage, job_id: str, adapters: dict[str, str]) -> dict[str, str]:
    """Copy each adapter directory (a PEFT adapter: adapter_config.json and its weights)
    under the job's storage; returns name -> stored path. InputError naming the flag when a
    directory is not an adapter."""
    stored = {}
    for name, source in adapters.items():
        directory = Path(source).expanduser()
        if not (directory / CONFIG_NAME).is_file():
            raise InputError(
                f"--lora {name}={source}: not a LoRA adapter directory (no {CONFIG_NAME})"
            )
        target = posixpath.join(storage.job_dir(job_id), "adapters", name)
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            relative = path.relative_to(directory).as_posix()
            destination = posixpath.join(target, relative)
            storage.makedirs(posixpath.dirname(destination))
            storage.write_bytes(destination, path.read_bytes())
        stored[name] = target
    return stored


def local_adapter_path(storage: Storage, path: str) -> str:
    """The filesystem path vLLM loads an adapter from: the stored path itself on local or
    shared-filesystem storage."""
    if not isinstance(storage.fs, pafs.LocalFileSystem):
        raise InputError(
            f"LoRA adapter {path}: adapters need the job storage on a local or shared "
            "filesystem (BATCHLLM_STORAGE), which vLLM reads them from"
        )
    return path
