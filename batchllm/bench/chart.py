"""The bench's figures as one PNG chart, a panel per part, for docs/performance.md."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchllm.bench.display import MIB, error_bars, median_bars
from batchllm.bench.report import SIDE_BY_SIDE, ordered, ran_workload


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
        if ran_workload(result)
        else f"batchllm bench: {machine}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _throughput_panel(ax, result: dict[str, Any]) -> None:
    contenders = ordered(result["contenders"])
    highs = [c["output_tokens_per_s"]["max"] for c in contenders]
    colors = ["tab:green" if c["label"].startswith("batchllm") else "tab:gray" for c in contenders]
    median_bars(ax, [c["output_tokens_per_s"] for c in contenders], colors)
    y = list(range(len(contenders)))
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
        yerr=error_bars([s["output_tokens_per_s"] for s in sides]),
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
    twin.plot(list(x), [s["peak_rss_bytes"] / MIB for s in sizes], "o-", color="tab:red")
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
        yerr=error_bars([c["requests_per_s"] for c in contenders]),
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
    shown = [(key, label) for key, label in SIDE_BY_SIDE if key in side]
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
