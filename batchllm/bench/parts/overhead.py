"""Everything a job costs except generation, on an instant engine, at a size that shows scale.

The instant engine is a VllmEngine whose generation answers at once: tokenization (the model's
real tokenizer and chat template) and sampling settings run VllmEngine's own code, and the job
goes through the real `run_job`, so validation, input Parquet, context sizing, the continuous
feed, output Parquet and database checkpoints are all measured. Each size runs in its own
process (`python -m batchllm.bench.parts.overhead`) so its peak RSS is its own.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.demo.workload import sentence
from batchllm.execution.stand_in_engines import InstantEngines
from batchllm.spec import JobSpec

_SENTENCES = 4096


def write_lines(
    path: Path,
    lines: int,
    *,
    model: str,
    prompt_words: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int = 0,
) -> Path:
    """OpenAI chat lines like the engine workload's. Texts come from a pool and lines from a
    template, so a million lines are written in seconds (the overhead does not depend on the
    words); every custom_id is distinct."""
    rng = random.Random(seed)
    pool = [json.dumps(sentence(rng, rng.randint(*prompt_words)))[1:-1] for _ in range(_SENTENCES)]
    template = (
        '{"custom_id": "req-%d", "method": "POST", "url": "/v1/chat/completions", '
        '"body": {"model": ' + json.dumps(model).replace("%", "%%") + ', "max_tokens": '
        '%d, "ignore_eos": true, "messages": [{"role": "user", "content": "%d: %s"}]}}\n'
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for i in range(lines):
            out.write(template % (i, rng.randint(*output_tokens), i, pool[i % _SENTENCES]))
    return path


def peak_rss() -> int:
    """This process's peak resident memory in bytes.

    Linux's VmHWM, not ru_maxrss: the kernel carries ru_maxrss over exec, so a child started by
    the bench (a process holding vLLM) would report the bench's size instead of its own.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def measure(
    source: Path, home: Path, *, model: str, max_tokens: int, own_only: bool = False
) -> dict:
    """Run the file as two jobs on the instant engine in this process: as `batchllm run` runs
    it by default (its context sized from the prompts, while validation stores the shards),
    which is the all-in rate; then with the context length given, where no sizing pass runs
    and the feed tokenizes, so that tokenization can be taken out: batchllm's own work.
    `own_only`: the second job alone (the 10M-line size, where both would take half an hour
    here)."""
    given = _run_once(source, home / "given", model=model, max_tokens=max_tokens, given=4096)
    if own_only:
        return own_figures(given)
    sized = _run_once(source, home / "sized", model=model, max_tokens=max_tokens, given=None)
    rows = sized["rows"]
    # batchllm's own work: what neither vLLM (it tokenizes text prompts itself) nor a user who
    # passes --max-model-len (no sizing pass) would pay anyway.
    own = given["seconds"] - given["phases"]["tokenize"]
    return {
        "lines": rows,
        "seconds": sized["seconds"],
        "rows_per_s": rows / sized["seconds"],
        "seconds_per_row": sized["seconds"] / rows,
        "own_seconds_per_row": own / rows,
        "own_rows_per_s": rows / own,
        "phases": sized["phases"],
        "own_phases": given["phases"],
        "peak_rss_bytes": peak_rss(),
    }


def own_figures(given: dict[str, Any]) -> dict:
    """The figures of the job with its context given alone, and the disk it used."""
    rows = given["rows"]
    own = given["seconds"] - given["phases"]["tokenize"]
    return {
        "lines": rows,
        "own_only": True,
        "seconds": given["seconds"],
        "rows_per_s": rows / given["seconds"],
        "own_seconds_per_row": own / rows,
        "own_rows_per_s": rows / own,
        "own_phases": given["phases"],
        # Every shard is queued once the whole file is validated and stored (jobs/submit.py)
        "validated_and_stored_s": given["phases"]["validate_and_store"],
        "disk_bytes": given["disk_bytes"],
        "disk_bytes_per_million_rows": {
            k: v * 1_000_000 / rows for k, v in given["disk_bytes"].items()
        },
        "peak_rss_bytes": peak_rss(),
    }


def disk_usage(home: Path) -> dict[str, int]:
    """Bytes under a bench home: the stored input shards, the output parts, the database."""
    used = {"input_shards": 0, "output_parts": 0, "database": 0}
    for path in home.rglob("*"):
        if not path.is_file():
            continue
        size = path.stat().st_size
        if "input" in path.parts:
            used["input_shards"] += size
        elif "output" in path.parts:
            used["output_parts"] += size
        elif path.name.startswith("batchllm.db"):
            used["database"] += size
    return used


def _run_once(
    source: Path, home: Path, *, model: str, max_tokens: int, given: int | None
) -> dict[str, Any]:
    from batchllm.bench.contenders import bench_settings, timed_run_job
    from batchllm.engine.sizing import load_tokenizer
    from batchllm.spec import EngineOptions, SamplingDefaults
    from batchllm.store.models import JobStatus

    engines = InstantEngines(load_tokenizer(model))
    spec = JobSpec(
        model=model,
        sampling=SamplingDefaults(max_tokens=max_tokens, ignore_eos=True),
        engine=EngineOptions(max_model_len=given),
    )
    timed = timed_run_job(engines, spec, source, bench_settings(home))
    job, started, stored, ended = timed.job, timed.started, timed.stored, timed.ended
    engine, asked_at = engines.engine, engines.asked_at
    if engine is None or asked_at is None:
        raise BenchFailed("the overhead job never asked for an engine")
    if job.status is not JobStatus.COMPLETED or job.request_failed:
        raise BenchFailed(
            f"overhead job ended {job.status.value}, {job.request_failed} failed: {job.error}"
        )
    # With the context length given, the (instant) engine is asked for before validation;
    # the phases then start at the end of validation.
    generation_from = max(asked_at, stored)
    return {
        "rows": job.request_completed,
        "seconds": ended - started,
        "disk_bytes": disk_usage(home),
        "phases": {
            # Sized by default: validation with the sizing pass overlapping it.
            "validate_and_store": stored - started,
            "size_context": max(0.0, asked_at - stored),  # the sizing left to wait for
            "tokenize": engine.prepare_seconds,
            "feed_write_commit": ended - generation_from - engine.prepare_seconds,
        },
    }


_REFERENCE_BATCH = 1000


def prompt_text(obj: dict[str, Any]) -> str:
    """The text a line asks to be tokenized, without any chat template: a prompt, or the
    contents of its messages (OpenAI batch lines carry them in `body`)."""
    body = obj.get("body", obj)
    if "messages" in body:
        return "\n".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


def tokenization_reference(source: Path, model: str) -> dict:
    """The floor no pipeline can beat: parse each JSON line and encode its text with the
    model's fast tokenizer in batches of 1,000 (issue 13's definition: the tokenizer called
    as users call it). Nothing is validated, rendered, stored or written. `backend_rows_per_s`
    is a stricter floor beside it: the Rust backend's batch encoding called directly, as
    batchllm's pipeline calls it (no offsets, masks or Python encodings built per text)."""
    from batchllm.engine.prompts import batch_encoder
    from batchllm.engine.sizing import load_tokenizer

    tokenizer = load_tokenizer(model)
    called = _reference_pass(source, lambda texts: tokenizer(texts)["input_ids"])
    direct_encode = batch_encoder(tokenizer)
    direct = _reference_pass(source, lambda texts: direct_encode(texts, True))
    return {
        **called,
        "backend_rows_per_s": direct["rows_per_s"],
        "backend_seconds": direct["seconds"],
    }


def _reference_pass(source: Path, encode: Any) -> dict:
    started = time.perf_counter()
    rows = tokens = 0
    batch: list[str] = []
    with source.open("rb") as lines:
        for line in lines:
            if not line.strip():
                continue
            batch.append(prompt_text(json.loads(line)))
            if len(batch) >= _REFERENCE_BATCH:
                tokens += sum(len(ids) for ids in encode(batch))
                rows, batch = rows + len(batch), []
        if batch:
            tokens += sum(len(ids) for ids in encode(batch))
            rows += len(batch)
    seconds = time.perf_counter() - started
    return {"lines": rows, "seconds": seconds, "rows_per_s": rows / seconds, "tokens": tokens}


def run_size(
    lines: int,
    workdir: Path,
    *,
    model: str,
    prompt_words: tuple[int, int],
    output_tokens: tuple[int, int],
    own_only: bool = False,
) -> dict:
    """Write a file of `lines` lines and measure it in a fresh process; the files are removed
    afterwards (a million lines are ~1 GB between input, stored input and output).
    `own_only`: only the job with its context given (measure's own_only)."""
    import shutil

    sizedir = workdir / f"overhead-{lines}"
    source = write_lines(
        sizedir / "input.jsonl",
        lines,
        model=model,
        prompt_words=prompt_words,
        output_tokens=output_tokens,
    )
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "batchllm.bench.parts.overhead",
                str(source),
                str(sizedir / "home"),
                model,
                str(output_tokens[1]),
                *(["--own-only"] if own_only else []),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise BenchFailed(f"overhead run of {lines} lines failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["input_bytes"] = source.stat().st_size
        return result
    finally:
        shutil.rmtree(sizedir, ignore_errors=True)


if __name__ == "__main__":
    source_arg, home_arg, model_arg, max_tokens_arg = sys.argv[1:5]
    own_only = "--own-only" in sys.argv[5:]
    figures = measure(
        Path(source_arg),
        Path(home_arg),
        model=model_arg,
        max_tokens=int(max_tokens_arg),
        own_only=own_only,
    )
    if own_only:
        print(json.dumps(figures))
        sys.exit(0)
    # Same process, same file, right after: the reference the pipeline is held against.
    reference = tokenization_reference(Path(source_arg), model_arg)
    figures["tokenization_reference"] = reference
    figures["vs_tokenization"] = figures["rows_per_s"] / reference["rows_per_s"]
    figures["vs_backend_tokenization"] = figures["rows_per_s"] / reference["backend_rows_per_s"]
    print(json.dumps(figures))
