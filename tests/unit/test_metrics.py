"""Prometheus metrics (batchllm/execution/metrics.py): the shard runner on the fake engine counts
rows, tokens and shard runs as the database does, across interrupts, crashes, resumes and
failures; the engine cache, the token-rate window, the metrics server, `worker
--metrics-port` and the API's /metrics.

The registry is the process's: other tests add to the same series, so each test compares the
values before and after."""

from __future__ import annotations

import json
import socket
import sys
import types
import urllib.request
from datetime import timedelta

import pytest
from click.testing import CliRunner
from prometheus_client import REGISTRY
from sqlalchemy import update

from batchllm.cli import cli
from batchllm.execution import metrics
from batchllm.execution.engines import EngineCache
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.jobs.create import create_job
from batchllm.process.stopping import StopRequest
from batchllm.settings import get_settings
from batchllm.store import leases, service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, utcnow
from tests.support.cli import capture_supervised
from tests.support.fake_runs import (
    FakeEngine,
    age_heartbeat,
    crash_on_checkpoint,
    make_spec,
    small_commits,
    write_items,
)
from tests.support.file_jobs import create_from_file
from tests.support.inputs import source_of
from tests.support.ports import free_port

MODEL = make_spec().model

SERIES = {
    "ok": ("batchllm_rows_total", {"status": "ok"}),
    "error": ("batchllm_rows_total", {"status": "error"}),
    "prompt": ("batchllm_prompt_tokens_total", {}),
    "completion": ("batchllm_completion_tokens_total", {}),
    "started": ("batchllm_shards_started_total", {}),
    "resumed": ("batchllm_shards_resumed_total", {}),
    "finished": ("batchllm_shards_finished_total", {}),
    "failed": ("batchllm_shards_failed_total", {}),
    "interrupted": ("batchllm_shards_stopped_total", {"reason": "interrupted"}),
    "lost": ("batchllm_shards_stopped_total", {"reason": "lost"}),
    "retrying": ("batchllm_shards_stopped_total", {"reason": "retrying"}),
    "durations": ("batchllm_shard_duration_seconds_count", {}),
}


def value(name: str, model: str = MODEL, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": model, **labels}) or 0.0


def snapshot(model: str = MODEL) -> dict[str, float]:
    return {key: value(name, model, **labels) for key, (name, labels) in SERIES.items()}


def since(before: dict[str, float], model: str = MODEL) -> dict[str, float]:
    """What changed since `before`, leaving out what did not."""
    after = snapshot(model)
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def create(settings, tmp_path, rows: int, *, shard_size: int, extra=None) -> tuple[str, list[int]]:
    created = create_from_file(
        write_items(tmp_path / "in.jsonl", rows, extra=extra),
        make_spec(),
        settings,
        shard_size=shard_size,
    )
    with session_scope(settings) as session:
        return created.job.id, [s.id for s in session.get(Job, created.job.id).shards]


def job_totals(settings, job_id: str) -> dict[str, float]:
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED
        return {
            "ok": job.request_completed,
            "error": job.request_failed,
            "prompt": job.prompt_tokens,
            "completion": job.completion_tokens,
        }


def rows_and_tokens(delta: dict[str, float]) -> dict[str, float]:
    return {k: delta.get(k, 0.0) for k in ("ok", "error", "prompt", "completion")}


# -- the runner ------------------------------------------------------------------------------


def test_a_job_counts_its_rows_tokens_and_shards_as_the_database_does(small_commits, tmp_path):
    settings = small_commits
    job_id, shard_ids = create(settings, tmp_path, 30, shard_size=12, extra=["{broken", "[]"])
    assert len(shard_ids) == 3
    before = snapshot()

    outcomes = ShardRunner(FakeEngine(), worker="w1", settings=settings).run(shard_ids)

    assert set(outcomes.values()) == {Outcome.COMPLETED}
    delta = since(before)
    totals = job_totals(settings, job_id)
    assert (totals["ok"], totals["error"]) == (30, 2)
    assert totals["prompt"] > 0 and totals["completion"] > 0
    assert rows_and_tokens(delta) == totals
    assert {k: delta[k] for k in ("started", "finished", "durations")} == {
        "started": 3,
        "finished": 3,
        "durations": 3,
    }
    assert set(delta) == {"ok", "error", "prompt", "completion", "started", "finished", "durations"}
    assert value("batchllm_requests_in_flight") == 0
    assert value("batchllm_shard_duration_seconds_sum") > 0


def test_an_interrupted_shard_is_counted_handed_back_then_resumed(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", 0.0)
    job_id, (shard_id,) = create(settings, tmp_path, 40, shard_size=40)
    before = snapshot()
    stop_request = StopRequest()

    def stop_at_step(step: int) -> None:
        if step == 8:
            stop_request.request()

    first = ShardRunner(
        FakeEngine(on_step=stop_at_step),
        worker="w1",
        settings=settings,
        stop=stop_request,
    )
    assert first.run([shard_id]) == {shard_id: Outcome.INTERRUPTED}
    with session_scope(settings) as session:
        committed = session.get(Job, job_id).request_completed
    assert 0 < committed < 40
    interrupted = since(before)
    assert interrupted == {
        "ok": committed,
        "prompt": interrupted["prompt"],
        "completion": interrupted["completion"],
        "started": 1,
        "interrupted": 1,
    }

    second = ShardRunner(FakeEngine(), worker="w1", settings=settings)
    assert second.run([shard_id]) == {shard_id: Outcome.COMPLETED}

    delta = since(before)
    assert rows_and_tokens(delta) == job_totals(settings, job_id)
    assert {k: delta[k] for k in ("started", "resumed", "finished", "interrupted")} == {
        "started": 2,
        "resumed": 1,
        "finished": 1,
        "interrupted": 1,
    }
    assert delta["durations"] == 1  # only the run that completed the shard


def test_rows_lost_in_a_crash_are_counted_once_when_they_run_again(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    job_id, shard_ids = create(settings, tmp_path, 36, shard_size=20, extra=["not json"])
    before = snapshot()
    crash_on_checkpoint(monkeypatch, crash_at=3)  # dies between a part file and its checkpoint
    with pytest.raises(KeyboardInterrupt):
        ShardRunner(FakeEngine(), worker="dead", settings=settings).run(shard_ids)
    monkeypatch.undo()
    with session_scope(settings) as session:
        crashed = since(before)
        assert crashed["ok"] + crashed.get("error", 0) == sum(
            s.rows_ok + s.rows_failed for s in session.get(Job, job_id).shards
        )
        session.execute(
            update(Shard)
            .where(Shard.job_id == job_id)
            .values(heartbeat_at=utcnow() - timedelta(hours=1))
        )

    ShardRunner(FakeEngine(), worker="alive", settings=settings).run(shard_ids)

    delta = since(before)
    assert rows_and_tokens(delta) == job_totals(settings, job_id)
    assert (delta["ok"], delta["error"]) == (36, 1)
    assert delta["resumed"] >= 1
    assert delta["finished"] == 2


def test_a_shard_run_that_fails_is_counted_as_handed_back_for_a_retry(small_commits, tmp_path):
    settings = small_commits
    _, (shard_id,) = create(settings, tmp_path, 8, shard_size=10)
    before = snapshot()

    def explode(step: int) -> None:
        if step == 3:
            raise RuntimeError("the fake engine broke")

    with pytest.raises(RuntimeError):
        ShardRunner(FakeEngine(on_step=explode), worker="w1", settings=settings).run([shard_id])

    delta = since(before)
    assert (delta["started"], delta["retrying"]) == (1, 1)
    assert "failed" not in delta and "finished" not in delta and "durations" not in delta
    assert value("batchllm_requests_in_flight") == 0


def test_a_shard_taken_over_by_another_worker_is_counted_lost(small_commits, tmp_path, monkeypatch):
    settings = small_commits
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", 0.0)
    _, (shard_id,) = create(settings, tmp_path, 40, shard_size=40)
    before = snapshot()

    def take_over(step: int) -> None:
        if step == 5:
            age_heartbeat(settings, shard_id, timedelta(hours=1))
            with session_scope(settings) as session:
                assert leases.claim_shard(session, shard_id, "w2", settings.lease_seconds)

    runner = ShardRunner(FakeEngine(on_step=take_over), worker="w1", settings=settings)
    assert runner.run([shard_id]) == {shard_id: Outcome.LOST}

    delta = since(before)
    assert (delta["started"], delta["lost"]) == (1, 1)
    with session_scope(settings) as session:
        assert delta.get("ok", 0) == session.get(Shard, shard_id).rows_ok


# -- the engine cache, the rate window -------------------------------------------------------


class _FakeVllmEngine:
    fail = False

    def __init__(self, *, model, options, max_model_len, settings) -> None:
        if self.fail:
            raise RuntimeError("does not fit")
        self.model = model
        self.max_model_len = max_model_len

    def shutdown(self) -> None:
        pass


def test_the_engine_cache_counts_starts_and_keeps_the_up_gauge(settings, monkeypatch):
    module = types.ModuleType("batchllm.engine.vllm_engine")
    module.VllmEngine = _FakeVllmEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "batchllm.engine.vllm_engine", module)
    model = "/models/engine-cache-test"
    spec = make_spec().model_copy(update={"model": model})
    starts = value("batchllm_engine_starts_total", model)
    cache = EngineCache(settings=settings)

    engine = cache.get(spec, 24)
    assert cache.get(spec, 24) is engine  # warm: no second start
    assert value("batchllm_engine_starts_total", model) == starts + 1
    assert value("batchllm_engine_up", model) == 1
    assert value("batchllm_engine_start_seconds", model) >= 0
    cache.close()
    assert value("batchllm_engine_up", model) == 0

    failures = value("batchllm_engine_start_failures_total", model)
    monkeypatch.setattr(_FakeVllmEngine, "fail", True)
    with pytest.raises(RuntimeError):
        cache.get(spec, 24)
    assert value("batchllm_engine_start_failures_total", model) == failures + 1
    assert value("batchllm_engine_starts_total", model) == starts + 1
    assert value("batchllm_engine_up", model) == 0


def test_output_tokens_per_second_is_over_the_last_whole_seconds():
    now = [100.2]
    rate = metrics.TokenRate(window=4, clock=lambda: now[0])
    rate.add(40)
    assert rate.per_second() == 0  # the current second is not over yet
    now[0] = 101.5
    rate.add(60)
    assert rate.per_second() == 10  # second 100: 40 tokens / 4 s
    now[0] = 102.0
    assert rate.per_second() == 25  # seconds 100 and 101
    now[0] = 104.9
    assert rate.per_second() == 25
    now[0] = 105.0
    assert rate.per_second() == 15  # second 100 left the window
    now[0] = 200.0
    rate.add(8)
    assert rate.per_second() == 0
    assert len(rate._buckets) == 1  # old seconds are dropped as new ones come


def test_the_gauges_read_the_window_and_the_requests_in_flight_of_their_model():
    model = "/models/rate-gauge-test"
    model_metrics = metrics.for_model(model)
    assert metrics.for_model(model) is model_metrics
    assert value("batchllm_output_tokens_per_second", model) == 0
    now = [50.0]
    model_metrics.rate._clock = lambda: now[0]
    model_metrics.step(300, 7)
    now[0] = 51.0
    assert value("batchllm_output_tokens_per_second", model) == 300 / metrics.RATE_WINDOW_SECONDS
    assert value("batchllm_requests_in_flight", model) == 7


# -- serving ---------------------------------------------------------------------------------


def test_the_metrics_server_serves_the_process_registry(small_commits, tmp_path):
    _, shard_ids = create(small_commits, tmp_path, 5, shard_size=10)
    ShardRunner(FakeEngine(), worker="w1", settings=small_commits).run(shard_ids)
    port = free_port()
    server = metrics.start_metrics_server(port, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    ok = value("batchllm_rows_total", status="ok")
    assert f'batchllm_rows_total{{model="{MODEL}",status="ok"}} {ok}' in text
    assert "# TYPE batchllm_shard_duration_seconds histogram" in text
    assert "process_cpu_seconds_total" in text  # prometheus_client's process collector


def worker_command_env(monkeypatch) -> None:
    """The variables the `worker` command sets in os.environ, restored after the test."""
    for name in ("BATCHLLM_WORKER_MODELS", "BATCHLLM_LOG_FORMAT", "BATCHLLM_MIN_LORA_RANK"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.delenv("BATCHLLM_METRICS_PORT", raising=False)


def test_worker_concurrency_gives_each_process_its_own_metrics_port(monkeypatch):
    worker_command_env(monkeypatch)
    monkeypatch.setattr("batchllm.engine.hardware.runs_on_cpu", lambda: True)
    started = capture_supervised(monkeypatch)

    result = CliRunner().invoke(
        cli, ["worker", "-m", "tiny", "--concurrency", "3", "--metrics-port", "9400"]
    )

    assert result.exit_code == 0, result.output
    ports = [argv[argv.index("--metrics-port") + 1] for argv in started]
    assert ports == ["9400", "9401", "9402"]


def test_worker_metrics_port_refusals(monkeypatch):
    worker_command_env(monkeypatch)
    past = CliRunner().invoke(
        cli, ["worker", "-m", "tiny", "--concurrency", "2", "--metrics-port", "65535"]
    )
    assert past.exit_code == 2
    assert "past 65535" in past.output

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("BATCHLLM_METRICS_PORT", str(port))  # the flag's variable
        busy = CliRunner().invoke(cli, ["worker", "-m", "tiny"])
    assert busy.exit_code == 2
    assert f"cannot serve metrics on port {port}" in busy.output


def test_the_api_counts_requests_by_route_and_created_batches(tmp_path):
    pytest.importorskip("fastapi.testclient")
    from fastapi.testclient import TestClient

    from batchllm.api.app import create_app
    from batchllm.settings import Settings

    settings = Settings(
        home=tmp_path / "home",
        database_url=f"sqlite:///{tmp_path / 'api.db'}",
        storage=str(tmp_path / "storage"),
        broker_url="memory://",
    )
    client = TestClient(create_app(settings, auth=False))

    def requests(route: str, status: str, method: str = "GET") -> float:
        labels = {"method": method, "route": route, "status": status}
        return REGISTRY.get_sample_value("batchllm_api_requests_total", labels) or 0.0

    created = REGISTRY.get_sample_value("batchllm_api_batch_creations_total") or 0.0
    unknown = requests("/v1/batches/{batch_id}", "404")
    lines = [
        {"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": {"model": m}}
        for c, m in (("a", "m1"), ("b", "m2"))
    ]
    upload = client.post(
        "/v1/files",
        files={"file": ("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode())},
        data={"purpose": "batch"},
    )
    assert upload.status_code == 200, upload.text
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    # Two models in one file: the batch is created, failed (no broker needed).
    batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], **body})
    assert batch.status_code == 200, batch.text
    assert client.get("/v1/batches/batch_nope").status_code == 404
    assert client.get("/v1/batches/batch_nope2").status_code == 404

    response = client.get("/metrics")

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert requests("/v1/batches/{batch_id}", "404") == unknown + 2
    assert REGISTRY.get_sample_value("batchllm_api_batch_creations_total") == created + 1
    assert "batchllm_api_requests_total{" in response.text
    assert "process_cpu_seconds_total" in response.text
