"""The prefix-cache part's fleet row: the same shuffled file submitted as one job of ten or more
shards to N real `batchllm worker` processes, each with its own vLLM engine built as the part's
(its context, its KV cache of `kv_documents` documents, prefix caching on), on a private Redis
and SQLite database; timed from the submit until the job row says completed, with which worker
ran each shard.

On a fleet a document's lines reuse its cached prefix only if they run on the worker that has it
cached: what the hit rate here shows is where the job's lines and shards went. Each worker's
engine threads get their own core (on 2 cores, vLLM would bind both engines to the same ones),
so the fleet holds the machine the in-process engines held, split.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.bench.parts.prefix_cache import (
    PrefixCacheConfig,
    Sizing,
    part_spec,
    row_figures,
    size_engines,
    tokenizer,
    write_lines,
)
from batchllm.bench.parts.warm import wait_ended
from batchllm.bench.parts.warm_worker import WorkerProcess
from batchllm.process.services import RedisServer, ServiceFailed
from batchllm.settings import Settings
from batchllm.spec import JobSpec

SHARDS = 10  # at least: the job's shard size is its lines over this, rounded up
PART = "prefix-cache fleet"
# An engine build takes 20-90 s here alone, and the workers build theirs at once on 2 cores.
READY_SECONDS = 900
JOB_SECONDS = 3600
_PROMPT_TOKENS = "batchllm_prompt_tokens_total"
_CACHED_TOKENS = "batchllm_prompt_cached_tokens_total"


def worker_flags(sizing: Sizing, *, enforce_eager: bool) -> list[str]:
    """A worker's engine flags: those the part builds its own engines with."""
    return [
        *("--max-model-len", str(sizing.max_model_len)),
        *("--kv-cache-memory-bytes", str(sizing.kv_cache_bytes)),
        "--prefix-caching",
        *(["--enforce-eager"] if enforce_eager else []),
    ]


def run_prefix_fleet(config: PrefixCacheConfig, *, workers: int = 2) -> dict[str, Any]:
    """Start `workers` workers, submit the part's file as a job of at least SHARDS shards with
    the part's context (so no worker sizes it), wait until it completes; its figures (as the
    part's other rows) with its shards, its workers and which ran each shard. Every process
    started here is ended, by PID, before it returns or raises."""
    from batchllm.bench.contenders import bench_settings
    from batchllm.store.db import get_engine

    if workers < 1:
        raise ValueError(f"a fleet needs at least one worker, not {workers}")
    say = config.say
    # The worker and the job must name the model alike: it is the queue and the metric label.
    path = Path(config.model)
    config = replace(config, model=str(path.resolve()) if path.exists() else config.model)
    source, lines = write_lines(config)
    probe = tokenizer(config.model)
    sizing = size_engines(config, [len(probe(prompt).input_ids) for _, prompt, _ in lines])
    spec = part_spec(config, len(lines), sizing, prefix_caching=True)
    shard_size = math.ceil(len(lines) / SHARDS)
    workdir = config.workdir / "fleet"
    redis = RedisServer(work_dir=workdir / "redis")
    fleet: list[WorkerProcess] = []
    try:
        try:
            redis.start()
        except ServiceFailed as exc:
            raise BenchFailed(f"{PART} needs a redis-server of its own: {exc}") from None
        settings = bench_settings(workdir / "home").model_copy(update={"broker_url": redis.url})
        get_engine(settings)  # creates and migrates the SQLite database before the workers open it
        say(
            f"[prefix-cache] fleet: starting {workers} `batchllm worker` processes "
            f"(max_model_len {sizing.max_model_len}, KV cache "
            f"{sizing.kv_cache_bytes / 2**20:,.1f} MiB each); logs in {workdir}"
        )
        for i in range(workers):
            fleet.append(_start_worker(i, config.model, sizing, config, settings, workdir))
        ready = [worker.wait_ready(READY_SECONDS) for worker in fleet]
        say(f"[prefix-cache] fleet: ready in {', '.join(f'{s:.0f} s' for s in ready)}")
        row = _time_job(source, spec, shard_size=shard_size, settings=settings, fleet=fleet)
        row["ready_seconds"] = ready
    finally:
        for worker in fleet:
            worker.stop()
        redis.stop()
    say(
        f"[prefix-cache] fleet: {row['seconds']:.1f} s submit to completed "
        f"({row['submit_seconds']:.1f} s in submit), {row['shards']} shards on "
        f"{workers} workers, {row['output_tokens_per_s']:,.0f} output tok/s, hit rate "
        f"{row['hit_rate']:.0%}"
    )
    return row


def _start_worker(
    i: int,
    model: str,
    sizing: Sizing,
    config: PrefixCacheConfig,
    settings: Settings,
    workdir: Path,
) -> WorkerProcess:
    cores = os.cpu_count() or 1
    return WorkerProcess(
        model=model,
        limits=worker_flags(sizing, enforce_eager=config.enforce_eager),
        settings=settings,
        log_path=workdir / f"worker-{i}.log",
        name=f"bench-fleet-{i}-{os.getpid()}@{socket.gethostname()}",
        env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
    )


def _time_job(
    source: Path, spec: JobSpec, *, shard_size: int, settings: Settings, fleet: list[WorkerProcess]
) -> dict[str, Any]:
    """Submit the file, wait for the job's row to say completed: the row's figures, its shards'
    workers, and each worker's own tokens (its Prometheus counters)."""
    from sqlalchemy import select

    from batchllm.input.files.source import resolve_input
    from batchllm.jobs.submit import submit_job
    from batchllm.store.db import session_scope
    from batchllm.store.models import Shard

    resolved = resolve_input(source, s3_endpoint=settings.resolved_s3_endpoint)
    started = time.monotonic()
    job_id = submit_job(resolved, spec, shard_size=shard_size, settings=settings).id
    submit_seconds = time.monotonic() - started
    ended = wait_ended(job_id, settings, timeout=JOB_SECONDS, part=PART)
    seconds = ended["seen_ended"] - started
    if ended["rows_failed"]:
        raise BenchFailed(f"{PART}: job {job_id} has {ended['rows_failed']} failed rows")
    with session_scope(settings) as session:
        shards = session.scalars(
            select(Shard).where(Shard.job_id == job_id).order_by(Shard.index)
        ).all()
        shard_workers = [shard.worker for shard in shards]
    starts = {worker.name: worker.engine_starts() for worker in fleet}
    rebuilt = {name: n for name, n in starts.items() if n != 1}
    if rebuilt:  # a job that rebuilt an engine would have timed a build
        raise BenchFailed(f"{PART}: engine starts per worker {rebuilt}; expected one each")
    row = row_figures(
        seconds, ended["prompt_tokens"] or 0, ended["output_tokens"] or 0, ended["cached_tokens"]
    )
    row.update(
        job_id=job_id,
        submit_seconds=submit_seconds,
        generation_seconds=(ended["finished"] - ended["first_row"]).total_seconds()
        if ended["finished"] and ended["first_row"]
        else None,
        shards=len(shard_workers),
        shard_size=shard_size,
        workers=len(fleet),
        shard_workers=shard_workers,
        per_worker={worker.name: _worker_tokens(worker, shard_workers) for worker in fleet},
    )
    return row


def _worker_tokens(worker: WorkerProcess, shard_workers: list[str | None]) -> dict[str, Any]:
    prompt, cached = worker.total(_PROMPT_TOKENS), worker.total(_CACHED_TOKENS)
    return {
        "shards": shard_workers.count(worker.name),
        "prompt_tokens": int(prompt),
        "cached_tokens": int(cached),
        "hit_rate": cached / prompt if prompt else 0.0,
    }
