"""A progress line for long jobs: rows done, percent, output tokens/s, ETA.

On a terminal it redraws one line on stderr; elsewhere (CI, logs) it prints a line every 15 s.
"""

from __future__ import annotations

import sys
import time

import click

_MIN_RATE_SECONDS = 1.0


class Progress:
    def __init__(self, total: int, label: str = "rows") -> None:
        self.total, self.label = total, label
        self.rows = self.tokens = 0
        self.started: float | None = None  # from the first finished row, not engine start-up
        self._tty = sys.stderr.isatty()
        self._last_draw = 0.0
        self._interval = 0.2 if self._tty else 15.0

    def advance(self, rows: int, tokens: int) -> None:
        if self.started is None:
            self.started = time.monotonic()
        self.rows += rows
        self.tokens += tokens
        self.draw()

    def set(self, rows: int, tokens: int) -> None:
        if self.started is None:
            self.started = time.monotonic()
        self.rows, self.tokens = rows, tokens
        self.draw()

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < self._interval:
            return
        self._last_draw = now
        elapsed = now - (self.started or now)
        pct = 100.0 * self.rows / self.total if self.total else 100.0
        line = f"{self.rows:,}/{self.total:,} {self.label} ({pct:5.1f}%)"
        # The first rows finish together; a rate over a fraction of a second would be nonsense.
        if elapsed >= _MIN_RATE_SECONDS:
            rate = self.rows / elapsed
            eta = (self.total - self.rows) / rate if rate > 0 else 0
            line += f"  {self.tokens / elapsed:,.0f} out tok/s  eta {eta:,.0f}s"
        if self._tty:
            click.echo("\r" + line.ljust(78), nl=False, err=True)
        else:
            click.echo(line, err=True)

    def close(self) -> None:
        self.draw(force=True)
        if self._tty:
            click.echo("", err=True)
