"""Job operations and state transitions. Every transition is one conditional SQL UPDATE, so
concurrent workers on PostgreSQL cannot both win it (e.g. both finalize a job)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from batchllm.errors import InputError, JobNotFound, JobStateError, ShardBusy, ShardLost
from batchllm.jobs.db import changed, get_one, session_scope
from batchllm.jobs.inputs import StoredInput, store_input
from batchllm.jobs.models import Checkpoint, Job, JobStatus, Shard, ShardStatus, utcnow
from batchllm.jobs.schemas import JobSpec
from batchllm.jobs.storage import Storage
from batchllm.settings import Settings, get_settings

log = logging.getLogger(__name__)

ACTIVE = (JobStatus.VALIDATING, JobStatus.QUEUED, JobStatus.IN_PROGRESS, JobStatus.FINALIZING,
          JobStatus.CANCELLING)


def new_job_id() -> str:
    return "job_" + uuid.uuid4().hex[:16]


@dataclass
class CreatedJob:
    job: Job
    stored: StoredInput


def create_job(source: str | Path, spec: JobSpec, *, shard_size: int, strict: bool = False,
               settings: Settings | None = None, local_run: bool = False) -> CreatedJob:
    """Validate and store the input, then record the job and its shards as `queued`.

    A file refused under --strict leaves a `failed` job with the reason, like the OpenAI API.
    """
    settings = settings or get_settings()
    source = Path(source)
    if not source.is_file():
        raise InputError(f"{source}: no such file")
    storage = Storage(settings.resolved_storage)
    job_id = new_job_id()
    with session_scope(settings) as session:
        session.add(Job(id=job_id, status=JobStatus.VALIDATING, model=spec.model,
                        spec=spec.model_dump(mode="json"), job_metadata=dict(spec.metadata),
                        input_file=str(source.resolve()), storage_root=settings.resolved_storage,
                        output_dir=storage.display(storage.output_dir(job_id)),
                        max_model_len=spec.engine.max_model_len, local_run=local_run))
    try:
        stored = store_input(source, storage, job_id, shard_size=shard_size, strict=strict)
    except InputError as exc:
        with session_scope(settings) as session:
            session.execute(update(Job).where(Job.id == job_id).values(
                status=JobStatus.FAILED, error=str(exc), finished_at=utcnow()))
        raise
    storage.makedirs(storage.output_dir(job_id))
    with session_scope(settings) as session:
        job = get_one(session, Job, job_id)
        for shard in stored.shards:
            session.add(Shard(job_id=job_id, index=shard.index, status=ShardStatus.QUEUED,
                              input_path=shard.path, rows=shard.rows, first_line=shard.first_line,
                              last_line=shard.last_line))
        job.request_total = stored.total
        job.shards_total = len(stored.shards)
        job.status = JobStatus.QUEUED
    log.info("job %s: %d requests (%d invalid) in %d shards", job_id, stored.total,
             stored.invalid, len(stored.shards))
    return CreatedJob(job=job, stored=stored)


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
        select(Job).where(Job.id.startswith(prefix, autoescape=True)).limit(2)).all()
    if len(matches) == 1:
        return matches[0]
    raise JobNotFound(f"no job {job_ref!r}" if not matches else f"job id {job_ref!r} is ambiguous")


def list_jobs(session: Session, *, status: JobStatus | None = None, limit: int = 20) -> list[Job]:
    query = select(Job).order_by(Job.created_at.desc()).limit(limit)
    if status is not None:
        query = query.where(Job.status == status)
    return list(session.scalars(query))


def claim_shard(session: Session, shard_id: int, worker: str,
                lease_seconds: float = 120.0) -> Shard | None:
    """Mark a shard running for this worker; None when it must not run (done, or cancelled).

    A shard already `running` is claimable again when its heartbeat is older than the lease:
    that is a redelivery after its worker died. With a fresh heartbeat it raises ShardBusy,
    unless the claim comes from the worker that ran it: a worker runs one shard at a time, so
    its earlier run is over (it ended on an error, e.g. the database went away mid-shard).
    """
    shard = session.get(Shard, shard_id)
    if shard is None or shard.status not in (ShardStatus.QUEUED, ShardStatus.RUNNING):
        return None
    job_status = session.scalar(select(Job.status).where(Job.id == shard.job_id))
    if job_status in (JobStatus.CANCELLING, JobStatus.CANCELLED):
        _end_shard(session, shard, ShardStatus.CANCELLED)
        return None
    now = utcnow()
    stale = now - timedelta(seconds=lease_seconds)
    claimed = changed(session,
        update(Shard).where(Shard.id == shard_id, or_(
            Shard.status == ShardStatus.QUEUED,
            and_(Shard.status == ShardStatus.RUNNING,
                 or_(Shard.heartbeat_at.is_(None), Shard.heartbeat_at < stale,
                     Shard.worker == worker))))
        .values(status=ShardStatus.RUNNING, worker=worker, attempts=Shard.attempts + 1,
                heartbeat_at=now, started_at=func.coalesce(Shard.started_at, now))
        # SQLite loads naive datetimes: the ORM cannot evaluate `heartbeat_at < stale` in
        # Python, and the shard is refreshed below anyway.
        .execution_options(synchronize_session=False))
    if not claimed:
        session.refresh(shard)
        if shard.status == ShardStatus.RUNNING:
            raise ShardBusy(f"shard {shard.index} of {shard.job_id} is running on {shard.worker}")
        return None
    session.execute(update(Job).where(Job.id == shard.job_id, Job.status == JobStatus.QUEUED)
                    .values(status=JobStatus.IN_PROGRESS))
    session.refresh(shard)
    return shard


def heartbeat(session: Session, owned: dict[int, int]) -> set[int]:
    """Refresh the heartbeat of the shards this worker runs ({shard id: attempt}); returns the
    ids it no longer owns (taken over after its lease ran out), which it must stop running."""
    lost = set()
    now = utcnow()
    for shard_id, attempt in owned.items():
        if not changed(session, update(Shard).where(
                Shard.id == shard_id, Shard.attempts == attempt,
                Shard.status == ShardStatus.RUNNING).values(heartbeat_at=now)
                .execution_options(synchronize_session=False)):
            lost.add(shard_id)
    return lost


def mark_generation_started(session: Session, job_id: str, *, hardware: str | None = None,
                            vllm_version: str | None = None) -> None:
    """Throughput is timed from the first engine step, not from the engine's start-up. The
    engine's hardware and version are kept too, for whoever finalizes the job (the reconciler
    may, when the worker that ended the last shard died)."""
    session.execute(update(Job).where(Job.id == job_id, Job.started_at.is_(None))
                    .values(started_at=utcnow(), hardware=hardware, vllm_version=vllm_version))


def record_checkpoint(session: Session, *, shard_id: int, job_id: str, seq: int, path: str,
                      rows_ok: int, rows_failed: int, prompt_tokens: int,
                      completion_tokens: int, engine_seconds: float,
                      attempt: int | None = None) -> None:
    """Record one committed part file and add its counts, in the caller's transaction.

    With `attempt`, the write is fenced: it only lands while the shard is still running under
    that attempt. A worker that lost its shard (its lease ran out and another worker took the
    shard over) gets ShardLost and must not count its rows.
    """
    fence = [Shard.id == shard_id]
    if attempt is not None:
        fence += [Shard.attempts == attempt, Shard.status == ShardStatus.RUNNING]
    owned = changed(session, update(Shard).where(*fence).values(
        rows_ok=Shard.rows_ok + rows_ok, rows_failed=Shard.rows_failed + rows_failed,
        prompt_tokens=Shard.prompt_tokens + prompt_tokens,
        completion_tokens=Shard.completion_tokens + completion_tokens,
        engine_seconds=Shard.engine_seconds + engine_seconds, next_seq=seq + 1)
        .execution_options(synchronize_session=False))
    if not owned:
        raise ShardLost(f"shard {shard_id} is no longer run by attempt {attempt}")
    session.add(Checkpoint(shard_id=shard_id, seq=seq, path=path, rows=rows_ok + rows_failed,
                           rows_ok=rows_ok, rows_failed=rows_failed, prompt_tokens=prompt_tokens,
                           completion_tokens=completion_tokens, engine_seconds=engine_seconds))
    session.execute(update(Job).where(Job.id == job_id).values(
        request_completed=Job.request_completed + rows_ok,
        request_failed=Job.request_failed + rows_failed,
        prompt_tokens=Job.prompt_tokens + prompt_tokens,
        completion_tokens=Job.completion_tokens + completion_tokens,
        engine_seconds=Job.engine_seconds + engine_seconds))


def release_shard(session: Session, shard_id: int, attempt: int) -> bool:
    """Hand a running shard back (warm shutdown) so its next delivery can claim it at once."""
    return bool(changed(session, update(Shard).where(
        Shard.id == shard_id, Shard.attempts == attempt, Shard.status == ShardStatus.RUNNING)
        .values(status=ShardStatus.QUEUED)))


def requeue_stale_shards(session: Session, lease_seconds: float) -> list[tuple[int, str]]:
    """Put back running shards whose worker stopped heartbeating (killed, node lost).

    Returns (shard id, model) for each shard put back, for the caller to enqueue. Each shard is
    moved by one conditional UPDATE, so of several sweeping workers only one re-enqueues it.
    """
    stale = utcnow() - timedelta(seconds=lease_seconds)
    found = session.execute(select(Shard.id, Job.model).join(Job).where(
        Shard.status == ShardStatus.RUNNING, Shard.heartbeat_at < stale,
        Job.status.in_([JobStatus.IN_PROGRESS, JobStatus.QUEUED]), Job.local_run.is_(False))
    ).all()
    moved = []
    for shard_id, model in found:
        if changed(session, update(Shard).where(
                Shard.id == shard_id, Shard.status == ShardStatus.RUNNING,
                Shard.heartbeat_at < stale).values(status=ShardStatus.QUEUED)
                .execution_options(synchronize_session=False)):
            moved.append((shard_id, model))
    return moved


def checkpoints_of(session: Session, shard_id: int) -> list[Checkpoint]:
    return list(session.scalars(select(Checkpoint).where(Checkpoint.shard_id == shard_id)
                                .order_by(Checkpoint.seq)))


def _end_shard(session: Session, shard: Shard, status: ShardStatus, error: str | None = None,
               attempt: int | None = None) -> bool:
    fence = [Shard.id == shard.id, Shard.status.in_([ShardStatus.QUEUED, ShardStatus.RUNNING])]
    if attempt is not None:
        fence.append(Shard.attempts == attempt)
    ended = changed(session,
        update(Shard).where(*fence).values(status=status, finished_at=utcnow(), error=error)
    )
    if ended:
        session.execute(update(Job).where(Job.id == shard.job_id)
                        .values(shards_done=Job.shards_done + 1))
    return bool(ended)


def end_shard(session: Session, shard_id: int, status: ShardStatus,
              error: str | None = None, attempt: int | None = None) -> JobStatus | None:
    """End a shard once. When it was the job's last, move the job on and return the state the
    caller must finish it in (FINALIZING: write the manifest; CANCELLED/FAILED: already set)."""
    shard = session.get(Shard, shard_id)
    if shard is None or not _end_shard(session, shard, status, error, attempt):
        return None
    return after_last_shard(session, shard.job_id)


def after_last_shard(session: Session, job_id: str) -> JobStatus | None:
    done, total = session.execute(select(Job.shards_done, Job.shards_total)
                                  .where(Job.id == job_id)).one()
    if done < total:
        return None
    failed = session.scalar(select(func.count()).select_from(Shard).where(
        Shard.job_id == job_id, Shard.status == ShardStatus.FAILED))
    if changed(session, update(Job).where(Job.id == job_id, Job.status == JobStatus.CANCELLING)
                       .values(status=JobStatus.CANCELLED, finished_at=utcnow())):
        return JobStatus.CANCELLED
    if failed:
        errors = session.scalars(select(Shard.error).where(
            Shard.job_id == job_id, Shard.status == ShardStatus.FAILED).limit(3)).all()
        session.execute(update(Job).where(Job.id == job_id, Job.status.in_(ACTIVE)).values(
            status=JobStatus.FAILED, finished_at=utcnow(),
            error=f"{failed} shard(s) failed: " + "; ".join(e or "?" for e in errors)))
        return JobStatus.FAILED
    moved = changed(session, update(Job).where(
        Job.id == job_id, Job.status.in_([JobStatus.QUEUED, JobStatus.IN_PROGRESS]))
        .values(status=JobStatus.FINALIZING))
    return JobStatus.FINALIZING if moved else None


def complete_job(session: Session, job_id: str, *, hardware: str | None,
                 vllm_version: str | None) -> Job | None:
    """Compute the job's throughput and mark it completed; None if it is not finalizing
    (another worker finished it first). The row lock makes the check-and-set one step."""
    job = session.get(Job, job_id, with_for_update=True)
    if job is None or job.status is not JobStatus.FINALIZING:
        return None
    finished = utcnow()
    started = job.started_at or job.created_at
    if started.tzinfo is None:  # SQLite returns naive datetimes
        started = started.replace(tzinfo=finished.tzinfo)
    wall = max((finished - started).total_seconds(), 1e-9)
    requests = job.request_completed + job.request_failed
    job.status = JobStatus.COMPLETED
    job.finished_at = finished
    job.wall_seconds = wall
    job.requests_per_s = requests / wall
    job.output_tokens_per_s = job.completion_tokens / wall
    job.total_tokens_per_s = (job.prompt_tokens + job.completion_tokens) / wall
    job.hardware = hardware or job.hardware
    job.vllm_version = vllm_version or job.vllm_version
    return job


def fail_job(session: Session, job_id: str, error: str) -> None:
    session.execute(update(Job).where(Job.id == job_id, Job.status.in_(ACTIVE)).values(
        status=JobStatus.FAILED, error=error, finished_at=utcnow()))


def set_max_model_len(session: Session, job_id: str, value: int) -> int:
    """Fix the job's context length once; the first worker to size it wins, others reuse it."""
    session.execute(update(Job).where(Job.id == job_id, Job.max_model_len.is_(None))
                    .values(max_model_len=value))
    return int(session.scalar(select(Job.max_model_len).where(Job.id == job_id)) or value)


def cancel_job(session: Session, job_ref: str, *, lease_seconds: float | None = None) -> Job:
    """Cancel a job: queued shards end now; running shards see `cancelling` within a step,
    abort their in-flight requests, keep their committed rows, and end the job `cancelled`.
    A running shard whose worker is gone (no heartbeat within the lease) ends now too; one
    whose lease has not run out yet is ended by the reconciler when it does."""
    from batchllm.jobs.recovery import end_stale_shards_of_cancelled_jobs

    job = get_job(session, job_ref)
    if job.status.is_final:
        raise JobStateError(f"job {job.id} is already {job.status.value}")
    session.execute(update(Job).where(Job.id == job.id, Job.status.in_(ACTIVE))
                    .values(status=JobStatus.CANCELLING))
    for shard in session.scalars(select(Shard).where(Shard.job_id == job.id,
                                                     Shard.status == ShardStatus.QUEUED)):
        _end_shard(session, shard, ShardStatus.CANCELLED)
    end_stale_shards_of_cancelled_jobs(
        session, lease_seconds or get_settings().lease_seconds, job_id=job.id)
    after_last_shard(session, job.id)
    session.flush()
    session.refresh(job)
    return job


def job_status(session: Session, job_id: str) -> JobStatus | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))
