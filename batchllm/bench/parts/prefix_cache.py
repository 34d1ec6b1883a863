"""The prefix-cache part: batch work that repeats itself (each of N documents asked M questions,
the lines shuffled, as a file of RAG or extraction requests comes) through raw `LLM.generate`
with vLLM's prefix cache off, with it on, with it on over the lines sorted by document (what a
user could reach by hand), and through batchllm's job, which orders each shard's rows by their
prompt so the lines sharing a document run while it is cached; optionally (the suite's
`prefix_fleet_workers`) the same file as a job of ten shards on a fleet of `batchllm worker`
processes, the FLEET row (prefix_fleet.py).

vLLM's cache is LRU over KV blocks: when the KV cache cannot hold every document at once (a
GPU's, full of running requests, usually cannot), a shuffled file evicts a document before its
next question comes. The part gives every engine a KV cache of `kv_documents` documents, so
the cache is under that pressure here too; each contender starts from an empty prefix cache.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.bench.own_engine import Say
from batchllm.input.files.source import resolve_input
from batchllm.jobs.create import create_job
from batchllm.settings import Settings
from batchllm.spec import JobSpec

RAW_OFF, RAW_ON, RAW_SORTED, JOB = "raw_cache_off", "raw_cache_on", "raw_sorted", "batchllm"
SHARDED, SHARDED_FILE_ORDER = "batchllm_sharded", "batchllm_sharded_file_order"
FLEET = "batchllm_fleet"
MANY_SHARDS = 10  # the many-shards rows: the same file in this many shards (or more)
LABELS = {
    RAW_OFF: "raw generate, prefix cache off, shuffled",
    RAW_ON: "raw generate, prefix cache on, shuffled",
    RAW_SORTED: "raw generate, prefix cache on, sorted by document (by hand)",
    JOB: "batchllm job engine phase, shuffled file",
    SHARDED: f"batchllm job, {MANY_SHARDS}+ shards, placed job-wide",
    SHARDED_FILE_ORDER: f"batchllm job, {MANY_SHARDS}+ shards, in file order (before placement)",
    FLEET: "batchllm job on a worker fleet, submit to completed",
}
_WORDS = (
    "river stone market winter signal harbor copper garden ledger orbit lantern meadow "
    "quarry saddle timber violet anchor beacon cinder delta ember fabric glacier hollow "
    "island jasper kettle lumen marble nectar oyster pepper quiver ribbon silver tundra "
    "umber velvet willow yonder zephyr"
).split()


@dataclass(frozen=True)
class PrefixCacheConfig:
    model: str
    documents: int
    questions: int  # per document
    document_words: int
    max_tokens: int
    kv_documents: float  # the KV cache holds this many documents' tokens
    settings: Settings
    workdir: Path
    say: Say
    enforce_eager: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Sizing:
    """What every engine of the part is built with, from its lines' prompt lengths."""

    max_model_len: int
    prompt_tokens_per_line: float
    kv_cache_bytes: int


def size_engines(config: PrefixCacheConfig, lengths: list[int]) -> Sizing:
    """The context of the longest line and its answer (a multiple of 64), and a KV cache of
    `kv_documents` documents."""
    max_model_len = -(-(max(lengths) + config.max_tokens) // 64) * 64
    per_document = sum(lengths) / len(lengths)
    return Sizing(max_model_len, per_document, _kv_bytes(config, per_document, max_model_len))


def part_spec(
    config: PrefixCacheConfig, lines: int, sizing: Sizing, *, prefix_caching: bool
) -> JobSpec:
    """The job's spec over the part's file, greedy with a fixed answer length (as `_generate`
    samples: every contender decodes alike), on an engine of `sizing`."""
    from batchllm.bench.contenders import job_spec
    from batchllm.bench.workload import Workload

    workload = Workload(
        requests=lines,
        prompt_words=(1, 1),
        output_tokens=(config.max_tokens,) * 2,
        greedy=True,
    )
    spec = job_spec(
        config.model,
        workload,
        sizing.max_model_len,
        kv_cache_bytes=sizing.kv_cache_bytes,
        enforce_eager=config.enforce_eager,
    )
    engine = spec.engine.model_copy(update={"enable_prefix_caching": prefix_caching})
    return spec.model_copy(update={"engine": engine})


def write_lines(config: PrefixCacheConfig) -> tuple[Path, list[tuple[str, str, int]]]:
    """The shuffled file (plain prompts: a document, then one question about it) and its lines
    as (custom_id, prompt, document)."""
    rng = random.Random(config.seed)
    documents = [
        f"Document {d}. " + " ".join(rng.choice(_WORDS) for _ in range(config.document_words))
        for d in range(config.documents)
    ]
    lines = [
        (
            f"d{d}-q{q}",
            f"{text}\n\nQuestion {q}: what does the document say about "
            f"{rng.choice(_WORDS)}?\nAnswer:",
            d,
        )
        for d, text in enumerate(documents)
        for q in range(config.questions)
    ]
    rng.shuffle(lines)
    path = config.workdir / "shared-documents.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for custom_id, prompt, _ in lines:
            out.write(json.dumps({"custom_id": custom_id, "prompt": prompt}) + "\n")
    return path, lines


def run_prefix_cache(config: PrefixCacheConfig) -> dict[str, Any]:
    from batchllm.bench.contenders import kv_cache_tokens
    from batchllm.execution.engines import EngineCache

    say = config.say
    source, lines = write_lines(config)
    cache_on = EngineCache(config.settings)
    cache_off = EngineCache(config.settings)
    try:
        probe = tokenizer(config.model)
        sizing = size_engines(config, [len(probe(prompt).input_ids) for _, prompt, _ in lines])
        max_model_len, per_document = sizing.max_model_len, sizing.prompt_tokens_per_line
        specs = {
            on: part_spec(config, len(lines), sizing, prefix_caching=on) for on in (True, False)
        }
        say(
            f"[prefix-cache] {config.documents} documents x {config.questions} questions, "
            f"~{per_document:,.0f} prompt tokens a line, a KV cache of "
            f"{config.kv_documents:g} documents; starting two engines (prefix cache on, off)"
        )
        engine_on = cache_on.get(specs[True], max_model_len)
        engine_off = cache_off.get(specs[False], max_model_len)
        ids = {custom_id: probe(prompt).input_ids for custom_id, prompt, _ in lines}
        shuffled = [ids[c] for c, _, _ in lines]
        by_document = [ids[c] for c, _, _ in sorted(lines, key=lambda line: line[2])]
        runs: dict[str, dict[str, Any]] = {}
        runs[RAW_OFF] = _generate(engine_off, shuffled, config.max_tokens)
        for key, prompts in ((RAW_ON, shuffled), (RAW_SORTED, by_document)):
            engine_on.llm.reset_prefix_cache()
            runs[key] = _generate(engine_on, prompts, config.max_tokens)
        # Each job row starts from an empty prefix cache, as the raw ones do.
        many = -(-len(lines) // MANY_SHARDS)
        for key, shard_size, placed in (
            (JOB, config.settings.shard_size, True),
            (SHARDED, many, True),
            (SHARDED_FILE_ORDER, many, False),
        ):
            engine_on.llm.reset_prefix_cache()
            settings = config.settings.model_copy(
                update={"shard_size": shard_size, "place_prefixes": placed}
            )
            runs[key] = _job_engine_phase(cache_on, specs[True], source, settings)
        for key, row in runs.items():
            say(
                f"[prefix-cache] {LABELS[key]}: {row['seconds']:.1f} s, "
                f"{row['output_tokens_per_s']:,.0f} output tok/s, hit rate "
                f"{row['hit_rate']:.0%}"
            )
        result = {
            "documents": config.documents,
            "questions": config.questions,
            "lines": len(lines),
            "prompt_tokens_per_line": per_document,
            "max_tokens": config.max_tokens,
            "max_model_len": max_model_len,
            "kv_cache_tokens": kv_cache_tokens(engine_on),
            "kv_documents": config.kv_documents,
            "rows": runs,
        }
        result["ratios"] = {
            "batchllm_vs_raw_cache_on": runs[RAW_ON]["seconds"] / runs[JOB]["seconds"],
            "batchllm_vs_sorted": runs[RAW_SORTED]["seconds"] / runs[JOB]["seconds"],
            "batchllm_vs_raw_cache_off": runs[RAW_OFF]["seconds"] / runs[JOB]["seconds"],
            "sorted_vs_raw_cache_on": runs[RAW_ON]["seconds"] / runs[RAW_SORTED]["seconds"],
            # Many shards against one: engine time (<= 1.1 is the bar) and hit rate.
            "sharded_vs_one_shard_seconds": runs[SHARDED]["seconds"] / runs[JOB]["seconds"],
            "sharded_file_order_vs_one_shard_seconds": runs[SHARDED_FILE_ORDER]["seconds"]
            / runs[JOB]["seconds"],
            "sharded_hit_rate_points_below_one_shard": 100
            * (runs[JOB]["hit_rate"] - runs[SHARDED]["hit_rate"]),
        }
        return result
    finally:
        cache_on.close()
        cache_off.close()


def tokenizer(model: str):
    from batchllm.engine.sizing import load_tokenizer

    return load_tokenizer(model)


def _kv_bytes(config: PrefixCacheConfig, per_document: float, max_model_len: int) -> int:
    """KV cache bytes for `kv_documents` documents' tokens (and at least two sequences)."""
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(config.model)
    text = getattr(model, "get_text_config", lambda: model)()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * 2  # K and V, 16-bit
    tokens = max(config.kv_documents * per_document, 2 * max_model_len)
    return int(tokens * per_token)


def _generate(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    started = time.perf_counter()
    outputs = engine.llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False
    )
    seconds = time.perf_counter() - started
    return row_figures(
        seconds,
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(o.outputs[0].token_ids) for o in outputs),
        sum(o.num_cached_tokens or 0 for o in outputs),
    )


def row_figures(seconds: float, prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens_per_s": prompt / seconds,
        "output_tokens_per_s": output / seconds,
    }


def _job_engine_phase(engines, spec, source: Path, settings: Settings) -> dict[str, Any]:
    """batchllm's job over the shuffled file, as `batchllm run` runs one by default (no
    --max-model-len): validation stores the lines and the sizing pass stores their prompts'
    token ids; then, timed, the engine phase, which feeds the stored ids in prefix order. The
    raw contenders are handed token ids too, so neither side's time holds tokenization."""
    from batchllm.execution.context.passes import size_shards
    from batchllm.jobs.local import run_shards_here
    from batchllm.storage import Storage
    from batchllm.store import service
    from batchllm.store.db import session_scope
    from batchllm.store.models import JobStatus

    unsized = spec.model_copy(
        update={"engine": spec.engine.model_copy(update={"max_model_len": None})}
    )
    created = create_job(
        resolve_input(source, s3_endpoint=settings.resolved_s3_endpoint),
        unsized,
        shard_size=settings.shard_size,
        settings=settings,
        local_run=True,
    )
    job_id = created.job.id
    paths = [shard.path for shard in created.stored.shards]
    sized = size_shards(unsized, Storage.of(settings), paths, settings)
    built = spec.engine.max_model_len or 0
    if sized > built:  # the warm engine would be rebuilt inside the timed phase
        raise BenchFailed(f"the job was sized to {sized} tokens; the engine holds {built}")
    with session_scope(settings) as session:
        service.set_max_model_len(session, job_id, sized)
    started = time.perf_counter()
    job = run_shards_here(job_id, unsized, settings=settings, engines=engines, own_engines=False)
    seconds = time.perf_counter() - started
    if job.status is not JobStatus.COMPLETED:
        raise BenchFailed(f"bench job {job_id} ended {job.status.value}: {job.error}")
    row = row_figures(
        seconds, job.prompt_tokens or 0, job.completion_tokens or 0, job.cached_tokens or 0
    )
    row["shards"] = len(paths)
    return row


def prefix_cache_table(result: dict[str, Any]) -> str:
    lines = [
        f"prefix cache: {result['documents']} documents x {result['questions']} questions "
        f"({result['lines']:,} lines, ~{result['prompt_tokens_per_line']:,.0f} prompt tokens "
        f"each, shuffled), a KV cache of {result['kv_cache_tokens']:,} tokens",
        f"{'contender':<62} {'seconds':>8} {'out tok/s':>10} {'prompt tok/s':>13} {'hits':>6}",
    ]
    for key, row in result["rows"].items():
        lines.append(
            f"{LABELS[key]:<62} {row['seconds']:>8.1f} "
            f"{row['output_tokens_per_s']:>10,.0f} {row['prompt_tokens_per_s']:>13,.0f} "
            f"{row['hit_rate']:>6.0%}"
        )
    ratios = result["ratios"]
    lines.append(
        f"batchllm {ratios['batchllm_vs_raw_cache_on']:.2f}x raw generate with the prefix cache "
        f"on, {ratios['batchllm_vs_sorted']:.2f}x the sorted bound, "
        f"{ratios['batchllm_vs_raw_cache_off']:.2f}x with it off"
    )
    if "sharded_vs_one_shard_seconds" in ratios:
        rows = result["rows"]
        lines.append(
            f"{rows[SHARDED]['shards']} shards against one: engine time "
            f"{ratios['sharded_vs_one_shard_seconds']:.2f}x placed, "
            f"{ratios['sharded_file_order_vs_one_shard_seconds']:.2f}x in file order; hit rate "
            f"{rows[SHARDED]['hit_rate']:.0%} placed, {rows[SHARDED_FILE_ORDER]['hit_rate']:.0%} "
            f"in file order, {rows[JOB]['hit_rate']:.0%} in one shard"
        )
    if FLEET in result["rows"]:
        lines += _fleet_lines(result["rows"][FLEET])
    return "\n".join(lines)


def _fleet_lines(row: dict[str, Any]) -> list[str]:
    """The fleet row's placement: which worker ran which shards, and each worker's hits."""
    names = list(row["per_worker"])
    order = " ".join(str(names.index(n)) if n in names else "?" for n in row["shard_workers"])
    lines = [
        f"fleet: {row['shards']} shards of {row['shard_size']} lines on {row['workers']} "
        f"workers ({row['submit_seconds']:.1f} s of its time in submit: validation and "
        f"tokenization); shard -> worker: {order}"
    ]
    for i, (name, tokens) in enumerate(row["per_worker"].items()):
        lines.append(
            f"  worker {i} ({name}): {tokens['shards']} shards, "
            f"{tokens['prompt_tokens']:,} prompt tokens, hit rate {tokens['hit_rate']:.0%}"
        )
    return lines
