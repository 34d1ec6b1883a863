"""Webhooks: a job's end POSTed, signed, retried with backoff until delivered, every attempt in
SQL, on a local HTTP receiver."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from click.testing import CliRunner

from batchllm.cli import cli
from batchllm.client import Client
from batchllm.errors import BatchLLMError
from batchllm.execution import webhooks
from batchllm.execution.stand_in_engines import FakeEngine, FakeEngines
from batchllm.execution.webhooks import deliver_due, verify
from batchllm.jobs.create import create_job
from batchllm.store import service, state_machine
from batchllm.store import webhooks as store_webhooks
from batchllm.store.db import session_scope
from batchllm.store.models import Job, WebhookAttempt
from batchllm.store.webhooks import WebhookTarget
from tests.support.fake_runs import make_spec, write_items
from tests.support.inputs import source_of
from tests.support.webhook_receiver import Receiver

SECRET = "whsec_test-secret"


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(**kwargs) -> Receiver:
        made.append(Receiver(**kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _ended_job(settings, tmp_path, url: str, end) -> str:
    created = create_job(
        source_of(write_items(tmp_path / "in.jsonl", 2), settings),
        make_spec(),
        shard_size=10,
        settings=settings,
        notify=WebhookTarget(url, SECRET),
    )
    with session_scope(settings) as session:
        end(session, created.job.id)
    return created.job.id


def _attempts(settings, job_id: str) -> list[WebhookAttempt]:
    with session_scope(settings) as session:
        rows = session.query(WebhookAttempt).filter_by(job_id=job_id).order_by("attempt").all()
        session.expunge_all()
        return rows


def test_a_failed_job_is_posted_once_signed_with_openais_event_shape(settings, tmp_path, receiver):
    hook = receiver()
    job_id = _ended_job(
        settings, tmp_path, hook.url, lambda s, j: state_machine.fail_job(s, j, "x")
    )
    assert deliver_due(settings) == [job_id]
    ((headers, body),) = hook.received
    event = json.loads(body)
    assert event["type"] == "batch.failed"
    assert event == {
        "id": f"evt_{job_id}",
        "object": "event",
        "type": "batch.failed",
        "created_at": event["created_at"],
        "data": {"id": job_id},
    }
    assert headers["webhook-id"] == f"evt_{job_id}"
    assert verify(SECRET, headers["webhook-signature"], body)
    assert not verify("whsec_other", headers["webhook-signature"], body)
    assert not verify(SECRET, headers["webhook-signature"], body + b" ")
    # Delivered: a later pass sends nothing.
    assert deliver_due(settings) == []
    assert len(hook.received) == 1
    (attempt,) = _attempts(settings, job_id)
    assert (attempt.attempt, attempt.status_code, attempt.delivered, attempt.error) == (
        1,
        200,
        True,
        None,
    )


def test_a_batch_apis_event_names_the_batch_by_its_batch_id(settings, tmp_path, receiver):
    """As OpenAI's batch events: `data.id` is what the receiver retrieves (`batch_...`); the
    event id, the receivers' deduplication key, stays the job's."""
    from batchllm.api.batches import record_batch

    hook = receiver()
    job_id = _ended_job(
        settings, tmp_path, hook.url, lambda s, j: state_machine.fail_job(s, j, "x")
    )
    record_batch(
        settings,
        job_id,
        owner="key_1",
        endpoint="/v1/chat/completions",
        window="24h",
        input_file_id="file-x",
    )
    assert deliver_due(settings) == [job_id]
    ((headers, body),) = hook.received
    event = json.loads(body)
    assert event["data"] == {"id": "batch_" + job_id.removeprefix("job_")}
    assert event["id"] == headers["webhook-id"] == f"evt_{job_id}"


def test_a_receiver_failing_twice_gets_the_third_attempt_after_backoff(
    settings, tmp_path, receiver, monkeypatch
):
    settings.webhook_retry_seconds = 0.2
    hook = receiver(failures=2)
    job_id = _ended_job(
        settings, tmp_path, hook.url, lambda s, j: state_machine.fail_job(s, j, "x")
    )
    assert deliver_due(settings) == []
    # The second attempt is not due before the backoff: the clock that decides is held 0.1 s
    # after the first attempt, however long this machine takes between the calls.
    first_at = _attempts(settings, job_id)[0].created_at
    monkeypatch.setattr(store_webhooks, "utcnow", lambda: first_at + timedelta(seconds=0.1))
    assert deliver_due(settings) == []
    assert len(hook.received) == 1
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while not _attempts(settings, job_id)[-1].delivered and time.monotonic() < deadline:
        deliver_due(settings)
        time.sleep(0.05)
    attempts = _attempts(settings, job_id)
    assert [(a.attempt, a.status_code, a.delivered) for a in attempts] == [
        (1, 500, False),
        (2, 500, False),
        (3, 200, True),
    ]
    assert attempts[0].error == "HTTP 500"
    # The same event each time (receivers deduplicate on its id), each freshly signed.
    assert len({body for _, body in hook.received}) == 1
    assert all(verify(SECRET, h["webhook-signature"], b) for h, b in hook.received)
    # Backoff: 0.2 s after the first failure, 0.4 s after the second.
    assert (attempts[1].created_at - attempts[0].created_at).total_seconds() >= 0.2
    assert (attempts[2].created_at - attempts[1].created_at).total_seconds() >= 0.4


def test_a_run_that_completes_posts_batch_completed_before_it_returns(settings, tmp_path, receiver):
    hook = receiver()
    job = Client(settings).run(
        write_items(tmp_path / "in.jsonl", 3),
        model="/models/fake",
        max_model_len=64,
        engines=FakeEngines(FakeEngine()),
        notify=hook.url,
    )
    assert job.status == "completed"
    ((headers, body),) = hook.received
    assert json.loads(body)["type"] == "batch.completed"
    assert json.loads(body)["data"] == {"id": job.id}
    assert job.notify_secret is not None and job.notify_secret.startswith("whsec_")
    assert verify(job.notify_secret, headers["webhook-signature"], body)
    assert [a.delivered for a in _attempts(settings, job.id)] == [True]


def test_a_url_that_is_not_http_is_refused_before_the_job():
    with pytest.raises(BatchLLMError, match="webhook URL 'ftp://x/y'"):
        Client().submit([{"prompt": "hi"}], model="m", notify="ftp://x/y")


def test_a_cancelled_job_sends_batch_cancelled(settings, tmp_path, receiver):
    hook = receiver()

    def cancel(session, job_id: str) -> None:
        service.cancel_job(session, job_id)

    job_id = _ended_job(settings, tmp_path, hook.url, cancel)
    with session_scope(settings) as session:
        assert session.get(Job, job_id).status.value == "cancelled"
    assert deliver_due(settings) == [job_id]
    assert json.loads(hook.received[0][1])["type"] == "batch.cancelled"


def test_a_slow_receiver_times_out_and_counts_as_a_failed_attempt(settings, tmp_path, receiver):
    settings.webhook_timeout_seconds = 0.3
    hook = receiver(delay=2.0)
    job_id = _ended_job(
        settings, tmp_path, hook.url, lambda s, j: state_machine.fail_job(s, j, "x")
    )
    started = time.monotonic()
    assert deliver_due(settings) == []
    assert time.monotonic() - started < 1.5
    (attempt,) = _attempts(settings, job_id)
    assert attempt.status_code is None and "timed out" in attempt.error


def test_an_unreachable_receiver_is_recorded_and_status_shows_the_attempts(settings, tmp_path):
    job_id = _ended_job(
        settings,
        tmp_path,
        "http://127.0.0.1:9/hook",
        lambda s, j: state_machine.fail_job(s, j, "x"),
    )
    assert deliver_due(settings) == []
    result = CliRunner().invoke(cli, ["status", job_id])
    assert result.exit_code == 0, result.output
    assert "webhook    http://127.0.0.1:9/hook: retrying" in result.output
    assert "batch.failed" in result.output
    view = json.loads(CliRunner().invoke(cli, ["status", job_id, "--json"]).output)
    assert view["webhook"]["delivered"] is False
    assert view["webhook"]["attempts"][0]["attempt"] == 1
    assert "ConnectionRefusedError" in view["webhook"]["attempts"][0]["error"]
    assert SECRET not in json.dumps(view)


def test_an_attempt_claimed_by_another_sender_is_not_sent_twice(settings, tmp_path, receiver):
    hook = receiver()
    job_id = _ended_job(
        settings, tmp_path, hook.url, lambda s, j: state_machine.fail_job(s, j, "x")
    )
    from batchllm.store import webhooks as store_webhooks

    with session_scope(settings) as session:
        assert store_webhooks.claim_attempt(session, job_id, 1) is not None
    with session_scope(settings) as session:
        assert store_webhooks.claim_attempt(session, job_id, 1) is None
    assert hook.received == []
    assert webhooks.SIGNATURE_HEADER == "webhook-signature"
