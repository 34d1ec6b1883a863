"""What a worker does with one delivered shard task (claim, run, hand back), free of Celery so
it can be tested directly; worker/tasks.py is the Celery side."""

from __future__ import annotations

import logging
from collections.abc import Callable

from batchllm.engine.protocol import EngineSource
from batchllm.errors import EngineDied, EngineMismatch, EngineSettingsError
from batchllm.execution.engines import resolve_max_model_len
from batchllm.execution.finalize import finalize_job
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.input.schemas import JobSpec
from batchllm.process.log_format import note_job, shard_context
from batchllm.settings import Settings, get_settings
from batchllm.storage import Storage
from batchllm.store import leases
from batchllm.store.db import session_scope
from batchllm.store.models import JobStatus, Shard
from batchllm.store.state_machine import fail_job

log = logging.getLogger(__name__)


def process_shard(
    shard_id: int,
    *,
    worker: str,
    engines: EngineSource,
    should_stop: Callable[[], bool] = lambda: False,
    settings: Settings | None = None,
) -> Outcome:
    with shard_context(shard_id):
        return _process_shard(shard_id, worker, engines, should_stop, settings or get_settings())


def _process_shard(
    shard_id: int,
    worker: str,
    engines: EngineSource,
    should_stop: Callable[[], bool],
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
    storage = Storage.of(settings)
    if status.is_final:
        return Outcome.SKIPPED
    if status is JobStatus.CANCELLING:
        # No engine needed: the claim itself ends a shard of a cancelling job as cancelled.
        with session_scope(settings) as session:
            leases.claim_shard(session, shard_id, worker, settings.lease_seconds)
        return Outcome.CANCELLED
    if status is JobStatus.FINALIZING:
        # The worker that ended the last shard died before finishing the job: finish it here.
        finalize_job(job_id, storage=storage, settings=settings, hardware=None, vllm_version=None)
        return Outcome.SKIPPED
    max_model_len = resolve_max_model_len(job_id, storage=storage, settings=settings)
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
    runner = ShardRunner(engine, worker=worker, settings=settings, should_stop=should_stop)
    try:
        return runner.run([shard_id]).get(shard_id, Outcome.SKIPPED)
    except EngineDied as exc:
        # The runner committed the finished rows and handed the shard back; the next task
        # this worker takes builds a new engine.
        log.error("%s: dropping the engine; shard %s goes back to the queue", exc, shard_id)
        engines.close()
        return Outcome.ENGINE_DIED
