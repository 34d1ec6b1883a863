"""The bench's figures as a terminal table and as a PNG chart for docs/performance.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_GIB = 2**30
_MIB = 2**20


def _spread(figure: dict[str, float]) -> str:
    """The half-range of the repeats as a share of the median: how much to trust a ratio."""
    half = (figure["max"] - figure["min"]) / 2 / figure["median"] if figure["median"] else 0.0
    return f"±{half:.0%}"


def _rate_cells(figures: dict[str, Any]) -> tuple[str, ...]:
    """The first cells of a generation table's row: the label, req/s and output tok/s (the
    medians of the repeats), and the spread of the latter."""
    return (
        figures["label"],
        f"{figures['requests_per_s']['median']:,.1f}",
        f"{figures['output_tokens_per_s']['median']:,.0f}",
        _spread(figures["output_tokens_per_s"]),
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
                f"{figures['peak_rss_bytes'] / _GIB:.2f} GiB",
                f"{figures['ratio_to_raw']:.2f}x" if "ratio_to_raw" in figures else "",
                f"{generation['median']:,.0f}" if generation else "",
                f"{figures['generation_ratio_to_raw']:.2f}x"
                if "generation_ratio_to_raw" in figures
                else "",
            )
        )
    return _format(rows)


def _format(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
            f"{size['peak_rss_bytes'] / _MIB:,.0f} MiB",
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
    return _format(rows)


def _ran_workload(result: dict[str, Any]) -> bool:
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
    repeats = jobs["plain"]["repeats"]
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
                f"{features['raw'][key]['tokens_ratio_to_raw_plain']:.2f}x",
                f"{figures['requests_ratio_to_raw']:.2f}x",
                f"{figures['structured_valid'] / constrained:.1%}" if constrained else "",
            )
        )
    pair = features["mixed_vs_control"]
    plain_rows, raw = features["plain_rows"], features["raw"]

    def speeds(sides: dict[str, Any]) -> list[str]:
        return [f"{sides[k]['output_tokens_per_s']['median']:,.0f}" for k in ("mixed", "control")]

    latency = [f"{plain_rows[k]['median_latency_seconds']:.2f}" for k in ("mixed", "control")]
    mixed: list[tuple[str, ...]] = [
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
    return "\n".join(
        [
            f"request features: {workload['requests']:,} requests per job (prompts "
            f"{workload['prompt_words'][0]}..{workload['prompt_words'][1]} words, max_tokens "
            f"{features['max_tokens']}), the same prompts in every job, {repeats} repeat(s), "
            "one engine built with --compact-json",
            _engine_line(features["engine"]),
            "",
            _format(rows),
            "plain, logprobs and n=4 rows generate max_tokens (ignore_eos); JSON and choice "
            "rows stop when their grammar ends, so compare them on req/s. valid: rows whose "
            "text satisfies their constraint. mixed: even lines plain, odd lines "
            "json/choice/logprobs in turn; control: the same prompts, its even lines as the "
            "mixed job's, its odd lines plain but generating the tokens the mixed job's did "
            "(ignore_eos): the same load without constraints or logprobs. raw: the same "
            "requests as token ids with batchllm's sampling parameters in one LLM.generate "
            "call, right after each job; vs raw: the median of those pairs' ratios",
            "",
            _format(mixed),
            "plain rows: the mixed job's even lines, from the job's first request in the engine "
            "to the last of them done; the same lines in the all-plain job: "
            f"{plain_rows['plain']['output_tokens_per_s']['median']:,.0f} out tok/s (its "
            "other lines all run to max_tokens, a heavier load); mixed vs control: the median "
            "of the ratios of runs made back to back",
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
                _spread(figures["requests_per_s"]),
                f"{figures['wall_seconds']['median']:,.2f}",
                f"{figures['peak_rss_bytes'] / _GIB:.2f} GiB",
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
            _format(rows),
            "vs raw: rows/s over LLM.embed(texts)'s; the vectors agree with raw vLLM's "
            "(compared on the first texts)",
        ]
    )


_SIDE_BY_SIDE = (
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
        _format(rows),
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
    for key, label in _SIDE_BY_SIDE:
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
        _format(rows),
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
        for key, label in _SIDE_BY_SIDE
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
    """The whole report: contender table, prefix grouping, overhead, and the targets."""
    config = result["config"]
    if _ran_workload(result):
        parts = [
            (
                f"batchllm bench: {config['requests']:,} real questions answered greedily, each "
                f"ending on its own or at {config['output_tokens'][1]} tokens (no ignore_eos), "
                f"model {config['model']}"
            )
            if config.get("natural_outputs")
            else (
                f"batchllm bench: {config['requests']:,} requests, prompts "
                f"{config['prompt_words'][0]}..{config['prompt_words'][1]} words, outputs "
                f"{config['output_tokens'][0]}..{config['output_tokens'][1]} tokens "
                f"({config.get('output_shape', 'uniform')}, ignore_eos), "
                f"model {config['model']}"
            )
        ]
    else:  # only the features, embed and warm parts, which describe their own work
        parts = [f"batchllm bench: model {config['model']}"]
    engine = result.get("engine")
    if engine:
        limits = engine["limits"]
        parts.append(
            f"vLLM {engine['version']} on {engine['hardware']}; every contender runs "
            f"max_model_len {limits['max_model_len']}, max_num_seqs "
            f"{limits['max_num_seqs']}, max_num_batched_tokens "
            f"{limits['max_num_batched_tokens']}"
        )
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
    prefix = result.get("prefix")
    if prefix:
        workload = prefix["workload"]
        parts.append("")
        parts.append(
            f"prefix grouping: {workload['requests']:,} requests sharing "
            f"{workload['system_prompts']} system prompts of {workload['system_words']} "
            "words, in random order, "
            + (
                f"on an engine with a {prefix['kv_cache_mib']} MiB KV cache"
                if prefix.get("kv_cache_mib")
                else "on the shared engine"
            )
        )
        for key in ("file_order", "grouped"):
            figures = prefix[key]
            parts.append(
                f"  {figures['label']:<36} "
                f"{figures['output_tokens_per_s']['median']:>8,.0f} out tok/s "
                f"{_spread(figures['output_tokens_per_s'])}"
            )
        parts.append(f"  gain: {prefix['gain']:.2f}x")
    overhead = result.get("overhead")
    if overhead:
        parts.append("")
        parts.append(_overhead_table(overhead))
        parts.append(
            "own: validation, input Parquet, feed bookkeeping, output Parquet, database "
            "checkpoints; all: also tokenization (vLLM tokenizes text prompts itself) "
            "and the context-sizing pass (skipped with --max-model-len)"
        )
    if result.get("features"):
        parts.append("")
        parts.append(features_text(result["features"]))
    if result.get("embed"):
        parts.append("")
        parts.append(embed_text(result["embed"]))
    if result.get("warm"):
        parts.append("")
        parts.append(warm_text(result["warm"]))
    if result.get("peers"):
        from batchllm.bench.parts.peers_report import peers_text

        parts.append("")
        parts.append(peers_text(result["peers"]))
    if result.get("prefix_cache"):
        from batchllm.bench.parts.prefix_cache import prefix_cache_table

        parts.append("")
        parts.append(prefix_cache_table(result["prefix_cache"]))
    if result.get("kept"):
        from batchllm.bench.parts.kept import kept_table

        parts.append("")
        parts.append(kept_table(result["kept"]))
    if result.get("targets"):
        parts.append("")
        parts.append("targets:")
        for name, target in result["targets"].items():
            mark = "met" if target["met"] else "NOT met"
            parts.append(f"  {name}: {target['value']:.3g} (target {target['target']}) {mark}")
    return "\n".join(parts)


def draw_chart(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        p
        for p in ("contenders", "prefix", "overhead", "features", "embed", "warm")
        if result.get(p)
        and (p != "contenders" or result[p])
        # A warm part without its side-by-side file (--warm-file-lines 0) has nothing to draw.
        and (p != "warm" or "side_by_side" in result[p])
    ]
    if result.get("peers"):  # its two panels: the main table and the batch-size sweep
        panels += ["peers", "sweep"]
    if result.get("kept"):
        panels.append("kept")
    if result.get("prefix_cache"):
        panels.append("prefix_cache")
    widths = [
        {"contenders": 3, "features": 2.2, "peers": 2.6, "sweep": 2}.get(p, 1.4) for p in panels
    ]
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(4 + 3 * len(panels), 4.6),
        gridspec_kw={"width_ratios": widths},
        squeeze=False,
    )
    for ax, panel in zip(axes[0], panels):
        {
            "contenders": _throughput_panel,
            "prefix": _prefix_panel,
            "overhead": _overhead_panel,
            "features": _features_panel,
            "embed": _embed_panel,
            "warm": _warm_panel,
            "peers": _peers_panel,
            "sweep": _sweep_panel,
            "kept": _kept_panel,
            "prefix_cache": _prefix_cache_panel,
        }[panel](ax, result)
    config = result["config"]
    engine = (
        result.get("engine")
        or (result.get("features") or {}).get("engine")
        or (result.get("embed") or {}).get("engine")
        or (result.get("warm") or {}).get("engine")
        or (result.get("peers") or {}).get("engine")
        or {}
    )
    machine = f"{engine.get('hardware', 'this machine')}, vLLM {engine.get('version', '')}"
    fig.suptitle(
        f"batchllm bench: {config['requests']:,} requests, outputs "
        f"{config['output_tokens'][0]}-{config['output_tokens'][1]} tokens, {machine}"
        if _ran_workload(result)
        else f"batchllm bench: {machine}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _throughput_panel(ax, result: dict[str, Any]) -> None:
    contenders = ordered(result["contenders"])
    medians = [c["output_tokens_per_s"]["median"] for c in contenders]
    highs = [c["output_tokens_per_s"]["max"] for c in contenders]
    colors = ["tab:green" if c["label"].startswith("batchllm") else "tab:gray" for c in contenders]
    y = list(range(len(contenders)))
    ax.barh(y, medians, color=colors)
    ax.errorbar(
        medians,
        y,
        xerr=_error_bars([c["output_tokens_per_s"] for c in contenders]),
        fmt="none",
        ecolor="black",
        capsize=3,
        linewidth=0.8,
    )
    generating = [c.get("generation_output_tokens_per_s", {}).get("median", 0) for c in contenders]
    if any(generating):
        ax.barh(
            y,
            generating,
            color="none",
            edgecolor="black",
            hatch="//",
            linewidth=0.6,
            label="end to end: throughput once its own engine is up",
        )
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7)
    for i, c in enumerate(contenders):
        if "ratio_to_raw" in c:
            reach = max(highs[i], generating[i])
            ax.text(reach, i, f"  {c['ratio_to_raw']:.2f}x", va="center", fontsize=7)
    ax.set_yticks(y, [c["label"] for c in contenders], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(right=max(max(highs), max(generating)) * 1.15)
    ax.set_xlabel("output tokens/s (median, min-max of repeats)")
    ax.set_title("throughput on one workload (ratio: output tokens/s vs raw vLLM)", fontsize=9)


def _error_bars(figures: list[dict[str, float]]) -> list[list[float]]:
    """Error bars from each figure's median down to its min and up to its max (the repeats')."""
    return [[f["median"] - f["min"] for f in figures], [f["max"] - f["median"] for f in figures]]


def _paired_bars(
    draw: Callable[..., Any], green: tuple[str, list[float]], gray: tuple[str, list[float]]
) -> None:
    """Two bars side by side at each position 0, 1, ... (`draw` is ax.bar or ax.barh, whose
    third argument is the bars' thickness either way): the green one, then the gray one."""
    for shift, color, (label, values) in ((-0.2, "tab:green", green), (0.2, "tab:gray", gray)):
        draw([i + shift for i in range(len(values))], values, 0.4, color=color, label=label)


def _prefix_panel(ax, result: dict[str, Any]) -> None:
    prefix = result["prefix"]
    sides = [prefix["file_order"], prefix["grouped"]]
    medians = [s["output_tokens_per_s"]["median"] for s in sides]
    ax.bar(
        ["file order", "grouped"],
        medians,
        color=["tab:gray", "tab:green"],
        yerr=_error_bars([s["output_tokens_per_s"] for s in sides]),
        capsize=3,
    )
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"prefix grouping: {prefix['gain']:.2f}x", fontsize=9)


def _overhead_panel(ax, result: dict[str, Any]) -> None:
    sizes = result["overhead"]["sizes"]
    x = range(len(sizes))
    _paired_bars(
        ax.bar,
        ("own work", [s["own_rows_per_s"] for s in sizes]),
        ("+ tokenizing, sizing", [s["rows_per_s"] for s in sizes]),
    )
    ax.set_xticks(list(x), [f"{s['lines']:,}" for s in sizes], fontsize=8)
    ax.set_ylabel("rows/s without generation")
    ax.set_xlabel("input lines")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7)
    twin = ax.twinx()
    twin.plot(list(x), [s["peak_rss_bytes"] / _MIB for s in sizes], "o-", color="tab:red")
    twin.set_ylabel("peak RSS, MiB", color="tab:red")
    twin.set_ylim(bottom=0)
    ax.set_title("overhead and memory", fontsize=9)


def _features_panel(ax, result: dict[str, Any]) -> None:
    from batchllm.bench.parts.features import JOBS

    jobs = [result["features"]["jobs"][key] for key in JOBS]
    y = range(len(jobs))
    _paired_bars(
        ax.barh,
        ("req/s", [j["requests_ratio_to_plain"] for j in jobs]),
        ("output tok/s", [j["tokens_ratio_to_plain"] for j in jobs]),
    )
    ax.axvline(1.0, color="black", linewidth=0.6)
    ax.set_yticks(list(y), [j["label"] for j in jobs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("vs the plain job")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7)
    ax.set_title(
        f"request features; plain rows in a mixed job: "
        f"{result['features']['mixed_vs_control']['plain_rows']:.2f}x",
        fontsize=9,
    )


def _embed_panel(ax, result: dict[str, Any]) -> None:
    from batchllm.bench.parts.embed import CONTENDERS

    contenders = [result["embed"]["contenders"][key] for key in CONTENDERS]
    medians = [c["requests_per_s"]["median"] for c in contenders]
    ax.bar(
        range(len(contenders)),
        medians,
        color=[
            "tab:green" if c["label"].startswith("batchllm") else "tab:gray" for c in contenders
        ],
        yerr=_error_bars([c["requests_per_s"] for c in contenders]),
        capsize=3,
    )
    ax.set_xticks(
        list(range(len(contenders))),
        [c["label"].replace(": ", ":\n") for c in contenders],
        fontsize=6,
    )
    ax.set_ylabel("rows/s")
    ax.set_title("embeddings", fontsize=9)


def _warm_panel(ax, result: dict[str, Any]) -> None:
    side = result["warm"]["side_by_side"]
    shown = [(key, label) for key, label in _SIDE_BY_SIDE if key in side]
    seconds = [side[key]["seconds"] for key, _ in shown]
    colors = {"vllm_run_batch": "tab:gray", "batchllm_run": "tab:blue", "warm_worker": "tab:green"}
    ax.bar(range(len(shown)), seconds, color=[colors[key] for key, _ in shown])
    for i, value in enumerate(seconds):
        ax.annotate(f"{value:.0f} s", (i, value), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(
        list(range(len(shown))),
        [label.replace(" (", "\n(").replace(" to ", "\nto ") for _, label in shown],
        fontsize=6,
    )
    ax.set_ylabel("wall seconds, end to end")
    ax.set_title(f"one file of {side['lines']:,} lines", fontsize=9)


def _prefix_cache_panel(ax, result: dict[str, Any]) -> None:
    from batchllm.bench.parts.prefix_cache import LABELS

    rows = result["prefix_cache"]["rows"]
    keys = list(rows)
    ax.barh(range(len(keys)), [rows[k]["output_tokens_per_s"] for k in keys])
    ax.set_yticks(
        range(len(keys)),
        [f"{LABELS[k]}\n(hits {rows[k]['hit_rate']:.0%})" for k in keys],
        fontsize=6,
    )
    ax.invert_yaxis()
    ax.set_xlabel("output tokens/s")
    ax.set_title("shared documents, shuffled", fontsize=9)


def _kept_panel(ax, result: dict[str, Any]) -> None:
    from batchllm.bench.parts.kept import draw_kept

    draw_kept(ax, result["kept"])


def _peers_panel(ax, result: dict[str, Any]) -> None:
    from batchllm.bench.parts.peers_report import draw_rows

    draw_rows(ax, result["peers"])


def _sweep_panel(ax, result: dict[str, Any]) -> None:
    from batchllm.bench.parts.peers_report import draw_sweep

    draw_sweep(ax, result["peers"])
