"""The one exception of the image readers, and how a URL is shown in its messages."""

from __future__ import annotations

# Characters kept of a refused URL in messages: a data URL can be megabytes long.
_SHOWN = 60


class ImageProblem(Exception):
    """An image that cannot be used; the message says why (without the field, which the
    caller names)."""


def shown(url: str) -> str:
    return url if len(url) <= _SHOWN else url[:_SHOWN] + "..."
