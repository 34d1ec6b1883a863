"""Prometheus metrics of a worker process, served by `batchllm worker --metrics-port P`.

Every metric lives in the default registry of the process that records it: `worker
--concurrency N` runs N single-process workers and child i serves its own on port P+i, so no
counter is shared between processes and no multiprocess mode is needed. Rows and tokens are
counted when committed (part file written and checkpointed), not when the engine finishes them:
a row lost in a crash, or whose shard another worker took over, runs again elsewhere and is
counted there, so the fleet's counters add up to the job's totals in the database. The
engine-side gauges (requests in flight, output tokens/s) are updated once per engine step. The
runner keeps one `ModelMetrics` per model, its labelled children looked up once (the hot path).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

_MODEL = ("model",)
# The reasons a shard run ends without finishing or failing its shard (runner.Outcome values).
STOP_REASONS = ("cancelled", "interrupted", "engine_died", "lost", "retrying")
# Shards run for minutes to hours (BATCHLLM_SHARD_SIZE rows each).
_SHARD_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, float("inf"))
RATE_WINDOW_SECONDS = 10

ROWS = Counter(
    "batchllm_rows",
    "Rows this worker process committed (written to Parquet and checkpointed), by status: "
    "ok, or error (invalid line, prompt too long, refused or ended early by vLLM).",
    ("model", "status"),
)
PROMPT_TOKENS = Counter(
    "batchllm_prompt_tokens", "Prompt tokens of the rows this process committed.", _MODEL
)
PROMPT_CACHED_TOKENS = Counter(
    "batchllm_prompt_cached_tokens",
    "Prompt tokens of the committed rows that vLLM served from its prefix cache; over "
    "batchllm_prompt_tokens, the prefix cache's hit rate.",
    _MODEL,
)
COMPLETION_TOKENS = Counter(
    "batchllm_completion_tokens",
    "Completion tokens of the rows this process committed (every sample when n > 1); equals "
    "the jobs' completion_tokens in the database.",
    _MODEL,
)
SHARDS_STARTED = Counter(
    "batchllm_shards_started", "Shard runs this process started (claimed a shard).", _MODEL
)
SHARDS_RESUMED = Counter(
    "batchllm_shards_resumed",
    "Shard runs that resumed from checkpoints an earlier run committed (also counted in "
    "batchllm_shards_started_total).",
    _MODEL,
)
SHARDS_FINISHED = Counter(
    "batchllm_shards_finished", "Shard runs that completed their shard.", _MODEL
)
SHARDS_FAILED = Counter(
    "batchllm_shards_failed",
    "Shard runs that failed their shard (an error, or the engine died on its last attempt).",
    _MODEL,
)
SHARDS_STOPPED = Counter(
    "batchllm_shards_stopped",
    "Shard runs that ended without finishing or failing their shard, by reason: cancelled "
    "(the job was cancelled), interrupted (worker shutdown; handed back), engine_died (handed "
    "back), lost (its lease ran out and another worker took it over), retrying (an error "
    "ended the run; handed back, counted against BATCHLLM_MAX_SHARD_FAILURES).",
    ("model", "reason"),
)
DRAIN_ROWS = Counter(
    "batchllm_drain_rows",
    "Rows in flight when a stop (SIGTERM) began its drain, by outcome: saved (finished within "
    "--drain-seconds and committed), aborted (cut off, handed back with their shard to run "
    "again) or unstarted (not generating yet: handed back at the drain's start, no work lost).",
    ("model", "outcome"),
)
DRAIN_SECONDS = Gauge(
    "batchllm_last_drain_seconds",
    "How long this process's last drain took, from the stop to its last row or its deadline.",
    _MODEL,
)
SHARD_SECONDS = Histogram(
    "batchllm_shard_duration_seconds",
    "Wall time of shard runs that completed their shard, from the claim to the shard's end "
    "(a resumed run: its own part only).",
    _MODEL,
    buckets=_SHARD_BUCKETS,
)
ENGINE_STARTS = Counter(
    "batchllm_engine_starts", "vLLM engines this process started (built and warm).", _MODEL
)
ENGINE_START_FAILURES = Counter(
    "batchllm_engine_start_failures", "vLLM engine starts that raised an error.", _MODEL
)
ENGINE_START_SECONDS = Gauge(
    "batchllm_engine_start_seconds", "Seconds the last engine start of the model took.", _MODEL
)
ENGINE_UP = Gauge(
    "batchllm_engine_up", "1 while this process holds a warm engine for the model, else 0.", _MODEL
)
ENGINE_INFO = Gauge(
    "batchllm_engine_info",
    "1 for the engine profile this worker process serves (built at start-up from the worker's "
    "engine flags): its model, task, max_model_len, dtype, quantization and LoRA rank.",
    ("model", "task", "max_model_len", "dtype", "quantization", "max_lora_rank"),
)
IN_FLIGHT = Gauge(
    "batchllm_requests_in_flight",
    "Requests in the engine (queued or running), as of the last engine step.",
    _MODEL,
)
OUTPUT_TOKENS_PER_SECOND = Gauge(
    "batchllm_output_tokens_per_second",
    f"Tokens the engine generated per second over the last {RATE_WINDOW_SECONDS} whole seconds.",
    _MODEL,
)


class TokenRate:
    """Tokens per second over a sliding window of whole seconds: `add` (the runner, once per
    step) sums into one-second buckets, `per_second` (a scrape, another thread) reads them."""

    def __init__(
        self, window: int = RATE_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self._clock = clock
        self._buckets: collections.deque[list[int]] = collections.deque()  # [second, tokens]
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        second = int(self._clock())
        with self._lock:
            buckets = self._buckets
            if buckets and buckets[-1][0] == second:
                buckets[-1][1] += tokens
            else:
                buckets.append([second, tokens])
                while buckets[0][0] < second - self.window:
                    buckets.popleft()

    def per_second(self) -> float:
        """Tokens of the last `window` complete seconds (not the current one) per second."""
        now = int(self._clock())
        with self._lock:
            total = sum(t for s, t in self._buckets if now - self.window <= s < now)
        return total / self.window


class ModelMetrics:
    """The metric children of one model, looked up once."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.rows_ok = ROWS.labels(model, "ok")
        self.rows_error = ROWS.labels(model, "error")
        self.prompt_tokens = PROMPT_TOKENS.labels(model)
        self.prompt_cached_tokens = PROMPT_CACHED_TOKENS.labels(model)
        self.completion_tokens = COMPLETION_TOKENS.labels(model)
        self.shards_started = SHARDS_STARTED.labels(model)
        self.shards_resumed = SHARDS_RESUMED.labels(model)
        self.shards_finished = SHARDS_FINISHED.labels(model)
        self.shards_failed = SHARDS_FAILED.labels(model)
        self.shards_stopped = {r: SHARDS_STOPPED.labels(model, r) for r in STOP_REASONS}
        self.shard_seconds = SHARD_SECONDS.labels(model)
        self.engine_starts = ENGINE_STARTS.labels(model)
        self.engine_start_failures = ENGINE_START_FAILURES.labels(model)
        self.engine_start_seconds = ENGINE_START_SECONDS.labels(model)
        self.engine_up = ENGINE_UP.labels(model)
        self.in_flight = IN_FLIGHT.labels(model)
        self.rate = TokenRate()
        OUTPUT_TOKENS_PER_SECOND.labels(model).set_function(self.rate.per_second)

    def committed(
        self,
        ok: int,
        error: int,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
    ) -> None:
        """A committed part's totals: its rows by status and their tokens."""
        if cached_tokens:
            self.prompt_cached_tokens.inc(cached_tokens)
        if ok:
            self.rows_ok.inc(ok)
        if error:
            self.rows_error.inc(error)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.inc(completion_tokens)

    def step(self, generated_tokens: int, in_flight: int) -> None:
        """After an engine step: tokens it generated, requests still in the engine."""
        if generated_tokens:
            self.rate.add(generated_tokens)
        self.in_flight.set(in_flight)

    def shard_started(self, *, resumed: bool) -> None:
        self.shards_started.inc()
        if resumed:
            self.shards_resumed.inc()

    def shard_finished(self, seconds: float) -> None:
        self.shards_finished.inc()
        self.shard_seconds.observe(seconds)

    def shard_failed(self) -> None:
        self.shards_failed.inc()

    def shard_stopped(self, reason: str) -> None:
        self.shards_stopped[reason].inc()

    def drained(self, saved: int, aborted: int, unstarted: int, seconds: float) -> None:
        """A stop's drain ended: rows it saved, rows it aborted, rows not started when it
        began, how long it took."""
        DRAIN_ROWS.labels(self.model, "saved").inc(saved)
        DRAIN_ROWS.labels(self.model, "aborted").inc(aborted)
        DRAIN_ROWS.labels(self.model, "unstarted").inc(unstarted)
        DRAIN_SECONDS.labels(self.model).set(seconds)

    def engine_started(self, seconds: float) -> None:
        self.engine_starts.inc()
        self.engine_start_seconds.set(seconds)
        self.engine_up.set(1)

    def engine_start_failed(self) -> None:
        self.engine_start_failures.inc()
        self.engine_up.set(0)

    def engine_stopped(self) -> None:
        self.engine_up.set(0)


_models: dict[str, ModelMetrics] = {}
_models_lock = threading.Lock()


def for_model(model: str) -> ModelMetrics:
    """The model's metrics; the first call makes every series of the model, at 0, so a
    rate() over the first increase is right."""
    metrics = _models.get(model)
    if metrics is None:
        with _models_lock:
            metrics = _models.get(model)
            if metrics is None:
                metrics = _models[model] = ModelMetrics(model)
    return metrics


# -- the functions other modules call --------------------------------------------------------


def engine_started(model: str, seconds: float) -> None:
    for_model(model).engine_started(seconds)


def engine_start_failed(model: str) -> None:
    for_model(model).engine_start_failed()


def engine_stopped(model: str) -> None:
    for_model(model).engine_stopped()


def engine_profile(profile: dict[str, Any]) -> None:
    """Show the worker's engine profile (execution/profile.py EngineProfile.as_dict()) as labels."""
    ENGINE_INFO.clear()  # one profile at a time: the one built last
    ENGINE_INFO.labels(
        model=profile["model"],
        task=profile["task"],
        max_model_len=str(profile["max_model_len"]),
        dtype=profile["dtype"],
        quantization=profile["quantization"] or "none",
        max_lora_rank=str(profile["max_lora_rank"] or 0),
    ).set(1)


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve this process's registry at http://ADDR:PORT/metrics from a daemon thread; returns
    the server (its shutdown() stops it; None before prometheus_client 0.20). OSError when the
    port is taken."""
    started = start_http_server(port, addr=addr, registry=REGISTRY)
    return started[0] if started else None
