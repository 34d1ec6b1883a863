"""`batchllm retry`: run again, as a new attempt of the same job, the lines that did not succeed.

Which lines: those without a row (a cancelled, expired or failed run never got to them) and
the error rows of a retryable kind (row_errors.py: the engine's failures, not the
request's), or with `all_errors` every error row. Each new row replaces the old one in the
output (output/replace.py), so the job keeps exactly one row per input line.

Where: a job `batchllm run` created is retried here, in this process; a job `submit` created
goes back to the fleet (the job row's `local_run` says which), so a retry runs where its job
did, under the engine settings it was sized for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from batchllm.engine.protocol import EngineSource
from batchllm.errors import JobStateError
from batchllm.execution.engines import EngineCache
from batchllm.execution.runner import ProgressFn
from batchllm.jobs.local import fail_abandoned_runs, run_shards_here
from batchllm.jobs.submit import dispatch_shards
from batchllm.output import commit, replace
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store import service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Job, ShardStatus

log = logging.getLogger(__name__)

_ENDED = (ShardStatus.COMPLETED, ShardStatus.FAILED, ShardStatus.CANCELLED)


@dataclass(frozen=True)
class RetryPlan:
    """What a retry runs: its shards and how many lines."""

    job_id: str
    shard_ids: list[int]
    lines: int  # lines without a row plus error rows chosen
    missing: int  # of them, lines without a row


def plan_retry(settings: Settings, job_ref: str, *, all_errors: bool) -> RetryPlan:
    """The lines a retry of this ended job would run; JobStateError when it may not be retried
    (still running, never stored its input) or has nothing to retry."""
    with session_scope(settings) as session:
        job = service.get_job(session, job_ref)
        if not job.status.is_final:
            raise JobStateError(
                f"job {job.id} is still {job.status.value}: a job is retried once it ended "
                f"(wait for it, or `batchllm cancel {job.id}` first)"
            )
        if not job.shards:
            raise JobStateError(f"job {job.id} {job.status.value} before it stored any input")
        storage = Storage.for_job(job, settings)
        shards = [(s, commit.checkpoints_of(session, s.id)) for s in job.shards]
        job_id, next_attempt = job.id, job.attempt + 1
    shard_ids: list[int] = []
    lines = missing = 0
    for shard, checkpoints in shards:
        without_row = shard.rows - sum(c.rows for c in checkpoints)
        chosen = replace.rows_to_replace(
            storage,
            checkpoints,
            before_attempt=next_attempt,
            all_errors=all_errors,
            input_path=shard.input_path,
        )
        if without_row or chosen or shard.status not in _ENDED:
            shard_ids.append(shard.id)
        missing += without_row
        lines += without_row + len(chosen)
    if not shard_ids:
        kind = "error rows" if all_errors else "rows without an answer or retryable error rows"
        hint = "" if all_errors else " (--all-errors retries every error row)"
        raise JobStateError(f"job {job_id} has no {kind}: nothing to retry{hint}")
    return RetryPlan(job_id=job_id, shard_ids=shard_ids, lines=lines, missing=missing)


def retry_job(
    job_ref: str,
    *,
    all_errors: bool = False,
    settings: Settings,
    engines: EngineSource | None = None,
    on_started: ProgressFn | None = None,
    on_progress: ProgressFn | None = None,
) -> Job:
    """Retry an ended job as its next attempt. A `run` job runs here to its end (the Job row
    returned is ended); a fleet job is queued for the workers (returned queued).
    `on_started(lines, missing)` once the attempt is recorded."""
    fail_abandoned_runs(settings)
    plan = plan_retry(settings, job_ref, all_errors=all_errors)
    with session_scope(settings) as session:
        reopened = state_machine.reopen_for_retry(
            session, plan.job_id, plan.shard_ids, lines=plan.lines, all_errors=all_errors
        )
        if reopened is None:
            raise JobStateError(f"job {plan.job_id} is no longer ended: another retry took it")
        session.flush()
        spec = JobSpec.model_validate(reopened.spec)
        local = reopened.local_run
        attempt = reopened.attempt
    log.info(
        "job %s: attempt %d runs %d lines in %d shards",
        plan.job_id,
        attempt,
        plan.lines,
        len(plan.shard_ids),
    )
    if on_started is not None:
        on_started(plan.lines, plan.missing)
    if not local:
        return dispatch_shards(plan.job_id, spec, plan.shard_ids, settings=settings)
    own_engines = engines is None
    return run_shards_here(
        plan.job_id,
        spec,
        settings=settings,
        engines=engines or EngineCache(settings),
        own_engines=own_engines,
        on_progress=on_progress,
        shard_ids=plan.shard_ids,
    )
