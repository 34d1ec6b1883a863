"""The peers part's figures as a terminal table and as two chart panels: the engines side by
side, and throughput against batch size per engine."""

from __future__ import annotations

from typing import Any

from batchllm.bench.display import GIB, format_table, median_bars, spread
from batchllm.bench.parts.peers import ROWS

_ENGINE_COLORS = {
    "llama.cpp (Q4_1)": "tab:orange",
    "raw vLLM": "tab:gray",
    "batchllm engine phase": "tab:green",
}


def _seconds(value: float | None) -> str:
    return f"{value:,.1f}" if value is not None else ""


def peers_text(peers: dict[str, Any]) -> str:
    rows = peers["rows"]
    table: list[tuple[str, ...]] = [
        (
            "engine",
            "req/s",
            "out tok/s",
            "spread",
            "wall s",
            "first row s",
            "peak RSS",
            "output tokens",
        )
    ]
    for key in ROWS:
        if key not in rows:
            continue
        row = rows[key]
        table.append(
            (
                row["label"],
                f"{row['requests_per_s']['median']:,.2f}",
                f"{row['output_tokens_per_s']['median']:,.0f}",
                spread(row["output_tokens_per_s"]),
                f"{row['wall_seconds']['median']:,.1f}",
                _seconds(row.get("first_row_seconds")),
                f"{row['peak_rss_bytes'] / GIB:.2f} GiB",
                f"{row['output_tokens']:,}",
            )
        )
    lines = ["peers: the same questions, greedy, on llama.cpp's server, vLLM and batchllm", ""]
    lines.append(format_table(table))
    run = rows.get("batchllm_run", {})
    if "generation_output_tokens_per_s" in run:
        lines.append(
            f"batchllm run: {run['generation_output_tokens_per_s']['median']:,.0f} output "
            f"tokens/s once its engine is up ({run['generation_seconds']['median']:,.1f} s of "
            f"its {run['wall_seconds']['median']:,.1f} s)"
        )
    for key, reason in peers.get("skipped", {}).items():
        lines.append(f"skipped {key}: {reason}")
    lines.append("")
    lines.append("answers that agree (identical text; mean similarity):")
    for pair in peers.get("agreement", []):
        lines.append(
            f"  {pair['label']}: {pair['identical']}/{pair['compared']} identical, "
            f"similarity {pair['similarity']:.2f}"
        )
    lines.append("")
    lines.append(_sweep_text(peers["sweep"]))
    return "\n".join(lines)


def _sweep_text(points: list[dict[str, Any]]) -> str:
    table: list[tuple[str, ...]] = [
        ("engine", "batch", "max_model_len", "requests", "out tok/s", "req/s", "peak RSS", "load")
    ]
    measured = [p for p in points if "error" not in p]
    for p in sorted(measured, key=lambda p: (p["engine"], p["max_model_len"], p["batch"])):
        table.append(
            (
                p["engine"],
                str(p["batch"]),
                str(p["max_model_len"]),
                str(p["requests"]),
                f"{p['output_tokens_per_s']:,.0f}",
                f"{p['requests_per_s']:,.2f}",
                f"{p['peak_rss_bytes'] / GIB:.2f} GiB",
                f"{p['load_average_1m']:.1f}",
            )
        )
    failed = [f"{p['engine']} at {p['batch']}: {p['error']}" for p in points if "error" in p]
    return "\n".join(
        [
            "batch-size sweep (max_num_seqs; llama.cpp: slots), one run each:",
            format_table(table),
            *(f"failed: {line}" for line in failed),
        ]
    )


def draw_rows(ax, peers: dict[str, Any]) -> None:
    rows = [peers["rows"][key] for key in ROWS if key in peers["rows"]]
    colors = [
        "tab:green"
        if r["label"].startswith("batchllm")
        else "tab:orange"
        if r["label"].startswith("llama")
        else "tab:gray"
        for r in rows
    ]
    medians = median_bars(ax, [r["output_tokens_per_s"] for r in rows], colors)
    for i, (value, row) in enumerate(zip(medians, rows)):
        reach = row["output_tokens_per_s"]["max"]
        ax.text(reach, i, f"  {value:,.0f}", va="center", fontsize=7)
    ax.set_yticks(
        list(range(len(rows))), [r["label"].replace(" (", "\n(", 1) for r in rows], fontsize=7
    )
    ax.invert_yaxis()
    ax.set_xlim(right=max(r["output_tokens_per_s"]["max"] for r in rows) * 1.2)
    ax.set_xlabel("output tokens/s (median, min-max of repeats)")
    ax.set_title("the same questions on each engine", fontsize=9)


def draw_sweep(ax, peers: dict[str, Any]) -> None:
    points = [p for p in peers["sweep"] if "error" not in p]
    lengths = sorted({p["max_model_len"] for p in points})
    sized = lengths[0]
    for engine, color in _ENGINE_COLORS.items():
        line = sorted(
            (p for p in points if p["engine"] == engine and p["max_model_len"] == sized),
            key=lambda p: p["batch"],
        )
        if line:
            ax.plot(
                [p["batch"] for p in line],
                [p["output_tokens_per_s"] for p in line],
                "o-",
                color=color,
                label=engine,
            )
        for p in points:
            if p["engine"] == engine and p["max_model_len"] != sized:
                ax.plot(
                    p["batch"],
                    p["output_tokens_per_s"],
                    "x",
                    color=color,
                    markersize=9,
                    label=f"{engine}, max_model_len {p['max_model_len']}",
                )
    ax.set_xscale("log", base=2)
    batches = sorted({p["batch"] for p in points})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (max_num_seqs; llama.cpp: slots)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6, loc="upper left")
    ax.set_title(f"throughput against batch size (max_model_len {sized})", fontsize=9)
