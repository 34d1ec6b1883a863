"""`batchllm run`: the whole job in this process, no broker. The same shard path as the fleet."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from batchllm.engine.protocol import EngineSource
from batchllm.errors import BatchLLMError, EngineDied, InputError, JobInterrupted
from batchllm.execution.context.plan import ContextPlan, ContextPolicy, plan_for_run
from batchllm.execution.context.resolve import resolve_max_model_len
from batchllm.execution.runner import ProgressFn, ShardRunner
from batchllm.execution.webhooks import deliver_soon
from batchllm.input.files.source import InputSource
from batchllm.jobs.create import create_job
from batchllm.kept_engine.client import KeptEngines, size_on
from batchllm.process.stopping import Signalled, StopRequest, stop_on_first_interrupt
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.store import recovery, service, state_machine
from batchllm.store.db import get_one, read_one, session_scope
from batchllm.store.models import Job, JobStatus
from batchllm.store.webhooks import WebhookTarget

log = logging.getLogger(__name__)

# How long `run` keeps retrying its job's webhook before leaving it to a reconciler.
_NOTIFY_WITHIN_SECONDS = 30.0


def run_job(
    source: InputSource,
    spec: JobSpec,
    *,
    strict: bool = False,
    settings: Settings,
    on_created: Callable[[Job], None] | None = None,
    on_progress: ProgressFn | None = None,
    engines: EngineSource | None = None,
    notify: WebhookTarget | None = None,
) -> Job:
    """Validate, store and run a job to its end here; returns the final Job row. `source`: the
    input as a front door resolved it, so a missing file was reported before any engine starts.

    `engines` lets a caller (tests, bench) reuse one warm engine across jobs. `notify`: the
    job's end is POSTed there once it ended (retried here for a while, then by a reconciler).
    """
    if spec.after:
        raise InputError(
            "--after is for jobs submitted to the fleet; a local run starts at once "
            "(`batchllm wait` for the other job first)"
        )
    own_engines = engines is None
    engines = engines or KeptEngines(settings)
    if isinstance(engines, KeptEngines):
        # First: vLLM loads in a kept engine's process while this one validates and sizes
        # the file (a cold start's imports are most of it, issue 63).
        engines.prestart(spec)
    fail_abandoned_runs(settings)
    try:
        job_id, engine_error = _create(
            source,
            spec,
            strict=strict,
            settings=settings,
            engines=engines,
            on_created=on_created,
            notify=notify,
        )
    except BaseException:
        if own_engines:
            engines.close()
        raise
    return run_shards_here(
        job_id,
        spec,
        settings=settings,
        engines=engines,
        own_engines=own_engines,
        on_progress=on_progress,
        engine_error=engine_error,
    )


def fail_abandoned_runs(settings: Settings) -> None:
    """End `failed` the jobs of `batchllm run` processes that were killed mid-run."""
    with session_scope(settings) as session:
        for abandoned in recovery.fail_abandoned_local_runs(session, settings.lease_seconds):
            log.warning(
                "job %s: the `batchllm run` that ran it was killed; marked failed "
                "(its committed rows are kept)",
                abandoned,
            )


def run_shards_here(
    job_id: str,
    spec: JobSpec,
    *,
    settings: Settings,
    engines: EngineSource,
    own_engines: bool,
    on_progress: ProgressFn | None = None,
    shard_ids: list[int] | None = None,
    engine_error: BaseException | None = None,
) -> Job:
    """Run a created job's shards (all, or `shard_ids`: a retry's) to their end in this
    process; returns the final Job row. Any failure, a Ctrl-C too, ends the job failed with
    the rows finished before kept. `own_engines`: close `engines` afterwards."""
    interrupted = threading.Event()
    try:
        if engine_error is not None:
            raise engine_error
        max_model_len = resolve_max_model_len(job_id, settings=settings)
        if shard_ids is None:
            with session_scope(settings) as session:
                shard_ids = [s.id for s in get_one(session, Job, job_id).shards]
        with stop_on_first_interrupt(interrupted):
            _run_through_engine_deaths(
                job_id,
                spec,
                shard_ids,
                max_model_len,
                engines=engines,
                settings=settings,
                on_progress=on_progress,
                interrupted=interrupted,
            )
        if interrupted.is_set():
            with session_scope(settings) as session:
                finished = service.job_status(session, job_id) is JobStatus.COMPLETED
            if not finished:  # else the Ctrl-C came during the last step: the job did finish
                raise KeyboardInterrupt
    except BaseException as exc:
        was_interrupted = interrupted.is_set() or isinstance(exc, KeyboardInterrupt)
        reason = (
            "interrupted"
            if was_interrupted
            else str(exc)
            if isinstance(exc, Signalled)
            else f"{type(exc).__name__}: {exc}"
        )
        with session_scope(settings) as session:
            state_machine.fail_job(session, job_id, reason)
        if was_interrupted:
            raise JobInterrupted(
                f"job {job_id} interrupted: it ended failed; the rows "
                "finished before are kept in its output"
            ) from None
        deliberate = isinstance(exc, BatchLLMError) and not isinstance(exc, EngineDied)
        if deliberate or not isinstance(exc, Exception):
            raise
        log.debug("job %s failed", job_id, exc_info=True)
        raise BatchLLMError(
            f"job {job_id} failed ({reason}); rows finished before the "
            f"failure are kept in its output"
        ) from exc
    finally:
        if own_engines:
            engines.close()
        _announce_end(job_id, settings)
    return read_one(settings, Job, job_id)


def _run_through_engine_deaths(
    job_id: str,
    spec: JobSpec,
    shard_ids: list[int],
    max_model_len: int,
    *,
    engines: EngineSource,
    settings: Settings,
    on_progress: ProgressFn | None,
    interrupted: threading.Event,
) -> None:
    """Run the shards; when the engine dies, on a new engine again, as a fleet redelivers a
    shard: its committed rows are kept and only the others run (each death counts against the
    shard's BATCHLLM_MAX_SHARD_ATTEMPTS, past which the shard fails and the job with it)."""
    for restart in range(settings.max_shard_attempts + 1):
        runner = ShardRunner(
            engines.get(spec, max_model_len),
            worker=f"local@{socket.gethostname()}",
            settings=settings,
            on_progress=on_progress,
            stop=StopRequest(requested=interrupted),  # Ctrl-C stops at once: no drain
            first_wave=settings.first_wave,
        )
        try:
            runner.run(shard_ids)
            return
        except EngineDied as exc:
            with session_scope(settings) as session:
                status = service.job_status(session, job_id)
            ended = status is not None and status.is_final
            if ended or interrupted.is_set() or restart == settings.max_shard_attempts:
                raise
            log.warning(
                "job %s: the engine died (%s); starting a new one, the rows already "
                "committed are kept",
                job_id,
                exc,
            )
            engines.close()


def _announce_end(job_id: str, settings: Settings) -> None:
    """A job with a webhook (`--notify`; a retry's run too) POSTs its end from here first."""
    with session_scope(settings) as session:
        has_webhook = get_one(session, Job, job_id).notify_url is not None
    if has_webhook:
        deliver_soon(job_id, settings, within_seconds=_NOTIFY_WITHIN_SECONDS)


def _create(
    source: InputSource,
    spec: JobSpec,
    *,
    strict: bool,
    settings: Settings,
    engines: EngineSource,
    on_created: Callable[[Job], None] | None,
    notify: WebhookTarget | None = None,
) -> tuple[str, BaseException | None]:
    """Create the job; when the context length is given, start the engine meanwhile.
    Returns the job id and the error of the engine start or of the sizing pass, if one failed
    after the job was created (the caller fails the job with it).

    Starting the engine (~20-30 s on the tiny model, minutes for a large one) and validating and
    storing the file need nothing from each other once max_model_len is known, so they overlap:
    the engine is built on this (main) thread, where vLLM may install signal handlers, while
    a helper thread creates the job. Not under --strict: a refused file should be reported at
    once, not after an engine start it did not need. An unsized job is sized as its plan says
    (execution/context/plan.py): beside the validation, or on a kept engine up for its model.
    """

    def create(context: ContextPlan) -> str:
        created = create_job(
            source,
            spec,
            shard_size=settings.shard_size,
            strict=strict,
            settings=settings,
            local_run=True,
            notify=notify,
            context=context,
        )
        if on_created:
            on_created(created.job)
        return created.job.id

    plan = plan_for_run(spec, settings, size_on_kept=_kept_sizer(spec, settings, engines))
    if plan.policy is not ContextPolicy.GIVEN or strict:
        job_id = create(plan)
        return job_id, plan.failure()
    early = spec.engine.max_model_len
    assert early is not None  # the `given` policy
    outcome: dict[str, object] = {}

    def create_in_thread() -> None:
        try:
            outcome["job_id"] = create(plan)
        except BaseException as exc:  # re-raised on the main thread
            outcome["error"] = exc

    # A daemon: after a second Ctrl-C the process may exit without waiting for it.
    helper = threading.Thread(target=create_in_thread, name="batchllm-create-job", daemon=True)
    helper.start()
    engine_error: BaseException | None = None
    try:
        engines.get(spec, early)
    except BaseException as exc:
        engine_error = exc
        if isinstance(exc, KeyboardInterrupt) and helper.is_alive():
            log.warning(
                "interrupted: finishing the file's validation to record the job as "
                "failed (Ctrl-C again to quit at once)"
            )
    helper.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return str(outcome["job_id"]), engine_error


def _kept_sizer(
    spec: JobSpec, settings: Settings, engines: EngineSource
) -> Callable[[list[str]], int] | None:
    """Sizing on a kept engine that is up for the job's model, for an unsized job."""
    if spec.engine.max_model_len is not None or not isinstance(engines, KeptEngines):
        return None
    warm = engines.warm(spec)
    if warm is None:
        return None
    return lambda paths: size_on(warm, spec, settings, paths)
