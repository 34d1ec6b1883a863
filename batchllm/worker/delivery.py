"""What a worker does with one delivered shard task (claim, run, hand back), free of Celery so
it can be tested directly; worker/tasks.py is the Celery side."""

from __future__ import annotations

import logging

from sqlalchemy.exc import InterfaceError, OperationalError

from batchllm.engine.protocol import EngineSource
from batchllm.errors import EngineDied, EngineMismatch, EngineSettingsError
from batchllm.execution.engines import resolve_max_model_len
from batchllm.execution.finalize import finalize_job
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.execution.shard_failures import shard_failed
from batchllm.input.schemas import JobSpec
from batchllm.process.log_format import note_job, shard_context
from batchllm.process.stopping import StopRequest
from batchllm.settings import Settings
from batchllm.store import leases
from batchllm.store.db import session_scope
from batchllm.store.models import JobStatus, Shard
from batchllm.store.state_machine import fail_job

log = logging.getLogger(__name__)

DATABASE_ERRORS = (OperationalError, InterfaceError)  # unreachable, restarted, failed over


def process_shard(
    shard_id: int,
    *,
    worker: str,
    engines: EngineSource,
    stop: StopRequest | None = None,
    settings: Settings,
) -> Outcome:
    with shard_context(shard_id):
        try:
            return _process_shard(shard_id, worker, engines, stop or StopRequest(), settings)
        except DATABASE_ERRORS:
            raise  # not the shard's fault: the task sends it again once the database is back
        except Exception as exc:
            # Counted, recorded on the shard and retried with backoff, within a bound: never
            # sent again at once to fail again (execution/shard_failures.py).
            again = shard_failed(shard_id, exc, worker=worker, settings=settings)
            return Outcome.RETRYING if again else Outcome.FAILED


def _process_shard(
    shard_id: int,
    worker: str,
    engines: EngineSource,
    stop: StopRequest,
    settings: Settings,
) -> Outcome:
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_id)
        if shard is None:
            log.warning("shard %s does not exist (job deleted?): dropping the task", shard_id)
            return Outcome.SKIPPED
        job = shard.job
        status, job_id = job.status, job.id
        spec = JobSpec.model_validate(job.spec)
    note_job(job_id)
    if status.is_final:
        return Outcome.SKIPPED
    if status is JobStatus.CANCELLING:
        # No engine needed: the claim itself ends a shard of a cancelling job as cancelled.
        with session_scope(settings) as session:
            leases.claim_shard(session, shard_id, worker, settings.lease_seconds)
        return Outcome.CANCELLED
    if status is JobStatus.FINALIZING:
        # The worker that ended the last shard died before finishing the job: finish it here.
        finalize_job(job_id, settings=settings, hardware=None, vllm_version=None)
        return Outcome.SKIPPED
    own_model = getattr(engines, "model", None)
    if own_model is not None and spec.model != own_model:
        # Before the sizing pass, which loads the job's model's config and tokenizer: a worker
        # never loads a model other than its own (a tenant names the job's model).
        log.warning(
            "job %s is for model %r; this worker serves %r: it waits for a worker of its model",
            job_id,
            spec.model,
            own_model,
        )
        return Outcome.WAITING
    max_model_len = resolve_max_model_len(job_id, settings=settings)
    try:
        engine = engines.get(spec, max_model_len)
    except EngineMismatch as exc:
        # A fleet worker never rebuilds its engine for a job unless its operator allowed it:
        # the shard goes back for a worker that serves what the job needs.
        log.warning("job %s waits for another worker: %s", job_id, exc)
        return Outcome.WAITING
    except EngineSettingsError as exc:
        # Settings this worker's hardware cannot honour (engine/preflight.py) would fail the
        # same way on every delivery: the job fails now, with the reason.
        log.error("job %s: %s", job_id, exc)
        with session_scope(settings) as session:
            fail_job(session, job_id, str(exc))
        return Outcome.FAILED
    runner = ShardRunner(engine, worker=worker, settings=settings, stop=stop)
    try:
        return runner.run([shard_id]).get(shard_id, Outcome.SKIPPED)
    except EngineDied as exc:
        # The runner committed the finished rows and handed the shard back; the next task
        # this worker takes builds a new engine.
        log.error("%s: dropping the engine; shard %s goes back to the queue", exc, shard_id)
        engines.close()
        return Outcome.ENGINE_DIED
