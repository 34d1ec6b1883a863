"""How the dashboard writes numbers and times (Jinja filters)."""

from __future__ import annotations

from datetime import datetime


def seconds(value: float | None) -> str:
    """A duration a person reads at a glance: 42 s, 3 m 05 s, 2 h 10 m."""
    if value is None:
        return "-"
    value = max(0.0, value)
    if value < 60:
        return f"{value:.0f} s"
    if value < 3600:
        return f"{int(value // 60)} m {int(value % 60):02d} s"
    return f"{int(value // 3600)} h {int(value % 3600 // 60):02d} m"


def rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def moment(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S UTC")


def count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


FILTERS = {"seconds": seconds, "rate": rate, "moment": moment, "count": count}
