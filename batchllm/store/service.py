"""Job rows: a new job's row, finding, listing and cancelling jobs, and the few facts a run
records on its job (first engine step, context length). Creating a job from its input is
jobs/create.py's."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batchllm.errors import JobNotFound, JobStateError
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store import state_machine
from batchllm.store.db import settings_of
from batchllm.store.models import JOB_PREFIX, Job, JobParent, JobStatus, job_id_of, utcnow
from batchllm.store.recovery import end_stale_shards_of_cancelled_jobs
from batchllm.store.webhooks import WebhookTarget

log = logging.getLogger(__name__)


def new_job_id() -> str:
    return JOB_PREFIX + uuid.uuid4().hex[:16]


def get_job(session: Session, job_ref: str) -> Job:
    """The job with this id, or with this unique id prefix (with or without `job_`); a batch id
    (`batch_...`, as the Batch API shows it) or its prefix finds its job too."""
    if not job_ref.strip():
        raise JobNotFound("the job id is empty")
    job = session.get(Job, job_id_of(job_ref))
    if job is not None:
        return job
    prefix = job_id_of(job_ref)
    prefix = prefix if prefix.startswith(JOB_PREFIX) else JOB_PREFIX + prefix
    # autoescape: a prefix is literal text; `%` and `_` must not act as LIKE wildcards.
    matches = session.scalars(
        select(Job).where(Job.id.startswith(prefix, autoescape=True)).limit(2)
    ).all()
    if len(matches) == 1:
        return matches[0]
    raise JobNotFound(f"no job {job_ref!r}" if not matches else f"job id {job_ref!r} is ambiguous")


def newest_job_labelled(session: Session, **labels: str) -> Job | None:
    """The newest job whose metadata has each of these labels (a pipeline's stage jobs)."""
    query = select(Job)
    for key, value in labels.items():
        query = query.where(Job.job_metadata[key].as_string() == value)
    return session.scalars(query.order_by(Job.created_at.desc()).limit(1)).first()


def list_jobs(session: Session, *, status: JobStatus | None = None, limit: int = 20) -> list[Job]:
    query = select(Job).order_by(Job.created_at.desc()).limit(limit)
    if status is not None:
        query = query.where(Job.status == status)
    return list(session.scalars(query))


def mark_generation_started(
    session: Session, job_id: str, *, hardware: str | None = None, vllm_version: str | None = None
) -> None:
    """Throughput is timed from the first engine step, not from the engine's start-up. The
    engine's hardware and version are kept too, for whoever finalizes the job (the reconciler
    may, when the worker that ended the last shard died)."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.started_at.is_(None))
        .values(started_at=utcnow(), hardware=hardware, vllm_version=vllm_version)
    )


def set_max_model_len(session: Session, job_id: str, value: int) -> int:
    """Fix the job's context length once; the first worker to size it wins, others reuse it."""
    session.execute(
        update(Job).where(Job.id == job_id, Job.max_model_len.is_(None)).values(max_model_len=value)
    )
    return int(session.scalar(select(Job.max_model_len).where(Job.id == job_id)) or value)


def record_sized_so_far(session: Session, job_id: str, value: int) -> None:
    """Raise the job's context length to `value`, submit's token pass's size of the shards it
    measured so far: only ever raised, so every shard released before stays covered."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, (Job.max_model_len.is_(None)) | (Job.max_model_len < value))
        .values(max_model_len=value)
    )


def record_prompt_tokens(session: Session, job_id: str, tokens: int) -> None:
    """The job's prompt tokens as its sizing pass counted them, every row tokenized: exact,
    in place of a Batch API batch's estimate from its bytes (api/enqueued.py)."""
    session.execute(update(Job).where(Job.id == job_id).values(prompt_tokens_estimate=tokens))


def forget_max_model_len(session: Session, job_id: str) -> None:
    """Clear a context length sized from part of the job's rows: a worker sizes it again."""
    session.execute(update(Job).where(Job.id == job_id).values(max_model_len=None))


def job_row(
    job_id: str,
    status: JobStatus,
    spec: JobSpec,
    input_file: str,
    storage: Storage,
    settings: Settings,
    notify: WebhookTarget | None,
    **more: Any,
) -> Job:
    """A new job's row: what every job records of its spec, input, storage and webhook, and
    the `more` columns of its kind."""
    return Job(
        id=job_id,
        status=status,
        model=spec.model,
        spec=spec.model_dump(mode="json"),
        job_metadata=dict(spec.metadata),
        input_file=input_file,
        storage_root=settings.resolved_storage,
        output_dir=storage.display(storage.output_dir(job_id)),
        notify_url=notify.url if notify else None,
        notify_secret=notify.secret if notify else None,
        parent_links=[JobParent(parent_id=parent, kind="from") for parent in spec.parents]
        + [
            JobParent(parent_id=parent, kind="after")
            for parent in spec.after
            if parent not in spec.parents
        ],
        **more,
    )


def cancel_job(session: Session, job_ref: str, *, lease_seconds: float | None = None) -> Job:
    """Cancel a job: queued shards end now; running shards see `cancelling` within a step,
    abort their in-flight requests, keep their committed rows, and end the job `cancelled`.
    A running shard whose worker is gone (no heartbeat within the lease) ends now too; one
    whose lease has not run out yet is ended by the reconciler when it does. The lease:
    `lease_seconds`, else the session's settings'."""
    job = get_job(session, job_ref)
    if job.status.is_final:
        raise JobStateError(f"job {job.id} is already {job.status.value}")
    state_machine.begin_cancel(session, job.id)
    # Ends the queued shards, and the running ones whose worker is gone.
    end_stale_shards_of_cancelled_jobs(
        session, lease_seconds or settings_of(session).lease_seconds, job_id=job.id
    )
    state_machine.after_last_shard(session, job.id)
    session.flush()
    session.refresh(job)
    return job


def job_status(session: Session, job_id: str) -> JobStatus | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))


@dataclass(frozen=True)
class RecordedThroughput:
    """What completed jobs of one model on one kind of hardware processed, in all."""

    jobs: int
    tokens: int  # prompt + completion
    wall_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_seconds


def recorded_throughput(
    session: Session, model: str, hardware: str, *, last: int = 20
) -> RecordedThroughput | None:
    """The throughput of the `last` completed jobs of `model` whose hardware is `hardware`
    (with any dtype the engine appended to it), or None when there is none to go by."""
    rows = session.execute(
        select(Job.prompt_tokens, Job.completion_tokens, Job.wall_seconds)
        .where(
            Job.model == model,
            Job.status == JobStatus.COMPLETED,
            Job.wall_seconds > 0,
            (Job.hardware == hardware) | Job.hardware.startswith(hardware + ",", autoescape=True),
        )
        .order_by(Job.finished_at.desc())
        .limit(last)
    ).all()
    tokens = sum(prompt + completion for prompt, completion, _ in rows)
    if not rows or not tokens:
        return None
    return RecordedThroughput(len(rows), tokens, sum(wall or 0.0 for _, _, wall in rows))
