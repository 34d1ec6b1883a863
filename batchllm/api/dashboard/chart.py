"""The job page's chart: rows/s and output tok/s over time as an inline SVG drawn here, so the
page needs no charting script (the page's script only fetches a fresh copy while it runs)."""

from __future__ import annotations

from html import escape
from typing import Any

WIDTH, HEIGHT = 720, 220
LEFT, RIGHT, TOP, BOTTOM = 92, 92, 16, 28
SERIES = (
    ("rows_per_s", "rows/s", "rows", "#2563eb"),
    ("tokens_per_s", "output tok/s", "tokens", "#d97706"),
)


def _scale(top: float) -> float:
    """A round axis maximum at or above `top`."""
    if top <= 0:
        return 1.0
    step = 10 ** len(str(int(top))) / 10
    for factor in (1, 2, 2.5, 5, 10):
        if step * factor >= top:
            return step * factor
    return top


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:,.2g}"


def chart_svg(points: list[dict[str, Any]]) -> str:
    """Both series on one time axis, each with its own vertical scale (rows/s on the left,
    tok/s on the right): their shapes compare, their units do not."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="rows per second and output tokens per second over time" '
        f'data-points="{len(points)}">',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" class="plot"/>',
    ]
    if not points:
        parts.append(
            f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="empty">'
            "no rows committed yet</text></svg>"
        )
        return "".join(parts)
    span = max(p["t"] for p in points) or 1.0
    for i in range(5):
        y = TOP + plot_h * i / 4
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
        )
    for side, (key, label, name, color) in enumerate(SERIES):
        top = _scale(max(p[key] for p in points))
        coords = [
            (LEFT + plot_w * p["t"] / span, TOP + plot_h * (1 - p[key] / top)) for p in points
        ]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        parts.append(
            f'<polyline class="series {name}" points="{path}" fill="none" stroke="{color}" '
            'stroke-width="2"/>'
        )
        parts.extend(
            f'<circle class="point {name}" cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>'
            for x, y in coords
        )
        x_label, anchor = (LEFT - 6, "end") if side == 0 else (LEFT + plot_w + 6, "start")
        parts.append(
            f'<text x="{x_label}" y="{TOP + 10}" text-anchor="{anchor}" fill="{color}">'
            f"{escape(_fmt(top))}</text>"
            f'<text x="{x_label}" y="{TOP + plot_h}" text-anchor="{anchor}" fill="{color}">0</text>'
            f'<text x="{x_label}" y="{TOP + plot_h / 2}" text-anchor="{anchor}" fill="{color}">'
            f"{escape(label)}</text>"
        )
    parts.append(
        f'<text x="{LEFT}" y="{HEIGHT - 8}">0 s</text>'
        f'<text x="{LEFT + plot_w}" y="{HEIGHT - 8}" text-anchor="end">{span:,.0f} s</text>'
        "</svg>"
    )
    return "".join(parts)
