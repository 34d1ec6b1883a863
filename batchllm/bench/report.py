"""The bench's figures as the terminal report `batchllm bench` prints: a section per part."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchllm.bench.display import GIB, MIB, format_table, spread


def _rate_cells(figures: dict[str, Any]) -> tuple[str, ...]:
    """The first cells of a generation table's row: the label, req/s and output tok/s (the
    medians of the repeats), and the spread of the latter."""
    return (
        figures["label"],
        f"{figures['requests_per_s']['median']:,.1f}",
        f"{figures['output_tokens_per_s']['median']:,.0f}",
        spread(figures["output_tokens_per_s"]),
    )


def ordered(contenders: dict[str, Any]) -> list[dict[str, Any]]:
    """Raw vLLM first, then the fixed batches, batchllm's engine phase, the end-to-end pair."""

    def rank(key: str) -> tuple[int, int, str]:
        if key.startswith("vllm_batches_"):
            return 1, int(key.rsplit("_", 1)[1]), key
        return {"vllm_generate": 0, "batchllm_engine": 2, "vllm_run_batch": 3}.get(key, 4), 0, key

    return [contenders[key] for key in sorted(contenders, key=rank)]


def contender_table(contenders: dict[str, Any]) -> str:
    header = (
        "contender",
        "req/s",
        "out tok/s",
        "spread",
        "total tok/s",
        "wall s",
        "peak RSS",
        "vs raw",
        "generating: out tok/s",
        "vs raw",
    )
    rows: list[tuple[str, ...]] = [header]
    for figures in ordered(contenders):
        generation = figures.get("generation_output_tokens_per_s")
        rows.append(
            (
                *_rate_cells(figures),
                f"{figures['total_tokens_per_s']['median']:,.0f}",
                f"{figures['wall_seconds']['median']:,.1f}",
                f"{figures['peak_rss_bytes'] / GIB:.2f} GiB",
                f"{figures['ratio_to_raw']:.2f}x" if "ratio_to_raw" in figures else "",
                f"{generation['median']:,.0f}" if generation else "",
                f"{figures['generation_ratio_to_raw']:.2f}x"
                if "generation_ratio_to_raw" in figures
                else "",
            )
        )
    return format_table(rows)


def _reference_rates(size: dict[str, Any]) -> str:
    """The tokenization-only reference: the tokenizer call, and the Rust backend direct."""
    reference = size.get("tokenization_reference")
    if not reference or "backend_rows_per_s" not in reference:
        return "-"
    return f"{reference['rows_per_s']:,.0f} ({reference['backend_rows_per_s']:,.0f})"


def _overhead_table(overhead: dict[str, Any]) -> str:
    """Rows/s and peak RSS per file size; shares of engine time when the engine part ran."""
    shares = "engine_seconds_per_row" in overhead
    header: tuple[str, ...] = (
        "overhead without generation",
        "rows/s own",
        "rows/s all",
        "tokenize-only rows/s (direct)",
        "all / tokenize-only (direct)",
        "peak RSS",
    )
    header += ("own / engine time", "all / engine time") if shares else ()
    rows: list[tuple[str, ...]] = [header + ("validate", "size ctx", "tokenize", "feed+write")]
    for size in overhead["sizes"]:
        phases = size["phases"]
        row: tuple[str, ...] = (
            f"{size['lines']:,} lines",
            f"{size['own_rows_per_s']:,.0f}",
            f"{size['rows_per_s']:,.0f}",
            _reference_rates(size),
            f"{size['vs_tokenization']:.2f}x ({size['vs_backend_tokenization']:.2f}x)"
            if "vs_backend_tokenization" in size
            else "-",
            f"{size['peak_rss_bytes'] / MIB:,.0f} MiB",
        )
        if shares:
            row += (
                f"{size['own_share_of_engine_time']:.2%}",
                f"{size['share_of_engine_time']:.2%}",
            )
        rows.append(
            row
            + tuple(
                f"{phases[k]:.1f} s"
                for k in ("validate_and_store", "size_context", "tokenize", "feed_write_commit")
            )
        )
    return format_table(rows)


def ran_workload(result: dict[str, Any]) -> bool:
    """Whether a part that runs the engine workload (--requests, --output-tokens) ran."""
    return bool(result["contenders"] or result.get("prefix") or result.get("overhead"))


def _engine_line(engine: dict[str, Any]) -> str:
    return (
        f"vLLM {engine['version']} on {engine['hardware']}, max_model_len "
        f"{engine['max_model_len']}, max_num_seqs {engine['max_num_seqs']}, "
        f"max_num_batched_tokens {engine['max_num_batched_tokens']}, prefix caching off"
    )


def features_text(features: dict[str, Any]) -> str:
    """The features part: every job against the plain one, then the mixed job's plain rows
    against the control's."""
    from batchllm.bench.parts.features import JOBS

    workload = features["workload"]
    # In the part's order (bench.json keeps its keys sorted).
    jobs = {key: features["jobs"][key] for key in JOBS}
    plain_rows = features["plain_rows"]
    return "\n".join(
        [
            f"request features: {workload['requests']:,} requests per job (prompts "
            f"{workload['prompt_words'][0]}..{workload['prompt_words'][1]} words, max_tokens "
            f"{features['max_tokens']}), the same prompts in every job, "
            f"{jobs['plain']['repeats']} repeat(s), one engine built with --compact-json",
            _engine_line(features["engine"]),
            "",
            _feature_jobs_table(jobs, features["raw"]),
            "plain, logprobs and n=4 rows generate max_tokens (ignore_eos); JSON and choice "
            "rows stop when their grammar ends, so compare them on req/s. valid: rows whose "
            "text satisfies their constraint. mixed: even lines plain, odd lines "
            "json/choice/logprobs in turn; control: the same prompts, its even lines as the "
            "mixed job's, its odd lines plain but generating the tokens the mixed job's did "
            "(ignore_eos): the same load without constraints or logprobs. raw: the same "
            "requests as token ids with batchllm's sampling parameters in one LLM.generate "
            "call, right after each job; vs raw: the median of those pairs' ratios",
            "",
            _mixed_table(features, jobs),
            "plain rows: the mixed job's even lines, from the job's first request in the engine "
            "to the last of them done; the same lines in the all-plain job: "
            f"{plain_rows['plain']['output_tokens_per_s']['median']:,.0f} out tok/s (its "
            "other lines all run to max_tokens, a heavier load); mixed vs control: the median "
            "of the ratios of runs made back to back",
        ]
    )


def _feature_jobs_table(jobs: dict[str, Any], raw: dict[str, Any]) -> str:
    rows: list[tuple[str, ...]] = [
        (
            "request features (batchllm jobs)",
            "req/s",
            "out tok/s",
            "spread",
            "tok/req",
            "req/s vs plain",
            "tok/s vs plain",
            "raw: tok/s vs plain",
            "req/s vs raw",
            "valid",
        )
    ]
    for key, figures in jobs.items():
        constrained = figures.get("structured_rows")
        rows.append(
            (
                *_rate_cells(figures),
                f"{figures['output_tokens_per_request']:,.1f}",
                f"{figures['requests_ratio_to_plain']:.2f}x",
                f"{figures['tokens_ratio_to_plain']:.2f}x",
                f"{raw[key]['tokens_ratio_to_raw_plain']:.2f}x",
                f"{figures['requests_ratio_to_raw']:.2f}x",
                f"{figures['structured_valid'] / constrained:.1%}" if constrained else "",
            )
        )
    return format_table(rows)


def _mixed_table(features: dict[str, Any], jobs: dict[str, Any]) -> str:
    """The mixed job against its control: the whole jobs, their plain rows, raw vLLM."""
    pair = features["mixed_vs_control"]
    plain_rows, raw = features["plain_rows"], features["raw"]

    def speeds(sides: dict[str, Any]) -> list[str]:
        return [f"{sides[k]['output_tokens_per_s']['median']:,.0f}" for k in ("mixed", "control")]

    latency = [f"{plain_rows[k]['median_latency_seconds']:.2f}" for k in ("mixed", "control")]
    return format_table(
        [
            ("mixed job against its control", "mixed", "control", "mixed vs control"),
            ("batchllm, whole job: out tok/s", *speeds(jobs), f"{pair['job']:.2f}x"),
            (
                "batchllm, its plain rows: out tok/s",
                *speeds(plain_rows),
                f"{pair['plain_rows']:.2f}x",
            ),
            (
                "batchllm, its plain rows: median latency s",
                *latency,
                f"{pair['plain_rows_latency']:.2f}x",
            ),
            ("raw vLLM, one generate call: out tok/s", *speeds(raw), f"{pair['raw_vllm']:.2f}x"),
        ]
    )


def embed_text(embed: dict[str, Any]) -> str:
    """The embed part: rows/s and input tokens/s against raw `LLM.embed(texts)`."""
    from batchllm.bench.parts.embed import CONTENDERS

    rows: list[tuple[str, ...]] = [
        ("embeddings", "rows/s", "input tok/s", "spread", "wall s", "peak RSS", "vs raw")
    ]
    for figures in (embed["contenders"][key] for key in CONTENDERS):
        rows.append(
            (
                figures["label"],
                f"{figures['requests_per_s']['median']:,.0f}",
                f"{figures['input_tokens_per_s']['median']:,.0f}",
                spread(figures["requests_per_s"]),
                f"{figures['wall_seconds']['median']:,.2f}",
                f"{figures['peak_rss_bytes'] / GIB:.2f} GiB",
                f"{figures['ratio_to_raw']:.2f}x",
            )
        )
    words = embed["words"]
    repeats = next(iter(embed["contenders"].values()))["repeats"]
    return "\n".join(
        [
            f"embeddings: {embed['texts']:,} texts of {words[0]}..{words[1]} words, "
            f"{embed['dimensions']} dimensions, {repeats} repeat(s), one pooling engine "
            "(runner pooling, convert embed)",
            _engine_line(embed["engine"]),
            "",
            format_table(rows),
            "vs raw: rows/s over LLM.embed(texts)'s; the vectors agree with raw vLLM's "
            "(compared on the first texts)",
        ]
    )


SIDE_BY_SIDE = (
    ("vllm_run_batch", "vllm run-batch (own process, builds its engine)"),
    ("batchllm_run", "batchllm run (own process, builds its engine)"),
    ("warm_worker", "batchllm submit to the warm worker"),
)


def warm_text(warm: dict[str, Any]) -> str:
    """The warm part: the worker's one engine build, five jobs in a row on it, and one file
    end to end three ways."""

    def seconds(value: float | None) -> str:
        return f"{value:.2f} s" if value is not None else ""

    worker = warm["worker"]
    engine = worker["engine"]
    flags = worker["command"][worker["command"].index("worker") + 1 :]
    rows: list[tuple[str, ...]] = [
        (
            "job on the warm worker",
            "prompt words",
            "max_tokens",
            "job's context",
            "rows ok",
            "failed",
            "engine starts",
            "submit to first row",
            "submit to completed",
        )
    ]
    for n, job in enumerate(warm["jobs"], start=1):
        context = str(job["max_model_len"])
        if job.get("explicit_max_model_len"):
            context += " (its own)"
        rows.append(
            (
                f"{n}: {job['label']}",
                "{}-{}".format(*job["prompt_words"]),
                str(job["max_tokens"]),
                context,
                str(job["rows_ok"]),
                str(job["rows_failed"]),
                str(job["engine_starts"]),
                seconds(job["submit_to_first_row_seconds"]),
                seconds(job["submit_to_completed_seconds"]),
            )
        )
    pickup, first = warm["pickup_to_first_row_seconds"], warm["submit_to_first_row_seconds"]
    mark = "met" if warm["target_met"] else "NOT met"
    lines = [
        f"warm worker: `batchllm worker {' '.join(flags)}`",
        f"ready in {worker['ready_seconds']:.1f} s from process start (the engine build, "
        f"{engine['start_seconds']:.1f} s of it, paid once): max_model_len "
        f"{engine['max_model_len']}, {engine['dtype']}; engine starts over the worker's life: "
        f"{worker['engine_starts']}; 1-minute load average {worker['load_average'][0]:.1f} -> "
        f"{worker['load_average'][1]:.1f}",
        "",
        f"{len(warm['jobs'])} jobs of {warm['lines']} lines in a row (one shard each):",
        format_table(rows),
        "submit: the job is committed and its task goes to the broker; first row: its first "
        "request goes into the engine; completed: the job is finalized; from the database's "
        "timestamps. engine starts: the worker's batchllm_engine_starts_total during the job",
        f"{warm['jobs_with_engine_starts']} of {len(warm['jobs'])} jobs started an engine; "
        f"pickup to first row median {pickup['median']:.2f} s, max {pickup['max']:.2f} s "
        f"(target {warm['target_seconds']:.0f} s: {mark}); submit to first row median "
        f"{first['median']:.2f} s",
    ]
    side = warm.get("side_by_side")
    if side:
        lines += ["", _side_by_side_text(side)]
    return "\n".join(lines)


def _side_by_side_text(side: dict[str, Any]) -> str:
    limits = side["limits"]
    warm_seconds = side["warm_worker"]["seconds"]
    rows: list[tuple[str, ...]] = [
        (
            "the same file",
            "wall s",
            "rows",
            "failed",
            "out tokens",
            "generating s",
            "generating out tok/s",
            "wall vs warm",
        )
    ]
    for key, label in SIDE_BY_SIDE:
        run = side.get(key)
        if run is None:
            continue
        generation = run.get("generation_seconds")
        rows.append(
            (
                label,
                f"{run['seconds']:.1f}",
                f"{run['requests']:,}",
                str(run["failed"]),
                f"{run['output_tokens']:,}",
                f"{generation:.1f}" if generation else "",
                f"{run['output_tokens'] / generation:,.0f}" if generation else "",
                f"{run['seconds'] / warm_seconds:.2f}x",
            )
        )
    eager = "eager" if limits.get("enforce_eager") else "compiled"
    lines = [
        f"one OpenAI chat file of {side['lines']:,} lines end to end, greedy, max_tokens "
        f"{side['max_tokens']} (ignore_eos), every engine max_model_len "
        f"{limits['max_model_len']}, {limits['dtype']}, {eager}, max_num_seqs "
        f"{limits['max_num_seqs']}, max_num_batched_tokens {limits['max_num_batched_tokens']}:",
        format_table(rows),
        "wall: process start to exit; for the warm worker, `batchllm submit`'s start to the "
        "job completed in the database (polled every 0.1 s). generating: first request to "
        "the end (run-batch: its log lines; batchllm: the job's timestamps)",
    ]
    ratios = [
        f"run/warm {side['run_over_warm']:.2f}x ("
        f"{side['batchllm_run']['seconds'] - warm_seconds:.1f} s sooner)"
    ]
    if "run_batch_over_warm" in side:
        mark = "met" if side["target_met"] else "NOT met"
        ratios.insert(
            0,
            f"run-batch/warm {side['run_batch_over_warm']:.2f}x ("
            f"{side['vllm_run_batch']['seconds'] - warm_seconds:.1f} s sooner; target "
            f"{side['target_speedup']:.0f}x: {mark})",
        )
    lines.append(
        ", ".join(ratios)
        + f"; of the warm worker's {warm_seconds:.1f} s, the `batchllm submit` process took "
        f"{side['warm_worker']['extra']['submit_process_seconds']:.1f} s (start, validation, "
        f"storing the input, queueing); the idle worker used "
        f"{side['idle_worker_cpu_seconds']:.1f} CPU s while the other two ran"
    )
    loads = [
        f"{label.split(' (')[0]} {run['load_average'][0]:.1f} -> {run['load_average'][1]:.1f}"
        for key, label in SIDE_BY_SIDE
        if (run := side.get(key)) and "load_average" in run
    ]
    if loads:
        lines.append(
            f"1-minute load average before -> after (on {side.get('cpu_count', '?')} cores): "
            + ", ".join(loads)
        )
    for key, reason in side.get("skipped", {}).items():
        lines.append(f"skipped {key}: {reason}")
    return "\n".join(lines)


def summary_text(result: dict[str, Any]) -> str:
    """The whole report: contender table, prefix grouping, overhead, each opt-in part's
    section, and the targets."""
    parts = _heading(result)
    if result["contenders"]:
        parts.append("")
        parts.append(contender_table(result["contenders"]))
        parts.append(
            "medians of the repeats; spread: half the min-max range of output tok/s; "
            "end-to-end rows include engine start-up in wall time, 'generating' is "
            "their throughput once the engine is up"
        )
    for key, reason in result.get("skipped", {}).items():
        parts.append(f"skipped {key}: {reason}")
    if result.get("prefix"):
        parts += ["", *_prefix_lines(result["prefix"])]
    if result.get("overhead"):
        parts.append("")
        parts.append(_overhead_table(result["overhead"]))
        parts.append(
            "own: validation, input Parquet, feed bookkeeping, output Parquet, database "
            "checkpoints; all: also tokenization (vLLM tokenizes text prompts itself) "
            "and the context-sizing pass (skipped with --max-model-len)"
        )
    parts += _part_sections(result)
    if result.get("targets"):
        parts.append("")
        parts.append("targets:")
        for name, target in result["targets"].items():
            mark = "met" if target["met"] else "NOT met"
            parts.append(f"  {name}: {target['value']:.3g} (target {target['target']}) {mark}")
    return "\n".join(parts)


def _heading(result: dict[str, Any]) -> list[str]:
    """What the run generated, on which model, and the engine every contender ran."""
    config = result["config"]
    if not ran_workload(
        result
    ):  # only the features, embed and warm parts, which describe their own work
        heading = [f"batchllm bench: model {config['model']}"]
    elif config.get("natural_outputs"):
        heading = [
            f"batchllm bench: {config['requests']:,} real questions answered greedily, each "
            f"ending on its own or at {config['output_tokens'][1]} tokens (no ignore_eos), "
            f"model {config['model']}"
        ]
    else:
        heading = [
            f"batchllm bench: {config['requests']:,} requests, prompts "
            f"{config['prompt_words'][0]}..{config['prompt_words'][1]} words, outputs "
            f"{config['output_tokens'][0]}..{config['output_tokens'][1]} tokens "
            f"({config.get('output_shape', 'uniform')}, ignore_eos), "
            f"model {config['model']}"
        ]
    engine = result.get("engine")
    if engine:
        limits = engine["limits"]
        heading.append(
            f"vLLM {engine['version']} on {engine['hardware']}; every contender runs "
            f"max_model_len {limits['max_model_len']}, max_num_seqs "
            f"{limits['max_num_seqs']}, max_num_batched_tokens "
            f"{limits['max_num_batched_tokens']}"
        )
    return heading


def _prefix_lines(prefix: dict[str, Any]) -> list[str]:
    workload = prefix["workload"]
    lines = [
        f"prefix grouping: {workload['requests']:,} requests sharing "
        f"{workload['system_prompts']} system prompts of {workload['system_words']} "
        "words, in random order, "
        + (
            f"on an engine with a {prefix['kv_cache_mib']} MiB KV cache"
            if prefix.get("kv_cache_mib")
            else "on the shared engine"
        )
    ]
    for key in ("file_order", "grouped"):
        figures = prefix[key]
        lines.append(
            f"  {figures['label']:<36} "
            f"{figures['output_tokens_per_s']['median']:>8,.0f} out tok/s "
            f"{spread(figures['output_tokens_per_s'])}"
        )
    lines.append(f"  gain: {prefix['gain']:.2f}x")
    return lines


def _part_sections(result: dict[str, Any]) -> list[str]:
    """The opt-in parts' sections, each after a blank line, for the parts that ran."""
    from batchllm.bench.parts.kept import kept_table
    from batchllm.bench.parts.peers_report import peers_text
    from batchllm.bench.parts.prefix_cache import prefix_cache_table

    sections: dict[str, Callable[[dict[str, Any]], str]] = {
        "features": features_text,
        "embed": embed_text,
        "warm": warm_text,
        "peers": peers_text,
        "prefix_cache": prefix_cache_table,
        "kept": kept_table,
    }
    lines = []
    for key, section in sections.items():
        if result.get(key):
            lines += ["", section(result[key])]
    return lines
