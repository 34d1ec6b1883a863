"""The engine and prefix parts: the in-process contenders and prefix grouping, taking turns on
one vLLM engine started for them, whose limits the end-to-end contenders get too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from batchllm.bench.config import BenchConfig
from batchllm.bench.figures import Contender
from batchllm.bench.own_engine import Say
from batchllm.bench.processes import END_TO_END_VARIANT, EngineLimits
from batchllm.bench.workload import Workload, size_context

_WARMUP = Workload(requests=128, prompt_words=(8, 64), output_tokens=(8, 32), seed=7)
_FIRST_VARIANT = 1


def run_shared_engine_parts(
    config: BenchConfig, model: str, parts: set[str], workdir: Path, say: Say
) -> tuple[dict[str, Contender], dict | None, dict]:
    """The in-process contenders and the prefix part, on one engine started here; and the
    engine's description."""
    from batchllm.bench.contenders import bench_settings, job_spec
    from batchllm.execution.engines import EngineCache

    workload = config.workload
    # Every timed run gets its own variant (distinct prompts); these are all that will run.
    engine_variants = range(
        _FIRST_VARIANT, _FIRST_VARIANT + (len(config.batch_sizes) + 2) * config.repeats
    )
    prefix_variants = range(2 * config.repeats)
    planned = [(_WARMUP, 0), (_WARMUP, 1), (workload, END_TO_END_VARIANT)]
    if "engine" in parts:
        planned += [(workload, v) for v in engine_variants]
    if "prefix" in parts:
        planned += [(config.prefix_workload, v) for v in prefix_variants]
    settings = bench_settings(workdir / "home")
    say("sizing the context for every run's requests")
    max_model_len = size_context(model, planned, settings)
    eager = config.enforce_eager
    spec = job_spec(model, workload, max_model_len, enforce_eager=eager)
    engines = EngineCache(settings)
    say(f"starting the shared vLLM engine ({model}, max_model_len {max_model_len})")
    started = time.perf_counter()
    engine = engines.get(spec, max_model_len)
    info = _engine_info(engine, started=started, max_model_len=max_model_len, eager=eager)
    contenders: dict[str, Contender] = {}
    prefix = None
    try:
        say("warming up (one generate, one job)")
        _warm_up(
            engines,
            model=model,
            max_model_len=max_model_len,
            settings=settings,
            eager=eager,
            workdir=workdir,
        )
        if "engine" in parts:
            contenders = _in_process(
                config, engines, spec, settings, workdir, model, iter(engine_variants), say
            )
        if "prefix" in parts:
            prefix = _prefix(
                config, engines, model, max_model_len, settings, workdir, prefix_variants, say
            )
    finally:
        engines.close()
    return contenders, prefix, info


def _engine_info(engine, *, started: float, max_model_len: int, eager: bool) -> dict[str, Any]:
    """The engine's version, hardware and start-up time, and the limits every contender runs."""
    from batchllm.bench.contenders import kv_cache_tokens

    scheduler = engine.engine.vllm_config.scheduler_config
    return {
        "version": engine.version,
        "hardware": engine.hardware,
        "start_seconds": time.perf_counter() - started,
        "kv_cache_tokens": kv_cache_tokens(engine),
        "limits": asdict(
            EngineLimits(
                max_model_len=max_model_len,
                max_num_seqs=scheduler.max_num_seqs,
                max_num_batched_tokens=scheduler.max_num_batched_tokens,
                dtype=engine.dtype,
                enforce_eager=eager,
            )
        ),
    }


def _warm_up(
    engines, *, model: str, max_model_len: int, settings, eager: bool, workdir: Path
) -> None:
    """One generate call and one job, untimed."""
    from batchllm.bench.contenders import Prompts, job_spec, run_generate, run_job_phase
    from batchllm.bench.workload import write_openai_chat

    run_generate(engines.engine, Prompts(engines.engine, _WARMUP, 0), None)
    warm = write_openai_chat(workdir / "warmup.jsonl", _WARMUP, 1, model=model)
    warmup_spec = job_spec(model, _WARMUP, max_model_len, enforce_eager=eager)
    run_job_phase(engines, warmup_spec, warm, settings)


def _prefix(
    config: BenchConfig,
    engines,
    model: str,
    max_model_len: int,
    settings,
    workdir: Path,
    variants: range,
    say: Say,
) -> dict[str, Any]:
    """The prefix part: the same job with and without prefix grouping."""
    from batchllm.bench.contenders import kv_cache_tokens
    from batchllm.bench.parts.prefix import run_prefix

    sides = run_prefix(
        engines,
        model=model,
        workload=config.prefix_workload,
        max_model_len=max_model_len,
        settings=settings,
        workdir=workdir,
        repeats=config.repeats,
        variants=iter(variants),
        kv_cache_bytes=config.prefix_kv_cache_bytes,
        say=say,
        enforce_eager=config.enforce_eager,
    )
    return {
        "workload": asdict(config.prefix_workload),
        "kv_cache_mib": config.prefix_kv_cache_mib,
        "kv_cache_tokens": kv_cache_tokens(engines.engine),
        **{key: c.summary() for key, c in sides.items()},
    }


def _in_process(
    config: BenchConfig,
    engines,
    spec,
    settings,
    workdir: Path,
    model: str,
    variants: Iterator[int],
    say: Say,
) -> dict[str, Contender]:
    """Raw vLLM, fixed batches and batchllm's engine phase, taking turns repeat by repeat."""
    from batchllm.bench.contenders import Prompts, run_generate, run_job_phase
    from batchllm.bench.workload import write_openai_chat

    engine = engines.engine
    workload = config.workload
    raw = Contender("vllm_generate", "raw vLLM: one generate call")
    batches = {
        size: Contender(f"vllm_batches_{size}", f"vLLM: fixed batches of {size}")
        for size in config.batch_sizes
    }
    job = Contender("batchllm_engine", "batchllm: job engine phase")

    def generate(batch: int | None):
        def go(variant: int):
            return run_generate(engine, Prompts(engine, workload, variant), batch)

        return go

    def run_job(variant: int):
        source = write_openai_chat(workdir / f"job-{variant}.jsonl", workload, variant, model=model)
        try:
            return run_job_phase(engines, spec, source, settings)
        finally:
            source.unlink()

    order = [(raw, generate(None)), *((c, generate(s)) for s, c in batches.items()), (job, run_job)]
    for repeat in range(config.repeats):
        for contender, go in order:
            run = go(next(variants))
            contender.runs.append(run)
            say(
                f"[engine] {contender.label}, repeat {repeat + 1}/{config.repeats}: "
                f"{run.output_tokens_per_s:,.0f} output tokens/s ({run.seconds:.1f} s)"
            )
    return {contender.key: contender for contender, _ in order}
