"""The job's max_model_len where a process is about to run it: as given or as sized at its
creation, or sized now from all its rows by the first process that needs it (the
`at_first_worker` policy of plan.py)."""

from __future__ import annotations

import logging

from batchllm.execution.context.passes import size_shards
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import get_one, read_one, session_scope
from batchllm.store.locks import lock_name
from batchllm.store.models import Job

log = logging.getLogger(__name__)


def resolve_max_model_len(job_id: str, *, settings: Settings) -> int:
    """The job's max_model_len: as given, or sized once from its rows and stored on the job.

    One process sizes a job. On PostgreSQL (a fleet) the job's sizing lock lets the first
    worker run the pass while the others that picked up the job wait for it and read the size
    it stored, instead of each running the whole pass (33 s for 100,000 rows). The lock is a
    transaction's (pg_advisory_xact_lock): a worker killed while sizing lets it go. On SQLite
    (one machine) no lock: its writers would wait the pass out too."""
    known = _stored_max_model_len(job_id, settings)
    if known:
        return known
    with session_scope(settings) as held:
        if held.get_bind().dialect.name == "postgresql":
            lock_name(held, f"sizing:{job_id}")
            known = _stored_max_model_len(job_id, settings)
            if known:
                log.info("job %s: max_model_len %d, sized by another worker", job_id, known)
                return known
        with session_scope(settings) as session:
            job = get_one(session, Job, job_id)
            spec = JobSpec.model_validate(job.spec)
            paths = [s.input_path for s in job.shards]
            storage = Storage.for_job(job, settings)
        # The ids go beside each shard, so the feed does not tokenize its rows again.
        sized = size_shards(spec, storage, paths, settings)
        with session_scope(settings) as session:
            return service.set_max_model_len(session, job_id, sized)


def _stored_max_model_len(job_id: str, settings: Settings) -> int | None:
    return read_one(settings, Job, job_id).max_model_len
