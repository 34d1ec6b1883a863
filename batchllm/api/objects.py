"""Database rows as the OpenAI objects the `openai` SDK parses: FileObject and Batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from batchllm.store.job_view import usage
from batchllm.store.models import Batch, Job, StoredFile
from batchllm.store.states import JobStatus

# batchllm's `queued` (validated, waiting for a worker) is in progress to an API client.
_STATUS = {JobStatus.QUEUED: "in_progress"}


def epoch(moment: datetime | None) -> int | None:
    if moment is None:
        return None
    return int(moment.timestamp())


def file_object(row: StoredFile) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": epoch(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(batch: Batch, job: Job) -> dict[str, Any]:
    status = job.status
    ended = epoch(job.finished_at)
    # A cancelled or expired batch's error file also lists the requests it never ran (code
    # `cancelled` or `batch_expired`): the count says what the file holds.
    failed = (
        job.request_total - job.request_completed
        if status in (JobStatus.EXPIRED, JobStatus.CANCELLED)
        else job.request_failed
    )
    return {
        "id": batch.batch_id,  # OpenAI's `batch_` form of the job's id (either finds it)
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": job.model,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": _STATUS.get(status, status.value),
        # As OpenAI: no file id for a file with no line (both are written, and listed among
        # the key's files; the counts below are their line counts).
        "output_file_id": batch.output_file_id if job.request_completed else None,
        "error_file_id": batch.error_file_id if failed else None,
        "created_at": epoch(batch.created_at),
        "in_progress_at": _in_progress_at(batch, job),
        "expires_at": epoch(job.expires_at),
        "finalizing_at": epoch(job.finalizing_at),
        "completed_at": ended if status is JobStatus.COMPLETED else None,
        "failed_at": ended if status is JobStatus.FAILED else None,
        "expired_at": ended if status is JobStatus.EXPIRED else None,
        "cancelling_at": epoch(job.cancelling_at),
        "cancelled_at": ended if status is JobStatus.CANCELLED else None,
        "request_counts": {
            "total": job.request_total,
            "completed": job.request_completed,
            "failed": failed,
        },
        "metadata": job.job_metadata or None,
        "usage": usage(job),
    }


def _in_progress_at(batch: Batch, job: Job) -> int | None:
    """When the batch entered `in_progress`, as OpenAI fills it. batchllm shows a queued job as
    in progress from its create on (the file is validated within the create request), so that
    moment stands in until a worker starts it; a batch refused whole at create (its `errors`)
    never was in progress, as OpenAI's `validating -> failed`."""
    if job.started_at is not None:
        return epoch(job.started_at)
    if job.status is JobStatus.VALIDATING or batch.errors:
        return None
    return epoch(batch.created_at)


def page(
    rows: Sequence[Any], limit: int, render: Callable[[Any], dict[str, Any]]
) -> dict[str, Any]:
    """A list route's cursor page: `rows` are read one past `limit`, which only tells whether
    more follow."""
    data = [render(row) for row in rows[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(rows) > limit,
    }
