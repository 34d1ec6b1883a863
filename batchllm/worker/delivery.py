"""What a worker does with one delivered shard task (claim, run, hand back) and when the task
is sent again, free of Celery so it can be tested directly; worker/tasks.py is the Celery
side."""

from __future__ import annotations

import logging

from sqlalchemy.exc import InterfaceError, OperationalError

from batchllm.engine.protocol import EngineSource
from batchllm.errors import EngineDied, EngineMismatch, EngineSettingsError
from batchllm.execution.context.resolve import resolve_max_model_len
from batchllm.execution.finalize import finalize_job
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.execution.shard_failures import shard_failed
from batchllm.process.log_format import note_job, shard_context
from batchllm.process.stopping import StopRequest
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.store import leases
from batchllm.store.db import session_scope
from batchllm.store.models import JobStatus, Shard
from batchllm.store.state_machine import fail_job
from batchllm.worker.fair_share import backoff_left

log = logging.getLogger(__name__)

DATABASE_ERRORS = (OperationalError, InterfaceError)  # unreachable, restarted, failed over
# A duplicate delivery while another worker holds the shard: look again later, so the shard
# still has a task if that worker dies.
RETRY_BUSY_SECONDS = 30
# A job this worker's engine cannot run is offered to the fleet again this often.
RETRY_WAITING_SECONDS = 15
MAX_DATABASE_RETRY_SECONDS = 60


def database_retry_seconds(retries: int) -> int:
    """How long a delivery waits for the database before its task runs again (its n-th retry):
    doubling from 5 s, at most MAX_DATABASE_RETRY_SECONDS."""
    return int(min(5 * 2**retries, MAX_DATABASE_RETRY_SECONDS))


def send_again_after(
    outcome: Outcome, shard_id: int, *, delivered: int, settings: Settings
) -> float | None:
    """When a shard's task must be sent again after this delivery ended in `outcome`: seconds
    from now (0: at once), or None (its run ended, or its task is still in the broker). The
    re-send happens before this delivery is acknowledged, so the rest of a shard is never
    lost. `delivered`: the shard the task named (fair share may have run another in its turn)."""
    if outcome in (Outcome.INTERRUPTED, Outcome.ENGINE_DIED):
        return 0.0  # handed back: its rest runs on the next worker free
    if outcome is Outcome.RETRYING and shard_id == delivered:
        # Its run failed and was counted: it comes back after the shard's backoff. (A shard
        # that took another's turn still has its own task in the broker.)
        return backoff_left(shard_id, settings=settings)
    if outcome is Outcome.WAITING:
        return float(RETRY_WAITING_SECONDS)
    if outcome is Outcome.BUSY:
        return float(RETRY_BUSY_SECONDS)
    return None


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
