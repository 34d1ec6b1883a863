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
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from batchllm.bench.config import DEFAULT_PARTS as DEFAULT_PARTS  # tests/engine import it from here
from batchllm.bench.config import BenchConfig
from batchllm.bench.figures import BenchFailed, Contender
from batchllm.bench.own_engine import OwnEnginePart, Say
from batchllm.bench.processes import EngineLimits, run_end_to_end
from batchllm.bench.shared_engine import run_shared_engine_parts
from batchllm.bench.targets import add_ratios_and_targets
from batchllm.bench.workload import size_context


def resolve_model(config: BenchConfig, say: Say) -> str:
    if config.model:
        return config.model
    path = config.output / "model"
    if not (path / "config.json").exists():
        from batchllm.engine.models.demo_model import build_demo_model

        say(f"building the tiny demo model in {path}")
        build_demo_model(path)
    return str(path)


def run_bench(config: BenchConfig, say: Say = print) -> dict[str, Any]:
    parts = set(config.parts)
    if parts & {"peers", "kept"}:  # before anything costly: no llama.cpp, no such part
        _require_llama_cpp(config)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    workdir = config.output / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    model = resolve_model(config, say)
    result: dict[str, Any] = {"config": _config_dict(config, model)}
    _run_contenders(config, model, parts, workdir, result, say)
    # Each starts (and shuts down) an engine of its own, after the shared one is gone.
    for part, run_part in _OWN_ENGINE_PARTS.items():
        if part in parts:
            result[part.replace("-", "_")] = run_part(config, model, workdir, say)
    add_ratios_and_targets(result)
    result["seconds"] = time.perf_counter() - began
    return result


def _require_llama_cpp(config: BenchConfig) -> None:
    from batchllm.bench.parts.llama_cpp import find_llama_server

    find_llama_server(config.llama_server)
    if not config.model:
        raise BenchFailed(
            "the peers and kept parts compare engines on the demo's chat model, whose GGUF "
            "llama.cpp loads: pass --model .demo/chat (`make bench-peers` builds it)"
        )


def _run_contenders(
    config: BenchConfig,
    model: str,
    parts: set[str],
    workdir: Path,
    result: dict[str, Any],
    say: Say,
) -> None:
    """The engine, prefix, run-batch and run parts: the shared engine's, then the end-to-end
    contenders, into `result`."""
    contenders: dict[str, Contender] = {}
    if parts & {"engine", "prefix", "run-batch", "run"}:
        # Built even for the end-to-end parts alone: its scheduler limits are theirs too.
        contenders, result["prefix"], result["engine"] = run_shared_engine_parts(
            config, model, parts, workdir, say
        )
    if parts & {"run-batch", "run"}:
        contenders.update(
            run_end_to_end(
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


def _features(config: BenchConfig, model: str, workdir: Path, say: Say) -> dict[str, Any]:
    from batchllm.bench.parts.features import run_features

    return run_features(
        _own_engine_part(config, model, workdir, "features", say),
        requests=config.feature_requests,
        prompt_words=config.prompt_words,
        max_tokens=config.feature_max_tokens,
    )


def _embed(config: BenchConfig, model: str, workdir: Path, say: Say) -> dict[str, Any]:
    from batchllm.bench.parts.embed import run_embed

    return run_embed(
        _own_engine_part(config, model, workdir, "embed", say),
        texts=config.embed_texts,
        words=config.prompt_words,
    )


def _warm(config: BenchConfig, model: str, workdir: Path, say: Say) -> dict[str, Any]:
    from batchllm.bench.parts.warm import run_warm

    return run_warm(
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


def _prefix_cache(config: BenchConfig, model: str, workdir: Path, say: Say) -> dict[str, Any]:
    """The part's rows; the fleet's (if asked) after them, once the part's own engines are shut
    down, so the workers' engines have the machine to themselves."""
    from batchllm.bench.contenders import bench_settings
    from batchllm.bench.parts.prefix_cache import FLEET, PrefixCacheConfig, run_prefix_cache

    part = PrefixCacheConfig(
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
    result = run_prefix_cache(part)
    if config.prefix_fleet_workers:
        from batchllm.bench.parts.prefix_fleet import run_prefix_fleet

        result["rows"][FLEET] = run_prefix_fleet(part, workers=config.prefix_fleet_workers)
    return result


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
    workdir = workdir / "peers"
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
    workdir = workdir / "kept"
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
    from batchllm.engine.sizing import model_limit

    return model_limit(model)


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


# The parts after the shared engine's, in the order they run; each result's key is the part's
# name in snake case.
_OWN_ENGINE_PARTS: dict[str, Callable[[BenchConfig, str, Path, Say], dict[str, Any]]] = {
    "features": _features,
    "embed": _embed,
    "warm": _warm,
    "overhead": _overhead,
    "peers": _peers,
    "kept": _kept,
    "prefix-cache": _prefix_cache,
}


def write_results(result: dict[str, Any], output: Path) -> tuple[Path, Path]:
    """bench.json with every figure, bench.png with the chart; returns both paths."""
    from batchllm.bench.chart import draw_chart

    data = output / "bench.json"
    data.write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
    return data, draw_chart(result, output / "bench.png")
