"""The tail of a quiet `batchllm worker`'s named log, for failure reports.

A worker's console keeps only batchllm's and Celery's lines; vLLM's output, its engine
processes' output and tracebacks printed by libraries go to the log file the console names in
its first lines ("vLLM's output goes to PATH"). A failing test shows both tails."""

from __future__ import annotations

import re
from pathlib import Path

_NAMED = re.compile(r"vLLM's output goes to (\S+\.log)")


def named_log_tail(console: str, lines: int = 40) -> str:
    """The last `lines` of the log file named in this console output, with a heading; empty
    when the console names none (a `-v` worker shows everything on its console)."""
    found = _NAMED.search(console)
    if found is None:
        return ""
    path = Path(found.group(1))
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"\n--- named log {path}: unreadable ({exc}) ---"
    tail = "\n".join(text.splitlines()[-lines:])
    return f"\n--- named log {path} (tail) ---\n{tail}"
