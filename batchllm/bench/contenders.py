"""The in-process contenders, one after another on one shared vLLM engine.

Raw vLLM gets pre-tokenized prompts (`TokensPrompt`) so its figure is the engine alone; the
batchllm contender is the job path after validation: the continuous feed with tokenization,
per-row bookkeeping, Parquet part files and database checkpoints, through the real `run_job`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batchllm.bench.figures import BenchFailed, Run, job_run
from batchllm.bench.memory import PeakRss
from batchllm.bench.workload import Workload, iter_requests
from batchllm.engine.protocol import EngineSource
from batchllm.execution.engines import EngineCache
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults

if TYPE_CHECKING:
    from batchllm.store.models import Job


def job_spec(
    model: str,
    workload: Workload,
    max_model_len: int,
    *,
    group_prefixes: bool = True,
    kv_cache_bytes: int | None = None,
    enforce_eager: bool = False,
) -> JobSpec:
    """Job defaults equal to what every request line asks for, so the lines decide nothing."""
    return JobSpec(
        model=model,
        sampling=SamplingDefaults(
            max_tokens=workload.max_output,
            temperature=workload.temperature,
            ignore_eos=workload.ignore_eos,
        ),
        engine=EngineOptions(
            max_model_len=max_model_len,
            group_prefixes=group_prefixes,
            kv_cache_memory_bytes=kv_cache_bytes,
            enforce_eager=enforce_eager,
        ),
    )


def engine_info(engine, *, started: float, max_model_len: int, **extra) -> dict:
    """What the bench records of an engine it built: version, hardware, start seconds (from
    `started`, a perf_counter reading) and the scheduler's limits, plus `extra`."""
    import time

    scheduler = engine.engine.vllm_config.scheduler_config
    return {
        "version": engine.version,
        "hardware": engine.hardware,
        "start_seconds": time.perf_counter() - started,
        "max_model_len": max_model_len,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "kv_cache_tokens": kv_cache_tokens(engine),
        **extra,
    }


def kv_cache_tokens(engine) -> int:
    """How many tokens the engine's KV cache holds, as vLLM allocated it."""
    cache = engine.engine.vllm_config.cache_config
    return int(cache.num_gpu_blocks or 0) * int(cache.block_size)


def bench_settings(home: Path) -> Settings:
    """A private BATCHLLM_HOME: the bench never touches the user's jobs or database."""
    return Settings(
        home=home, database_url=f"sqlite:///{home / 'batchllm.db'}", storage=str(home / "jobs")
    )


class Prompts:
    """One variant of a workload, tokenized before any timing, as raw vLLM receives it."""

    def __init__(self, engine, workload: Workload, variant: int) -> None:
        from vllm import SamplingParams

        requests = list(iter_requests(workload, variant))
        ids = engine.prepare([r.row(line) for line, r in enumerate(requests, start=1)])
        bad = [i for i in ids if isinstance(i, str)]
        if bad:
            raise BenchFailed(f"a bench prompt cannot run: {bad[0]}")
        self.prompts = [{"prompt_token_ids": i} for i in ids]
        self.params = [
            SamplingParams(
                max_tokens=r.max_tokens, temperature=r.temperature, ignore_eos=r.ignore_eos
            )
            for r in requests
        ]


def run_generate(engine, prompts: Prompts, batch: int | None) -> Run:
    """`LLM.generate` with every prompt at once (batch None) or `batch` prompts per call."""
    size = batch or len(prompts.prompts)
    outputs = []
    with PeakRss() as memory:
        started = time.perf_counter()
        for start in range(0, len(prompts.prompts), size):
            outputs += engine.llm.generate(
                prompts.prompts[start : start + size],
                prompts.params[start : start + size],
                use_tqdm=False,
            )
        seconds = time.perf_counter() - started
    return Run(
        seconds=seconds,
        requests=len(outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        peak_rss=memory.peak,
    )


@dataclass(frozen=True)
class TimedJob:
    """A job `run_job` ran to its end, with perf_counter readings of its phases."""

    job: Job
    started: float  # run_job called
    stored: float  # the input validated and stored (nan: the job was refused before)
    ended: float  # run_job returned


def timed_run_job(
    engines: EngineSource, spec: JobSpec, source: Path, settings: Settings
) -> TimedJob:
    """The whole `run_job`, the end of its validation and storage marked (`on_created`)."""
    from batchllm.input.files.source import resolve_input
    from batchllm.jobs.local import run_job

    # Resolved before the clock starts, as `batchllm run` resolves its FILE with its flags.
    resolved = resolve_input(source, s3_endpoint=settings.resolved_s3_endpoint)
    stored_at: list[float] = []
    started = time.perf_counter()
    job = run_job(
        resolved,
        spec,
        settings=settings,
        engines=engines,
        on_created=lambda _job: stored_at.append(time.perf_counter()),
    )
    ended = time.perf_counter()
    return TimedJob(job, started, stored_at[0] if stored_at else math.nan, ended)


def run_job_phase(engines: EngineCache, spec: JobSpec, source: Path, settings: Settings) -> Run:
    """The whole `run_job`, timed from the end of validation and storage to the finished job."""
    from batchllm.store.models import JobStatus

    with PeakRss() as memory:
        timed = timed_run_job(engines, spec, source, settings)
    job = timed.job
    if job.status is not JobStatus.COMPLETED:
        raise BenchFailed(f"bench job {job.id} ended {job.status.value}: {job.error}")
    return job_run(
        job,
        seconds=timed.ended - timed.stored,
        peak_rss=memory.peak,
        validation_seconds=timed.stored - timed.started,
        sql_output_tokens_per_s=job.output_tokens_per_s,
    )
