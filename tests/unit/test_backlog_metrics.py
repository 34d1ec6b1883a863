"""`serve`'s /metrics carries the fleet's backlog per model for autoscalers: rows waiting, the
time they take at the model's recent rate, live workers; the rows fall to 0 when the job ends."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from batchllm.api.app import create_app
from batchllm.store import state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus
from tests.support.fake_runs import create_items_job


@pytest.fixture
def no_broker(settings, monkeypatch):
    """No Redis: the worker registry reads none (live workers 0), as on a machine without one."""
    monkeypatch.setattr(settings, "broker_url", "memory://")
    return settings


def gauges(client: TestClient) -> dict[tuple[str, str], float]:
    text = client.get("/metrics").text
    found = re.findall(
        r'^(batchllm_backlog_\w+|batchllm_live_workers)\{model="([^"]*)"\} (\S+)$', text, flags=re.M
    )
    return {(name, model): float(value) for name, model, value in found}


def test_a_queued_job_shows_its_rows_and_they_fall_to_zero_when_it_ends(no_broker, tmp_path):
    job_id, _ = create_items_job(no_broker, tmp_path, 30, shard_size=10)
    with session_scope(no_broker) as session:
        model = session.get(Job, job_id).model
    client = TestClient(create_app(no_broker, auth=False))

    before = gauges(client)
    assert before[("batchllm_backlog_rows", model)] == 30
    assert ("batchllm_backlog_seconds", model) not in before  # no completed job: no rate yet
    assert before[("batchllm_live_workers", model)] == 0

    with session_scope(no_broker) as session:
        state_machine.fail_job(session, job_id, "ended for the test")
    after = gauges(client)
    assert after[("batchllm_backlog_rows", model)] == 0
    assert after[("batchllm_backlog_seconds", model)] == 0


def done_and_other_job(settings, tmp_path, rows: int) -> tuple[str, str]:
    """Two jobs' ids: one of 10 rows (the test ends it) and one of `rows` rows, in shards of 10."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    done_id, _ = create_items_job(settings, tmp_path / "a", 10, shard_size=10)
    other_id, _ = create_items_job(settings, tmp_path / "b", rows, shard_size=10)
    return done_id, other_id


def test_the_backlog_seconds_use_the_models_recent_rate(no_broker, tmp_path):
    done_id, waiting_id = done_and_other_job(no_broker, tmp_path, 40)
    with session_scope(no_broker) as session:
        done = session.get(Job, done_id)
        done.status, done.requests_per_s = JobStatus.COMPLETED, 8.0
        done.request_completed = 10
        model = done.model
    client = TestClient(create_app(no_broker, auth=False))
    found = gauges(client)
    assert found[("batchllm_backlog_rows", model)] == 40
    assert found[("batchllm_backlog_seconds", model)] == pytest.approx(40 / 8.0)
    assert waiting_id != done_id


def test_a_models_first_job_gets_seconds_from_its_rate_so_far(no_broker, tmp_path):
    """No completed job of the model yet (an autoscaler scaling it from zero): its running
    job's rows done since it started give the rate."""
    from datetime import timedelta

    from batchllm.store.models import utcnow

    job_id, _ = create_items_job(no_broker, tmp_path, 100, shard_size=10)
    with session_scope(no_broker) as session:
        job = session.get(Job, job_id)
        job.status, job.request_completed = JobStatus.IN_PROGRESS, 20
        job.started_at = utcnow() - timedelta(seconds=10)  # 2 rows/s so far
        model = job.model
    found = gauges(TestClient(create_app(no_broker, auth=False)))
    assert found[("batchllm_backlog_rows", model)] == 80
    assert found[("batchllm_backlog_seconds", model)] == pytest.approx(80 / 2.0, rel=0.05)


def test_a_models_first_job_before_any_row_takes_the_fleets_recent_rate(no_broker, tmp_path):
    """Nothing of the model's first job done yet: the median rate of the fleet's recent jobs
    of other models stands in, rather than no figure at all."""
    done_id, first_id = done_and_other_job(no_broker, tmp_path, 30)
    with session_scope(no_broker) as session:
        done = session.get(Job, done_id)
        done.status, done.requests_per_s, done.request_completed = JobStatus.COMPLETED, 5.0, 10
        done.model = "another-model"
        model = session.get(Job, first_id).model
    found = gauges(TestClient(create_app(no_broker, auth=False)))
    assert model != "another-model"
    assert found[("batchllm_backlog_rows", model)] == 30
    assert found[("batchllm_backlog_seconds", model)] == pytest.approx(30 / 5.0)
