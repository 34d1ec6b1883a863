"""Database rows as the OpenAI objects the `openai` SDK parses: FileObject and Batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select, bindparam, select

from batchllm.store.job_view import usage
from batchllm.store.models import Batch, Job, StoredFile, batch_id_of
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


# What batch_object reads, as columns: a poll is the request a server answers most, and a
# batch's ORM rows (the job's spec and attempts decoded, identity map, a lazy load each) made
# a list page cost 3.3 ms and a retrieve 0.7 ms of the server's one core (measured in process).
# A row of these serves as both `batch` and `job` (their names do not collide: the job's
# created_at is not among them).
BATCH_COLUMNS = (
    Batch.job_id,
    Batch.owner,
    Batch.endpoint,
    Batch.completion_window,
    Batch.input_file_id,
    Batch.output_file_id,
    Batch.error_file_id,
    Batch.errors,
    Batch.created_at,
    Job.id,
    Job.status,
    Job.model,
    Job.job_metadata.label("job_metadata"),  # its column is `metadata`
    Job.expires_at,
    Job.request_total,
    Job.request_completed,
    Job.request_failed,
    Job.started_at,
    Job.finished_at,
    Job.cancelling_at,
    Job.finalizing_at,
    Job.prompt_tokens,
    Job.completion_tokens,
    Job.cached_tokens,
)


def batch_rows() -> Select[Any]:
    """SELECT of BATCH_COLUMNS, a batch beside its job: add the WHERE and ORDER BY."""
    return select(*BATCH_COLUMNS).join(Job, Job.id == Batch.job_id)


# Built once, bound per request (building a statement of 24 columns cost more than running it).
BATCH_BY_ID = batch_rows().where(Batch.job_id == bindparam("job_id"))


def batch_object(batch: Any, job: Any) -> dict[str, Any]:
    """OpenAI's Batch of `batch` and `job`: the ORM rows, or one row of batch_rows() for both."""
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
        "id": batch_id_of(batch.job_id),  # OpenAI's `batch_` form of the job's id (either finds it)
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


def _in_progress_at(batch: Any, job: Any) -> int | None:
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
