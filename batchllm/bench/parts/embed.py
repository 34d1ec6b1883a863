"""Embeddings measured: the same texts through raw vLLM `LLM.embed` and through batchllm's
embedding job (`{"input": ...}` lines, task embed, the real `run_job`), on one pooling engine.

Raw vLLM runs twice: with the texts, as a user calls it (vLLM tokenizes them), which is the
baseline of the ratios; and with the token ids batchllm's feed would give it, the engine alone
(an embedding is one prefill, so tokenization is a visible share of the work). The engine runs
without prefix caching: every contender embeds literally the same texts, and none may find
another's in the cache. A few vectors are compared across contenders, so a fast wrong answer
cannot pass.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed, Contender, Run
from batchllm.bench.memory import PeakRss
from batchllm.bench.own_engine import OwnEnginePart
from batchllm.demo.workload import sentence
from batchllm.execution.engines import EngineCache
from batchllm.input.formats.rows import InputRow
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults

CONTENDERS = {
    "vllm_embed_texts": "raw vLLM: LLM.embed(texts)",
    "vllm_embed_ids": "raw vLLM: LLM.embed(token ids)",
    "batchllm_embed": "batchllm: embedding job",
}
BASELINE = "vllm_embed_texts"
_WARMUP_TEXTS = 64
_COMPARED = 8  # texts whose vectors must agree across contenders
_TOLERANCE = 1e-3  # largest difference in any coordinate of a normalized vector


def make_texts(count: int, words: tuple[int, int], seed: int) -> list[str]:
    """Distinct short texts (the index first, so no two are alike)."""
    rng = random.Random(f"embed/{seed}")
    return [f"{i}: {sentence(rng, rng.randint(*words))}" for i in range(count)]


def _raw(engine: Any, prompts: list[Any]) -> tuple[Run, list[list[float]]]:
    """One `LLM.embed` call with every prompt; its run and the vectors."""
    with PeakRss() as memory:
        started = time.perf_counter()
        outputs = engine.llm.embed(prompts, use_tqdm=False)
        seconds = time.perf_counter() - started
    run = Run(
        seconds=seconds,
        requests=len(outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=0,
        peak_rss=memory.peak,
    )
    return run, [o.outputs.embedding for o in outputs]


def _job(
    engines: EngineCache, spec: JobSpec, source: Path, settings: Settings
) -> tuple[Run, list[Any]]:
    """The embedding job, timed from the end of validation to the finished job (as the engine
    part times batchllm); its run and its vectors in line order."""
    from batchllm.bench.contenders import run_job_phase
    from batchllm.output.parts import read_output
    from batchllm.storage import Storage
    from batchllm.store.db import get_one, session_scope
    from batchllm.store.models import Job

    run = run_job_phase(engines, spec, source, settings)
    if run.failed:
        raise BenchFailed(f"embedding job {run.extra['job_id']}: {run.failed} error rows")
    with session_scope(settings) as session:
        out_dir = get_one(session, Job, run.extra["job_id"]).output_dir
    table = read_output(Storage.of(settings), out_dir).sort_by("line")
    return run, table.column("embedding").to_pylist()


def _agree(label: str, vectors: list[Any], reference: list[list[float]]) -> float:
    """The largest coordinate difference from the reference over the first texts."""
    worst = 0.0
    for got, want in zip(vectors[:_COMPARED], reference[:_COMPARED]):
        if got is None or len(got) != len(want):
            raise BenchFailed(f"{label}: vectors of another size than raw vLLM's")
        worst = max(worst, *(abs(a - b) for a, b in zip(got, want)))
    if worst > _TOLERANCE:
        raise BenchFailed(f"{label}: vectors differ from raw vLLM's by {worst:.2g}")
    return worst


def run_embed(setup: OwnEnginePart, *, texts: int, words: tuple[int, int]) -> dict[str, Any]:
    """Every contender on one pooling engine started here, taking turns repeat by repeat."""
    from batchllm.bench.contenders import engine_info
    from batchllm.engine.sizing import size_max_model_len

    corpus = make_texts(texts, words, setup.seed)
    rows = [
        InputRow(line=i, custom_id=f"t-{i}", kind="embed", prompt=t)
        for i, t in enumerate(corpus, start=1)
    ]
    setup.say("[embed] sizing the context")
    max_model_len = size_max_model_len(
        setup.model, rows, SamplingDefaults(max_tokens=1), settings=setup.settings
    )
    spec = JobSpec(
        model=setup.model,
        engine=EngineOptions(
            task="embed",
            max_model_len=max_model_len,
            enable_prefix_caching=False,
            enforce_eager=setup.enforce_eager,
        ),
    )
    setup.workdir.mkdir(parents=True, exist_ok=True)
    source = setup.workdir / "embed.jsonl"
    with source.open("w") as out:
        for row in rows:
            out.write(json.dumps({"custom_id": row.custom_id, "input": row.prompt}) + "\n")
    warm = setup.workdir / "embed-warmup.jsonl"
    warm.write_text("".join(source.read_text().splitlines(keepends=True)[:_WARMUP_TEXTS]))
    engines = EngineCache(setup.settings)
    setup.say(f"[embed] starting the vLLM pooling engine (max_model_len {max_model_len})")
    started = time.perf_counter()
    engine = engines.get(spec, max_model_len)
    info = engine_info(engine, started=started, max_model_len=max_model_len, prefix_caching=False)
    contenders = {key: Contender(key, label) for key, label in CONTENDERS.items()}
    differences: dict[str, float] = {}
    try:
        ids = engine.prepare(rows)  # what batchllm's feed hands the engine
        if any(isinstance(i, str) for i in ids):
            raise BenchFailed("an embedding text cannot run")
        token_prompts = [{"prompt_token_ids": i} for i in ids]
        setup.say("[embed] warming up (one embed call, one job)")
        engine.llm.embed(corpus[:_WARMUP_TEXTS], use_tqdm=False)
        _job(engines, spec, warm, setup.settings)
        steps: dict[str, Callable[[], tuple[Run, list[Any]]]] = {
            "vllm_embed_texts": lambda: _raw(engine, corpus),
            "vllm_embed_ids": lambda: _raw(engine, token_prompts),
            "batchllm_embed": lambda: _job(engines, spec, source, setup.settings),
        }
        reference: list[list[float]] = []
        for repeat in range(setup.repeats):
            for key, go in steps.items():
                run, vectors = go()
                if not reference:
                    reference = vectors
                differences[key] = max(
                    differences.get(key, 0.0), _agree(CONTENDERS[key], vectors, reference)
                )
                contenders[key].runs.append(run)
                setup.say(
                    f"[embed] {CONTENDERS[key]}, repeat {repeat + 1}/{setup.repeats}: "
                    f"{run.requests / run.seconds:,.0f} rows/s, "
                    f"{run.prompt_tokens / run.seconds:,.0f} input tokens/s ({run.seconds:.1f} s)"
                )
    finally:
        engines.close()
    summaries = {key: c.summary() for key, c in contenders.items()}
    base = summaries[BASELINE]["requests_per_s"]["median"]
    for key, figures in summaries.items():
        figures["input_tokens_per_s"] = figures["total_tokens_per_s"]  # nothing is generated
        figures["ratio_to_raw"] = figures["requests_per_s"]["median"] / base
        figures["max_abs_difference"] = differences[key]
    return {
        "texts": texts,
        "words": list(words),
        "dimensions": len(reference[0]),
        "engine": info,
        "contenders": summaries,
    }
