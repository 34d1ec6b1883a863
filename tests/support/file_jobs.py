"""A job from a local file in one call, as the CLI makes one: the path resolved where it comes in
(tests/support/inputs.source_of, with the test's settings), then run here or created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchllm.jobs.create import CreatedJob, create_job
from batchllm.jobs.local import run_job
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.store.models import Job
from tests.support.inputs import source_of


def run_file(path: str | Path, spec: JobSpec, settings: Settings, **options: Any) -> Job:
    """`run_job` on the file at `path` (options: engines=..., and the rest run_job takes)."""
    return run_job(source_of(path, settings), spec, settings=settings, **options)


def create_from_file(
    path: str | Path, spec: JobSpec, settings: Settings, **options: Any
) -> CreatedJob:
    """`create_job` from the file at `path` (options: shard_size=..., and the rest it takes)."""
    return create_job(source_of(path, settings), spec, settings=settings, **options)
