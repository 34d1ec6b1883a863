"""`batchllm run`: the whole job in this process, no broker. The same shard path as the fleet."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from pathlib import Path

from batchllm.errors import BatchLLMError
from batchllm.jobs import service
from batchllm.jobs.db import session_scope
from batchllm.jobs.models import Job
from batchllm.jobs.schemas import JobSpec
from batchllm.jobs.storage import Storage
from batchllm.settings import Settings, get_settings
from batchllm.worker.engines import EngineCache, resolve_max_model_len
from batchllm.worker.runner import ProgressFn, ShardRunner

log = logging.getLogger(__name__)


def run_job(source: str | Path, spec: JobSpec, *, strict: bool = False,
            settings: Settings | None = None, on_created: Callable[[Job], None] | None = None,
            on_progress: ProgressFn | None = None, engines: EngineCache | None = None) -> Job:
    """Validate, store and run a job to its end here; returns the final Job row.

    `engines` lets a caller (tests, bench) reuse one warm engine across jobs.
    """
    settings = settings or get_settings()
    storage = Storage(settings.resolved_storage)
    created = service.create_job(source, spec, shard_size=settings.shard_size, strict=strict,
                                 settings=settings)
    job_id = created.job.id
    if on_created:
        on_created(created.job)
    own_engines = engines is None
    engines = engines or EngineCache()
    try:
        max_model_len = resolve_max_model_len(job_id, storage=storage, settings=settings)
        engine = engines.get(spec, max_model_len)
        runner = ShardRunner(engine, worker=f"local@{socket.gethostname()}", settings=settings,
                             on_progress=on_progress)
        with session_scope(settings) as session:
            shard_ids = [s.id for s in session.get(Job, job_id).shards]
        runner.run(shard_ids)
    except BaseException as exc:
        reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
        with session_scope(settings) as session:
            service.fail_job(session, job_id, reason)
        if isinstance(exc, BatchLLMError) or not isinstance(exc, Exception):
            raise
        log.debug("job %s failed", job_id, exc_info=True)
        raise BatchLLMError(f"job {job_id} failed ({reason}); rows finished before the "
                            f"failure are kept in its output") from exc
    finally:
        if own_engines:
            engines.close()
    with session_scope(settings) as session:
        return session.get(Job, job_id)
