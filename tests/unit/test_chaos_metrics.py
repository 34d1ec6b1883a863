"""The chaos run's metrics check (benchmarks/chaos_metrics.py): the workers' scraped row
counters pass against the database's rows when they are exact or short by no more than the
workers that ended after their last scrape can have committed (bounded by the timeline), and
fail on a count above the database's or a gap the timeline cannot explain; the Scraper reads a
real prometheus_client server's counters, and a worker that refuses or does not answer keeps
its last figures."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from benchmarks.chaos_metrics import Scraper, check_metrics, parse_figures

# The fleet's committed rows: 10 more each second.
TIMELINE = [[float(t), 10 * t] for t in range(7)]


def _figures(rows: int, at: float, completion_tokens: int = 0) -> dict:
    return {"rows": rows, "prompt_tokens": 0, "completion_tokens": completion_tokens, "at": at}


def _workers(killed_at: float = 3.2) -> list[dict]:
    """w1 killed at `killed_at`; w2 alive until after the final scrape (at 6.0)."""
    return [
        {"name": "w1", "started": -1.0, "ended": killed_at, "how_ended": "kill9"},
        {"name": "w2", "started": -1.0, "ended": 7.5, "how_ended": "stopped"},
    ]


def _metrics(w1_rows: int, w2_rows: int) -> dict:
    """w1 last scraped at 2.1, before it was killed; w2 at the final scrape."""
    return {
        "workers": {"w1": _figures(w1_rows, 2.1, 100), "w2": _figures(w2_rows, 6.0, 300)},
        "final_scrape_at": 6.0,
    }


def test_exact_figures_pass():
    result = check_metrics(_metrics(20, 40), _workers(), TIMELINE, 60, 400)
    assert result["passed"] and result["problem"] is None
    assert (result["metrics_rows"], result["db_rows"], result["unscraped_rows"]) == (60, 60, 0)
    assert (result["metrics_completion_tokens"], result["unscraped_completion_tokens"]) == (400, 0)


def test_a_killed_workers_unscraped_commits_within_the_timelines_slack_pass():
    # w1's last scrape at 2.1 saw it with 15 rows; a part committed up to COUNT_LAG_S (1 s)
    # before it may be counted after it: the fleet had 10 at 1.0 and 40 at 4.0 (the first
    # sample after its end at 3.2), so it can have committed up to 30 rows unscraped.
    result = check_metrics(_metrics(15, 40), _workers(), TIMELINE, 60, 450)
    assert result["passed"], result["problem"]
    assert (result["unscraped_rows"], result["allowed_slack"]) == (5, 30)
    assert result["slack_by_worker"] == {"w1": 30}  # w2 was alive at the final scrape
    # Tokens are reported, never judged: 50 unscraped tokens fail nothing.
    assert result["unscraped_completion_tokens"] == 50


def test_more_rows_counted_than_the_database_holds_fail():
    result = check_metrics(_metrics(21, 40), _workers(), TIMELINE, 60, 400)
    assert not result["passed"]
    assert result["problem"] == "metrics count 61 rows, the database 60: 1 counted twice"


def test_a_gap_beyond_the_slack_fails():
    result = check_metrics(_metrics(5, 20), _workers(), TIMELINE, 60, 400)
    assert not result["passed"]
    assert (result["unscraped_rows"], result["allowed_slack"]) == (35, 30)
    assert "35 unscraped, more than the 30" in result["problem"]


def test_a_worker_never_scraped_counts_from_its_start():
    workers = _workers() + [{"name": "w3", "started": 4.5, "ended": 5.5, "how_ended": "kill9"}]
    # w3 came and went between scrapes: the fleet committed 40 -> 60 from its start to its end.
    result = check_metrics(_metrics(15, 40), workers, TIMELINE, 60, None)
    assert result["slack_by_worker"] == {"w1": 30, "w3": 20}
    assert result["passed"] and result["unscraped_completion_tokens"] is None


def test_samples_while_the_database_was_away_widen_the_slack():
    timeline = [[0.0, 0], [1.0, 10], [2.0, None], [3.0, None], [4.0, None], [5.0, 50]]
    result = check_metrics(_metrics(15, 40), _workers(), timeline, 60, None)
    # Last known 1 s before the scrape at 2.1: 10 (at 1.0); first known after 3.2: 50 (at 5.0).
    assert result["slack_by_worker"] == {"w1": 40}


def test_without_a_recorded_final_scrape_the_latest_scrape_stands_for_it():
    metrics = _metrics(15, 40)
    del metrics["final_scrape_at"]
    result = check_metrics(metrics, _workers(), TIMELINE, 60, None)
    assert result["passed"] and result["slack_by_worker"] == {"w1": 30}


# -- the Scraper against a real exposition --------------------------------------------------


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def counters(registry: CollectorRegistry) -> dict[str, Counter]:
    """Counters named as batchllm/execution/metrics.py names them, and one that must not be
    taken for the prompt tokens."""
    return {
        "rows": Counter("batchllm_rows", "rows", ("model", "status"), registry=registry),
        "prompt": Counter("batchllm_prompt_tokens", "prompt", ("model",), registry=registry),
        "cached": Counter("batchllm_prompt_cached_tokens", "c", ("model",), registry=registry),
        "completion": Counter(
            "batchllm_completion_tokens", "completion", ("model",), registry=registry
        ),
    }


@pytest.fixture
def port(registry: CollectorRegistry) -> Iterator[int]:
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    yield server.server_port
    server.shutdown()
    server.server_close()


def _commit(counters: dict[str, Counter], model: str, ok: int, error: int, tokens: int) -> None:
    counters["rows"].labels(model, "ok").inc(ok)
    counters["rows"].labels(model, "error").inc(error)
    counters["prompt"].labels(model).inc(tokens)
    counters["cached"].labels(model).inc(tokens // 2)
    counters["completion"].labels(model).inc(2 * tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_scraped_figures_are_the_counters_summed_over_models_and_statuses(counters, port):
    _commit(counters, "m1", ok=7, error=2, tokens=100)
    _commit(counters, "m2", ok=3, error=0, tokens=40)
    scraper = Scraper(lambda: [("w1", port)], t0=time.monotonic())
    scraper.scrape_all()
    figures = scraper.record()["w1"]
    assert {k: figures[k] for k in ("rows", "prompt_tokens", "completion_tokens")} == {
        "rows": 12,
        "prompt_tokens": 140,
        "completion_tokens": 280,
    }
    assert 0 <= figures["at"] == scraper.final_scrape_at
    assert scraper.run_entry()["workers"] == scraper.record()


def test_the_thread_scrapes_each_interval_until_stopped(counters, port):
    scraper = Scraper(lambda: [("w1", port)], t0=time.monotonic(), interval=0.05)
    with scraper:
        _commit(counters, "m1", ok=4, error=1, tokens=10)
        deadline = time.monotonic() + 5
        while scraper.record().get("w1", {}).get("rows") != 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scraper.record()["w1"]["rows"] == 5
    assert not scraper._thread.is_alive()


def test_a_worker_that_refuses_keeps_its_last_figures(counters, registry):
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    live, gone = server.server_port, _free_port()
    scraper = Scraper(lambda: [("w1", live), ("never-up", gone)], t0=time.monotonic())
    _commit(counters, "m1", ok=3, error=0, tokens=5)
    scraper.scrape_all()
    before = scraper.record()
    assert "never-up" not in before and before["w1"]["rows"] == 3
    server.shutdown()
    server.server_close()  # w1 died: its port refuses from now on
    _commit(counters, "m1", ok=9, error=0, tokens=5)
    scraper.scrape_all()
    assert scraper.record() == before


def test_a_worker_that_does_not_answer_keeps_its_last_figures(counters, port):
    targets = [("w1", port)]
    scraper = Scraper(lambda: targets, t0=time.monotonic(), timeout=0.2)
    _commit(counters, "m1", ok=2, error=0, tokens=5)
    scraper.scrape_all()
    before = scraper.record()
    # A paused worker: the kernel accepts the connection, nobody ever answers.
    with socket.socket() as paused:
        paused.bind(("127.0.0.1", 0))
        paused.listen()
        targets = [("w1", paused.getsockname()[1])]
        started = time.monotonic()
        scraper.scrape_all()
        assert time.monotonic() - started < 2
    assert scraper.record() == before


def test_only_the_committed_counters_samples_are_figures():
    text = (
        "# TYPE batchllm_rows counter\n"
        'batchllm_rows_total{model="m",status="ok"} 4.0\n'
        'batchllm_rows_created{model="m",status="ok"} 1.7e9\n'
        "# TYPE batchllm_prompt_cached_tokens counter\n"
        'batchllm_prompt_cached_tokens_total{model="m"} 9.0\n'
    )
    assert parse_figures(text) == {"rows": 4, "prompt_tokens": 0, "completion_tokens": 0}
