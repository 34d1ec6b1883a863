"""Submitting a job to the fleet: validate and store, commit shards, and only then enqueue them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.exc import SQLAlchemyError

from batchllm.errors import BatchLLMError
from batchllm.execution.context.plan import plan_for_submit
from batchllm.execution.finalize import finalize_job
from batchllm.input.files.source import InputSource
from batchllm.input.shards import StoredInput
from batchllm.jobs.create import create_job
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.store import dependencies, state_machine
from batchllm.store.db import read_one, session_scope
from batchllm.store.models import Job, JobStatus
from batchllm.store.webhooks import WebhookTarget
from batchllm.worker.celery_app import queue_for_job, sender_app
from batchllm.worker.shard_tasks import send_shard_tasks

log = logging.getLogger(__name__)


def submit_job(
    source: InputSource,
    spec: JobSpec,
    *,
    shard_size: int | None = None,
    strict: bool = False,
    settings: Settings,
    expires_at: datetime | None = None,
    before_dispatch: Callable[[str], None] | None = None,
    on_stored: Callable[[StoredInput], None] | None = None,
    notify: WebhookTarget | None = None,
) -> Job:
    """Create the job and its shards, enqueueing one task per shard on the model's queue.

    Tasks go out only after their shards' database commit, so a worker never sees a shard that
    is not there yet; with the job's max_model_len given they go out while validation goes on
    (store/shard_recording.py). If the broker cannot be reached, the job is marked failed and
    the error says so. `expires_at` ends the job `expired` when it passes;
    `before_dispatch(job_id)` runs between the job's creation and its first task (the Batch API
    records its batch there); `on_stored(stored)` once the input is stored (its counts: lines,
    invalid lines, shards); `notify`: where the job's end is announced. A spec with `after`
    jobs not completed yet makes a `waiting` job: no task goes out until the reconciler
    releases it (store/dependencies.py).
    """
    hold = False
    if spec.after:  # refused before anything is stored when a parent is unknown or failed
        with session_scope(settings) as session:
            resolved, waiting = dependencies.resolve_parents(session, spec.after)
        spec = spec.model_copy(update={"after": resolved})
        hold = bool(waiting)
    sent: list[int] = []

    def release(job_id: str, shard_ids: list[int]) -> None:
        if not sent and before_dispatch is not None:
            before_dispatch(job_id)
        send_shards(job_id, spec, shard_ids, settings=settings)
        sent.extend(shard_ids)

    created = create_job(
        source,
        spec,
        shard_size=shard_size or settings.shard_size,
        strict=strict,
        settings=settings,
        expires_at=expires_at,
        release=release,
        notify=notify,
        hold=hold,
        # The prompts' token ids, stored beside the shards (and the context sized) here, so
        # the workers do not tokenize: when this machine holds the model.
        context=plan_for_submit(spec, settings),
    )
    job_id = created.job.id
    if hold:
        log.info("job %s: waiting for %s", job_id, ", ".join(spec.after))
    else:
        log.info("job %s: %d shard tasks on queue %s", job_id, len(sent), queue_for_job(spec))
    if created.ended is JobStatus.FINALIZING:
        # Its shards all ran while it was validating: nobody else will finish it.
        finalize_job(
            job_id,
            settings=settings,
            hardware=None,
            vllm_version=None,
        )
    if on_stored is not None:
        on_stored(created.stored)
    return read_one(settings, Job, job_id)


def dispatch_shards(job_id: str, spec: JobSpec, shard_ids: list[int], *, settings: Settings) -> Job:
    """Send the tasks of these shards (a retry's) and return the job as it is then."""
    send_shards(job_id, spec, shard_ids, settings=settings)
    log.info("job %s: %d shard tasks on queue %s", job_id, len(shard_ids), queue_for_job(spec))
    return read_one(settings, Job, job_id)


def send_shards(
    job_id: str,
    spec: JobSpec,
    shard_ids: list[int],
    *,
    settings: Settings,
) -> None:
    """Send one task per shard (committed `queued` before) to the queue of the job's engine
    kind; the job ends failed, saying so, when the broker cannot be reached."""
    app = sender_app(settings)
    queue = queue_for_job(spec)
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=2)
            send_shard_tasks(app, shard_ids, queue, settings=settings, connection=conn)
    except SQLAlchemyError:
        raise
    except Exception as exc:
        message = f"could not reach the broker at {_without_password(settings.broker_url)}: {exc}"
        with session_scope(settings) as session:
            state_machine.fail_job(session, job_id, message)
        raise BatchLLMError(message) from exc


def _without_password(url: str) -> str:
    from kombu.utils.url import maybe_sanitize_url

    return maybe_sanitize_url(url)
