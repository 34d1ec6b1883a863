"""The chaos run's workers' Prometheus counters against the database: during the run a
`Scraper` reads every living worker's /metrics (`batchllm worker --metrics-port`) each second,
and after the run `check_metrics` judges the fleet's counted rows against the rows the database
counted.

A worker counts a row when it commits it (batchllm/execution/metrics.py), so the fleet's
counters add up to the database's counts, except that a counter dies with its process: the
rows a worker committed after its last scrape, before it was killed or drained away, are in the
database and in no scrape. How many those can be is bounded by the run's timeline (the fleet's
committed rows twice a second): no more than the fleet committed between the worker's last
scrape and its end. So the check passes when

    0 <= database rows - scraped rows <= that bound, summed over the workers that ended

and fails on more scraped rows than the database holds (a row counted twice) or a gap the
timeline cannot explain (a commit no counter saw). Completion tokens are reported beside the
rows but not judged: the timeline counts rows, so it bounds no tokens.

Expected in run.json (what benchmarks/chaos.py records):
- "metrics": `Scraper.run_entry()`: {"workers": {name: {rows, prompt_tokens,
  completion_tokens, at}}, "final_scrape_at": seconds since t0 or None, "interval": seconds}
- "workers": [{name, started, ended, how_ended, ...}] with times in seconds since t0
- "timeline": [[seconds since t0, committed rows or None], ...]
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Sample names as prometheus_client exposes the counters of batchllm/execution/metrics.py (a
# Counter named `x` is exposed as `x_total`, beside a `x_created` timestamp we do not want).
FIGURES = {
    "batchllm_rows_total": "rows",
    "batchllm_prompt_tokens_total": "prompt_tokens",
    "batchllm_completion_tokens_total": "completion_tokens",
}
SCRAPE_TIMEOUT_S = 2.0
JOIN_TIMEOUT_S = 30.0

Targets = Callable[[], list[tuple[str, int]]]


# -- scraping --------------------------------------------------------------------------------


def parse_figures(text: str) -> dict[str, int]:
    """A worker's committed rows (ok and error) and tokens, summed over models, from its
    Prometheus text exposition."""
    figures = dict.fromkeys(FIGURES.values(), 0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            figure = FIGURES.get(sample.name)
            if figure is not None:
                figures[figure] += int(sample.value)
    return figures


def fetch_figures(port: int, timeout: float = SCRAPE_TIMEOUT_S) -> dict[str, int]:
    """One scrape of the worker serving http://127.0.0.1:PORT/metrics; raises when it does
    not answer in `timeout` seconds."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_figures(response.read().decode("utf-8"))


class Scraper:
    """Scrapes every target (worker name, metrics port) each `interval` seconds from a daemon
    thread, keeping each worker's last figures and when they were read (`at`, seconds since
    `t0`). A worker that does not answer (dead, paused, not listening yet) keeps its last
    figures: its counters are gone or frozen, and what it committed since is what the
    checker's slack is for."""

    def __init__(
        self,
        targets: Targets,
        t0: float,
        interval: float = 1.0,
        timeout: float = SCRAPE_TIMEOUT_S,
    ) -> None:
        self.targets, self.t0 = targets, t0
        self.interval, self.timeout = interval, timeout
        self.final_scrape_at: float | None = None
        self._last: dict[str, dict[str, Any]] = {}
        # One pass at a time: the harness's final scrape must not interleave with the thread's
        # pass, or an older answer could overwrite a newer one.
        self._pass_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-scraper", daemon=True)

    def scrape_all(self) -> None:
        """Scrape every current target once, now; remembered as the final scrape, the one the
        checker counts the living workers' figures from."""
        self.final_scrape_at = self._since_t0()
        self._scrape_pass()

    def record(self) -> dict[str, dict[str, Any]]:
        """{worker name: {rows, prompt_tokens, completion_tokens, at}}, JSON-able."""
        with self._pass_lock:
            return {name: dict(figures) for name, figures in self._last.items()}

    def run_entry(self) -> dict[str, Any]:
        """What run.json's "metrics" holds: the workers' last figures and the final scrape's
        time (check_metrics reads both)."""
        return {
            "workers": self.record(),
            "final_scrape_at": self.final_scrape_at,
            "interval": self.interval,
        }

    def _since_t0(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def _scrape_pass(self) -> None:
        try:
            targets = self.targets()
        except Exception:
            return  # the harness's worker list mid-change: the next pass will see it
        with self._pass_lock:
            for name, port in targets:
                self._scrape_one(name, port)

    def _scrape_one(self, name: str, port: int) -> None:
        # `at` is when the request went out: the figures hold at least every commit until then,
        # so the timeline's count at `at` is a lower bound of what they cover.
        at = self._since_t0()
        try:
            figures = fetch_figures(port, self.timeout)
        except Exception:
            return
        self._last[name] = {**figures, "at": at}

    def _run(self) -> None:
        while True:
            self._scrape_pass()
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=JOIN_TIMEOUT_S)


# -- the check -------------------------------------------------------------------------------


def committed_by(timeline: list[list[Any]], t: float) -> int:
    """The fleet's committed rows at the last sample at or before `t` (0 before any): a lower
    bound of what was committed at `t`."""
    seen = 0
    for at, committed in timeline:
        if at > t:
            break
        if committed is not None:
            seen = committed
    return int(seen)


def committed_once(timeline: list[list[Any]], t: float) -> int:
    """The fleet's committed rows at the first sample at or after `t` (the last known when
    none is): an upper bound of what was committed by `t`."""
    for at, committed in timeline:
        if at >= t and committed is not None:
            return int(committed)
    return committed_by(timeline, float("inf"))


def final_scrape_time(metrics: dict[str, Any]) -> float:
    """When the final scrape began; without it recorded, the latest scrape seen (a worker
    alive then was scraped at about that time), or never when nothing was scraped."""
    recorded = metrics.get("final_scrape_at")
    if recorded is not None:
        return float(recorded)
    times = [figures["at"] for figures in metrics.get("workers", {}).values()]
    return max(times, default=float("inf"))


# A worker counts a part's rows after the database has committed it (execution/runner.py,
# _count_committed): on a busy 2-core machine the count can come a scrape later than the
# commit the timeline already shows. A killed worker's last scrape can so miss rows committed
# up to this long before it; without it a quick chaos run failed once in about ten on this
# machine ("79 unscraped, more than the 53").
COUNT_LAG_S = 1.0


def unscraped_bound(
    worker: dict[str, Any],
    figures: dict[str, Any] | None,
    timeline: list[list[Any]],
    final_at: float,
) -> int:
    """The most rows `worker` can have committed that no scrape of it saw: the fleet's commits
    from COUNT_LAG_S before its last scrape (its start if never scraped) to its end. 0 for a
    worker alive at the final scrape, which read all it had committed."""
    ended = worker.get("ended")
    if ended is None or ended >= final_at:
        return 0
    if figures:  # a part committed just before the scrape may be counted just after it
        since = committed_by(timeline, float(figures["at"]) - COUNT_LAG_S)
    else:  # its counters started at 0 with its process
        started = worker.get("started")
        since = committed_by(timeline, float(started)) if started is not None else 0
    return max(0, committed_once(timeline, float(ended)) - since)


def _figure_total(scraped: dict[str, dict[str, Any]], figure: str) -> int:
    return sum(int(figures.get(figure, 0)) for figures in scraped.values())


def check_metrics(
    metrics: dict[str, Any],
    workers: list[dict[str, Any]],
    timeline: list[list[Any]],
    db_rows: int,
    db_completion_tokens: int | None,
) -> dict[str, Any]:
    """Judge the workers' scraped row counters (run.json's "metrics") against the database's
    committed rows (`db_rows`, completed + failed over the jobs); see the module's docstring.
    `db_completion_tokens` (None when run.json has none) is only reported."""
    scraped: dict[str, dict[str, Any]] = metrics.get("workers", {})
    final_at = final_scrape_time(metrics)
    slack_by_worker = {
        w["name"]: unscraped_bound(w, scraped.get(w["name"]), timeline, final_at) for w in workers
    }
    metrics_rows = _figure_total(scraped, "rows")
    unscraped = db_rows - metrics_rows
    slack = sum(slack_by_worker.values())
    metrics_tokens = _figure_total(scraped, "completion_tokens")
    return {
        "checked": True,
        "passed": 0 <= unscraped <= slack,
        "problem": _rows_problem(metrics_rows, db_rows, slack),
        "metrics_rows": metrics_rows,
        "db_rows": db_rows,
        "unscraped_rows": unscraped,
        "allowed_slack": slack,
        "slack_by_worker": {name: s for name, s in slack_by_worker.items() if s},
        "metrics_completion_tokens": metrics_tokens,
        "db_completion_tokens": db_completion_tokens,
        "unscraped_completion_tokens": (
            None if db_completion_tokens is None else db_completion_tokens - metrics_tokens
        ),
        "scraped_workers": len(scraped),
    }


def _rows_problem(metrics_rows: int, db_rows: int, slack: int) -> str | None:
    if metrics_rows > db_rows:
        return (
            f"metrics count {metrics_rows} rows, the database {db_rows}: "
            f"{metrics_rows - db_rows} counted twice"
        )
    if db_rows - metrics_rows > slack:
        return (
            f"metrics count {metrics_rows} rows, the database {db_rows}: "
            f"{db_rows - metrics_rows} unscraped, more than the {slack} the workers that ended "
            "after their last scrape can have committed"
        )
    return None


def not_checked(reason: str) -> dict[str, Any]:
    """The metrics check of a run that recorded no scrapes: reported, not failed."""
    return {"checked": False, "passed": True, "problem": None, "note": f"not checked: {reason}"}
