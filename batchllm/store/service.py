"""Jobs: creating one from an input file, finding, listing and cancelling jobs, and the few
facts a run records on its job (first engine step, context length)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batchllm.errors import InputError, JobNotFound, JobStateError, StorageError
from batchllm.input.adapters import store_adapters
from batchllm.input.files.source import InputSource, resolve_input
from batchllm.input.schemas import JobSpec
from batchllm.input.shards import ShardInput, StoredInput, store_input
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store import state_machine
from batchllm.store.db import get_one, session_scope, settings_of
from batchllm.store.models import Job, JobParent, JobStatus, utcnow
from batchllm.store.recovery import end_stale_shards_of_cancelled_jobs
from batchllm.store.shard_recording import ShardPreparer, ShardRecorder
from batchllm.store.webhooks import WebhookTarget

log = logging.getLogger(__name__)


def new_job_id() -> str:
    return "job_" + uuid.uuid4().hex[:16]


@dataclass
class CreatedJob:
    job: Job
    stored: StoredInput
    # What the job's caller must finish it in when its shards all ended during its validation
    # (a fleet ran them meanwhile): FINALIZING, write its manifest (state_machine.end_validation).
    ended: JobStatus | None = None


ReleaseShards = Callable[[str, list[int]], None]


def create_job(
    source: str | Path | InputSource,
    spec: JobSpec,
    *,
    shard_size: int,
    strict: bool = False,
    settings: Settings,
    local_run: bool = False,
    expires_at: datetime | None = None,
    on_shard: Callable[[ShardInput], None] | None = None,
    release: ReleaseShards | None = None,
    notify: WebhookTarget | None = None,
    hold: bool = False,
    preparer: ShardPreparer | None = None,
) -> CreatedJob:
    """Validate and store the input, recording the job and its shards as `queued`.

    `release(job_id, shard_ids)`: queue committed shards for the fleet. When the job's
    max_model_len is given, or sized shard by shard by `preparer`, it is called while
    validation goes on, with the shards stored so far (shard_recording.py), so a big file
    starts working within seconds; otherwise, and under --strict, once the whole file is stored.

    A file refused under --strict leaves a `failed` job with the reason, like the OpenAI API;
    so does a job storage that cannot be written (StorageError). `notify`: where the job's end
    is announced (store/webhooks.py). `source`: the input as a front door resolved it
    (input/files/source.py); a path is resolved here, once. `hold`: the job waits for the
    jobs it runs after (spec.after): it ends `waiting`, none of its shards released
    (store/dependencies.py releases them). `preparer`: work on each stored shard before it is
    recorded and released (submit's token pass); the max_model_len it sized, if any, is the
    job's.
    """
    if hold:
        release = None
    source = resolve_input(source, s3_endpoint=settings.resolved_s3_endpoint)
    storage = Storage.of(settings)
    job_id = new_job_id()
    if spec.adapters:
        # Workers load adapters from the job's storage, wherever the job was submitted.
        spec = spec.model_copy(update={"adapters": store_adapters(storage, job_id, spec.adapters)})
    with session_scope(settings) as session:
        session.add(
            _job_row(
                job_id,
                JobStatus.VALIDATING,
                spec,
                source.recorded,
                storage,
                settings,
                notify,
                max_model_len=spec.engine.max_model_len,
                local_run=local_run,
                expires_at=expires_at,
            )
        )
    # Streaming needs the context length up front: without it the first worker sizes the job
    # from all of its rows (execution/engines.py), which must all be there.
    stream = release is not None and not strict and spec.engine.max_model_len is not None
    recorder = ShardRecorder(settings, job_id, release, stream=stream)
    # Or a context length sized as the shards come: submit's token pass (the preparer) measures
    # each shard before it is recorded, and the job's max_model_len is raised to cover it before
    # it is released (issue 37: an unsized job's workers waited for the whole pass before).
    sizes_as_it_goes = release is not None and not strict and preparer is not None and not stream
    covered: int | None = None  # the max_model_len recorded for the shards released so far

    def stored_one(shard: ShardInput) -> None:
        nonlocal covered
        if preparer is None:
            recorder.add(shard)
        else:  # recorded (and released) once prepared; on this thread, which owns the session
            preparer.stored(shard)
            ready = preparer.ready()
            if ready and sizes_as_it_goes:
                sized = preparer.sized_so_far()
                if sized is not None and sized != covered:
                    with session_scope(settings) as session:
                        record_sized_so_far(session, job_id, sized)
                    covered = sized
                # From the first shard the pass cannot size on, the rest wait for the end.
                recorder.stream = sized is not None
            for prepared in ready:
                recorder.add(prepared)
        if on_shard is not None:
            on_shard(shard)

    try:
        # The output directory first: a worker may write the first shard's rows before the
        # last one is stored.
        storage.makedirs(storage.output_dir(job_id))
        stored = store_input(
            source,
            storage,
            job_id,
            settings=settings,
            shard_size=shard_size,
            strict=strict,
            adapters=frozenset(spec.adapters),
            task=spec.engine.task,
            table=spec.table,
            on_shard=stored_one,
        )
    except (InputError, StorageError, OSError) as exc:
        if preparer is not None:
            preparer.close()
        error = exc
        if isinstance(exc, OSError):  # the output directory
            error = StorageError(
                f"job storage {storage.display(storage.root)}: cannot write: {exc}"
            )
        with session_scope(settings) as session:
            state_machine.fail_job(session, job_id, str(error))
        if error is exc:
            raise
        raise error from exc
    except BaseException:
        if preparer is not None:
            preparer.close()
        raise
    sized = None
    if preparer is not None:
        sized = preparer.finish()
        recorder.stream = False  # released after the commit that records the job's size
        for prepared in preparer.ready():
            recorder.add(prepared)
    with session_scope(settings) as session:
        if sized is not None:
            record_sized_so_far(session, job_id, sized)
        elif covered is not None:
            # The pass stopped after shards ran on a size of part of the job: a worker sizes
            # the whole job again, from all of its rows.
            forget_max_model_len(session, job_id)
        recorder.record_rest(session)
        ended = state_machine.end_validation(
            session,
            job_id,
            shards_total=len(stored.shards),
            request_total=stored.total,
            hold=hold,
        )
        job = get_one(session, Job, job_id)
    recorder.release_rest()
    log.info(
        "job %s: %d requests (%d invalid) in %d shards",
        job_id,
        stored.total,
        stored.invalid,
        len(stored.shards),
    )
    return CreatedJob(job=job, stored=stored, ended=ended)


def get_job(session: Session, job_ref: str) -> Job:
    """The job with this id, or with this unique id prefix (with or without `job_`)."""
    if not job_ref.strip():
        raise JobNotFound("the job id is empty")
    job = session.get(Job, job_ref)
    if job is not None:
        return job
    prefix = job_ref if job_ref.startswith("job_") else "job_" + job_ref
    # autoescape: a prefix is literal text; `%` and `_` must not act as LIKE wildcards.
    matches = session.scalars(
        select(Job).where(Job.id.startswith(prefix, autoescape=True)).limit(2)
    ).all()
    if len(matches) == 1:
        return matches[0]
    raise JobNotFound(f"no job {job_ref!r}" if not matches else f"job id {job_ref!r} is ambiguous")


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


def forget_max_model_len(session: Session, job_id: str) -> None:
    """Clear a context length sized from part of the job's rows: a worker sizes it again."""
    session.execute(update(Job).where(Job.id == job_id).values(max_model_len=None))


def record_refused_job(
    source: str,
    spec: JobSpec,
    error: str,
    *,
    settings: Settings,
    notify: WebhookTarget | None = None,
) -> str:
    """A job that fails before any row is stored (e.g. a Batch API file naming several
    models): recorded `failed` with the reason, so it can be looked up like any other."""
    storage = Storage.of(settings)
    job_id = new_job_id()
    with session_scope(settings) as session:
        session.add(
            _job_row(
                job_id,
                JobStatus.FAILED,
                spec,
                source,
                storage,
                settings,
                notify,
                error=error,
                finished_at=utcnow(),
            )
        )
    return job_id


def _job_row(
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
