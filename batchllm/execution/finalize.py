"""Finalizing a job, done exactly once by whoever ended its last shard: the manifest,
`_SUCCESS`, and the throughput figures."""

from __future__ import annotations

import logging

from batchllm.output import commit
from batchllm.output.parts import OUTPUT_SCHEMA, write_manifest
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store import state_machine
from batchllm.store.db import session_scope
from batchllm.store.job_view import job_view
from batchllm.store.models import Job

log = logging.getLogger(__name__)


def finalize_job(
    job_id: str,
    *,
    settings: Settings,
    hardware: str | None,
    vllm_version: str | None,
) -> bool:
    """Complete a `finalizing` job; False when it was not (another worker finished it).
    hardware/vllm_version None: keep what the job recorded at its first engine step."""
    with session_scope(settings) as session:
        job = state_machine.complete_job(
            session, job_id, hardware=hardware, vllm_version=vllm_version
        )
        if job is None:
            return False
        storage = Storage.for_job(job, settings)
        commit.tidy_unrecorded_parts(session, storage, job_id)
        # The manifest is written before the commit: a crash in between leaves the job
        # `finalizing` and the redelivered shard task finalizes it again.
        write_manifest(storage, storage.output_dir(job_id), manifest_of(job))
    log.info(
        "job %s completed: %d ok, %d failed, %.1f output tokens/s",
        job_id,
        job.request_completed,
        job.request_failed,
        job.output_tokens_per_s or 0,
    )
    return True


def manifest_of(job: Job) -> dict:
    view = job_view(job)
    return {
        "job_id": job.id,
        "model": job.model,
        "status": job.status.value,
        "sampling": job.spec.get("sampling"),
        "engine": {**(job.spec.get("engine") or {}), "max_model_len": job.max_model_len},
        "metadata": view["metadata"],
        "vllm_version": job.vllm_version,
        "hardware": job.hardware,
        "input_file": job.input_file,
        "rows": {
            "total": job.request_total,
            "ok": job.request_completed,
            "error": job.request_failed,
        },
        "tokens": {"prompt": job.prompt_tokens, "completion": job.completion_tokens},
        "structured": view["structured"],
        "chat_template": job.spec.get("chat_template"),
        "throughput": {name: view["throughput"][name] for name in _MANIFEST_THROUGHPUT},
        "columns": OUTPUT_SCHEMA.names,
        "created_at": job.created_at,
        "finished_at": job.finished_at,
    }


# The manifest's throughput block (its schema, version 1); the tokens and hardware have their own.
_MANIFEST_THROUGHPUT = (
    "wall_seconds",
    "engine_seconds",
    "requests_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
)
