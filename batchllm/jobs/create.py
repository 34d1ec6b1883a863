"""Creating a job: its row, its input validated and stored as shards, the shards recorded and
released to the fleet as they are stored, and the end of its validation. Every front door
(`submit`, `run`, the Batch API, a pipeline's stage, `retry`'s new job) comes through here;
the store only inserts and updates the rows."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from batchllm.errors import InputError, StorageError
from batchllm.execution.context.plan import ContextPlan, plain_plan
from batchllm.input.adapters import store_adapters
from batchllm.input.files.source import InputSource
from batchllm.input.shards import ShardInput, StoredInput, store_input
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store import service, state_machine
from batchllm.store.db import get_one, session_scope
from batchllm.store.models import Job, JobStatus, utcnow
from batchllm.store.shard_recording import ReleaseShards, ShardRecorder
from batchllm.store.webhooks import WebhookTarget

log = logging.getLogger(__name__)


@dataclass
class CreatedJob:
    job: Job
    stored: StoredInput
    # What the job's caller must finish it in when its shards all ended during its validation
    # (a fleet ran them meanwhile): FINALIZING, write its manifest (state_machine.end_validation).
    ended: JobStatus | None = None


def create_job(
    source: InputSource,
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
    context: ContextPlan | None = None,
) -> CreatedJob:
    """Validate and store the input, recording the job and its shards as `queued`.

    `release(job_id, shard_ids)`: queue committed shards for the fleet. When the job's
    max_model_len is given, or sized shard by shard by its `context` plan, it is called while
    validation goes on, with the shards stored so far (store/shard_recording.py), so a big
    file starts working within seconds; otherwise, and under --strict, once the whole file is
    stored.

    A file refused under --strict leaves a `failed` job with the reason, like the OpenAI API;
    so does a job storage that cannot be written (StorageError). `notify`: where the job's end
    is announced (store/webhooks.py). `source`: the input as a front door resolved it
    (input/files/source.py). `hold`: the job waits for the jobs it runs after (spec.after): it
    ends `waiting`, none of its shards released (store/dependencies.py releases them).
    `context`: how the job's max_model_len is settled (execution/context/plan.py); its pass
    sees each stored shard before it is recorded and released, and the max_model_len it sized,
    if any, is the job's. Without one: as given, or by the job's first worker.
    """
    if hold:
        release = None
    storage = Storage.of(settings)  # a new job's storage: where the settings say now
    job_id = service.new_job_id()
    if spec.adapters:
        # Workers load adapters from the job's storage, wherever the job was submitted.
        spec = spec.model_copy(update={"adapters": store_adapters(storage, job_id, spec.adapters)})
    with session_scope(settings) as session:
        session.add(
            service.job_row(
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
    context = context or plain_plan(spec)
    context.start(storage)
    log.debug("job %s: context length %s", job_id, context.policy.value)
    intake = _ShardIntake(job_id, settings, release, strict, context, on_shard)
    stored = _store(source, spec, storage, job_id, settings, shard_size, strict, intake)
    job, ended = intake.finish(stored, hold)
    log.info(
        "job %s: %d requests (%d invalid) in %d shards",
        job_id,
        stored.total,
        stored.invalid,
        len(stored.shards),
    )
    return CreatedJob(job=job, stored=stored, ended=ended)


class _ShardIntake:
    """Each shard as it is stored: prepared (sized) when the job has a preparer, recorded, and
    released to the fleet while validation goes on when the job's context length allows it."""

    def __init__(
        self,
        job_id: str,
        settings: Settings,
        release: ReleaseShards | None,
        strict: bool,
        context: ContextPlan,
        on_shard: Callable[[ShardInput], None] | None,
    ) -> None:
        self.job_id, self.settings, self.on_shard = job_id, settings, on_shard
        self.preparer = context.preparer  # started by create_job in the job's storage
        streams = release is not None and not strict
        # Streaming needs the context length up front: without it the first worker sizes the
        # job from all of its rows (execution/context/resolve.py), which must all be there.
        self.recorder = ShardRecorder(
            settings, job_id, release, stream=streams and context.known_up_front
        )
        # Or a context length sized as the shards come: submit's token pass measures each
        # shard before it is recorded, and the job's max_model_len is raised to cover it
        # before it is released.
        self.sizes_as_it_goes = streams and context.sized_as_stored and self.preparer is not None
        self.covered: int | None = None  # the max_model_len recorded for the shards released

    def stored(self, shard: ShardInput) -> None:
        if self.preparer is None:
            self.recorder.add(shard)
        else:  # recorded (and released) once prepared; on this thread, which owns the session
            self.preparer.stored(shard)
            ready = self.preparer.ready()
            if ready and self.sizes_as_it_goes:
                self._cover(self.preparer.sized_so_far())
            for prepared in ready:
                self.recorder.add(prepared)
        if self.on_shard is not None:
            self.on_shard(shard)

    def _cover(self, sized: int | None) -> None:
        if sized is not None and sized != self.covered:
            with session_scope(self.settings) as session:
                service.record_sized_so_far(session, self.job_id, sized)
            self.covered = sized
        # From the first shard the pass cannot size on, the rest wait for the end.
        self.recorder.stream = sized is not None

    def abandon(self) -> None:
        if self.preparer is not None:
            self.preparer.close()

    def finish(self, stored: StoredInput, hold: bool) -> tuple[Job, JobStatus | None]:
        """Record the shards left and end the job's validation; then release what is left."""
        sized = counted = None
        if self.preparer is not None:
            sized = self.preparer.finish()
            counted = self.preparer.counted()
            self.recorder.stream = False  # released after the commit that records the size
            for prepared in self.preparer.ready():
                self.recorder.add(prepared)
        with session_scope(self.settings) as session:
            if counted is not None:  # exact: what its key's enqueued-token limit holds
                service.record_prompt_tokens(session, self.job_id, counted)
            if sized is not None:
                service.record_sized_so_far(session, self.job_id, sized)
            elif self.covered is not None:
                # The pass stopped after shards ran on a size of part of the job: a worker
                # sizes the whole job again, from all of its rows.
                service.forget_max_model_len(session, self.job_id)
            self.recorder.record_rest(session)
            ended = state_machine.end_validation(
                session,
                self.job_id,
                shards_total=len(stored.shards),
                request_total=stored.total,
                hold=hold,
            )
            job = get_one(session, Job, self.job_id)
        self.recorder.release_rest()
        return job, ended


def _store(
    source: InputSource,
    spec: JobSpec,
    storage: Storage,
    job_id: str,
    settings: Settings,
    shard_size: int,
    strict: bool,
    intake: _ShardIntake,
) -> StoredInput:
    """Validate and store the input as shards; a refused file or an unwritable storage fails
    the job with the reason and raises."""
    try:
        # The output directory first: a worker may write the first shard's rows before the
        # last one is stored.
        storage.makedirs(storage.output_dir(job_id))
        return store_input(
            source,
            storage,
            job_id,
            settings=settings,
            shard_size=shard_size,
            strict=strict,
            adapters=frozenset(spec.adapters),
            task=spec.engine.task,
            table=spec.table,
            on_shard=intake.stored,
            place=places_prefixes(spec, settings),
        )
    except (InputError, StorageError, OSError) as exc:
        intake.abandon()
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
        intake.abandon()
        raise


def places_prefixes(spec: JobSpec, settings: Settings) -> bool:
    """Whether a job's rows are written in placement order (input/shards.py): generation
    jobs that group prefixes, unless the operator turned it off. Pooling jobs (embed, score,
    classify) have no prefix cache to fill and keep file order."""
    return settings.place_prefixes and spec.engine.group_prefixes and spec.engine.task == "generate"


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
    job_id = service.new_job_id()
    with session_scope(settings) as session:
        session.add(
            service.job_row(
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
