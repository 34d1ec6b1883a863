"""Deleting an ended job for good (`batchllm delete`, `DELETE /v1/batches/{id}`, and the
reconciler's retention): its files in the job storage, then its rows in the database.

Files go first: a failure there leaves the job's rows, so the delete can simply be run again;
rows deleted first would leave files nothing points to any more. What goes:
- the job's directory (input shards, token files, LoRA adapters, output parts, manifest);
- a Batch API job's output and error files and their `files` rows;
- the rows of the job, its shards, its checkpoints, its batch and its webhook attempts.
A batch's input file stays: it is an upload of its own (`/v1/files`), deleted through that API.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from batchllm.errors import JobStateError
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Batch, Checkpoint, Job, Shard, StoredFile, WebhookAttempt

log = logging.getLogger(__name__)


@dataclass
class DeletedJob:
    id: str
    status: str
    removed: list[str] = field(default_factory=list)  # directories and files, as a user names them


def delete_job(settings: Settings, job_ref: str) -> DeletedJob:
    """Delete an ended job's files and rows. JobStateError for a job that has not ended (a
    worker could still write to it): cancel it first."""
    with session_scope(settings) as session:
        job = service.get_job(session, job_ref)
        _refuse_unended(job)
        deleted = DeletedJob(id=job.id, status=job.status.value)
        result_files = _result_files(session, job.id)
        storage = Storage.for_job(job, settings)

    _delete_files(storage, job.id, [path for _, path in result_files], deleted)

    with session_scope(settings) as session:
        locked = session.get(Job, deleted.id, with_for_update=True)
        if locked is None:  # deleted meanwhile by another caller
            return deleted
        _refuse_unended(locked)
        shard_ids = select(Shard.id).where(Shard.job_id == locked.id).scalar_subquery()
        session.execute(delete(Checkpoint).where(Checkpoint.shard_id.in_(shard_ids)))
        session.execute(delete(Shard).where(Shard.job_id == locked.id))
        session.execute(delete(Batch).where(Batch.job_id == locked.id))
        # Explicitly, not by the foreign key's cascade: SQLite does not enforce it.
        session.execute(delete(WebhookAttempt).where(WebhookAttempt.job_id == locked.id))
        session.execute(delete(StoredFile).where(StoredFile.id.in_([i for i, _ in result_files])))
        session.execute(delete(Job).where(Job.id == locked.id))
    log.info("job %s (%s) deleted: %s", deleted.id, deleted.status, ", ".join(deleted.removed))
    return deleted


def _refuse_unended(job: Job) -> None:
    if not job.status.is_final:
        raise not_deletable(job.id, job.status.value)


def not_deletable(job_id: str, status: str) -> JobStateError:
    """The refusal of a job that has not ended: a worker could still write to it."""
    return JobStateError(
        f"job {job_id} is {status}: only an ended job can be deleted; cancel it first "
        f"(batchllm cancel {job_id}) and delete it once it is cancelled"
    )


def _result_files(session: Session, job_id: str) -> list[tuple[str, str]]:
    """The Batch API's output and error files of the job: (file id, path) pairs."""
    batch = session.get(Batch, job_id)
    if batch is None:
        return []
    ids = [i for i in (batch.output_file_id, batch.error_file_id) if i is not None]
    rows = session.execute(
        select(StoredFile.id, StoredFile.path).where(StoredFile.id.in_(ids)).order_by(StoredFile.id)
    )
    return [(file_id, path) for file_id, path in rows]


def _delete_files(storage: Storage, job_id: str, paths: list[str], deleted: DeletedJob) -> None:
    for path in paths:
        if storage.exists(path):
            storage.delete(path)
            deleted.removed.append(storage.display(path))
    # Their directory too: an object store keeps a marker object for an emptied directory.
    for folder in (storage.batch_results_dir(job_id), storage.job_dir(job_id)):
        if storage.delete_tree(folder):
            deleted.removed.append(storage.display(folder) + "/")
