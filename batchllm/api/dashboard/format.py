"""How the dashboard writes numbers and times (Jinja filters)."""

from __future__ import annotations

import unicodedata
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


# Control (NUL, ESC), format (RTL override, zero-width), surrogate, private-use and unassigned
# characters, and the line and paragraph separators.
_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def visible(value: object) -> str:
    """A tenant's string (a custom_id, a model name) as a person can read it: every character
    that would act on the page instead of showing (an RTL override reversing what follows it,
    a NUL) written as its escape, e.g. \\u202e. HTML escaping is the template's, after this."""
    text = "" if value is None else str(value)
    return "".join(
        ch if unicodedata.category(ch) not in _INVISIBLE else _escape(ord(ch)) for ch in text
    )


def _escape(code: int) -> str:
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


FILTERS = {
    "seconds": seconds,
    "rate": rate,
    "moment": moment,
    "count": count,
    "visible": visible,
}
