"""What every table and chart of the bench is built from: columns, a figure's spread, and
median bars with the repeats' range."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GIB = 2**30
MIB = 2**20


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """The first row a header underlined; the first column left-aligned, the others right."""
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


def spread(figure: dict[str, float]) -> str:
    """The half-range of the repeats as a share of the median: how much to trust a ratio."""
    half = (figure["max"] - figure["min"]) / 2 / figure["median"] if figure["median"] else 0.0
    return f"±{half:.0%}"


def error_bars(figures: list[dict[str, float]]) -> list[list[float]]:
    """Error bars from each figure's median down to its min and up to its max (the repeats')."""
    return [[f["median"] - f["min"] for f in figures], [f["max"] - f["median"] for f in figures]]


def median_bars(ax: Any, figures: list[dict[str, float]], colors: list[str]) -> list[float]:
    """One horizontal bar per figure at its median, from the top, with the repeats' range as
    error bars; returns the medians."""
    medians = [f["median"] for f in figures]
    y = list(range(len(figures)))
    ax.barh(y, medians, color=colors)
    ax.errorbar(
        medians,
        y,
        xerr=error_bars(figures),
        fmt="none",
        ecolor="black",
        capsize=3,
        linewidth=0.8,
    )
    return medians
