"""Priorities and webhooks on a real fleet: one `batchllm worker` on the paced instant engine
(the order of shards is the subject, not generation), real Redis and PostgreSQL. A
low-priority job of many shards is submitted first and a high-priority one after: the worker
runs the high job's shards before the low job's remaining ones, and the low job completes too.
The high job's `notify` URL, a receiver in this process, gets its signed batch.completed event
from the worker's reconciler."""

from __future__ import annotations

import json
import time

from batchllm.execution.webhooks import verify
from batchllm.jobs.submit import submit_job
from batchllm.spec import JobSpec, SamplingDefaults
from batchllm.store.db import session_scope
from batchllm.store.models import JobStatus, WebhookAttempt
from batchllm.store.webhooks import WebhookTarget
from tests.support.fleet import ENGINE, PACED_INSTANT_ARGS, start_workers, stop_workers, tails
from tests.support.inputs import source_of
from tests.support.job_checks import load_job
from tests.support.webhook_receiver import Receiver

SECRET = "whsec_fleet-test"
# Enough low shards (each at least 8 paced steps, ~0.2 s) to still be queued when the high job,
# validated and sized after the low one started, arrives.
LOW_SHARDS = 40
ROWS_PER_SHARD = 4


def _write(path, count: int, word: str):
    path.write_text(
        "".join(json.dumps({"prompt": f"{word} number {i} is"}) + "\n" for i in range(count))
    )
    return path


def _submit(fleet_env, source, model, priority: str, notify: WebhookTarget | None = None):
    spec = JobSpec(
        model=str(model),
        engine=ENGINE,
        sampling=SamplingDefaults(max_tokens=8),
        priority=priority,
    )
    return submit_job(
        source_of(source, fleet_env.settings),
        spec,
        shard_size=ROWS_PER_SHARD,
        settings=fleet_env.settings,
        notify=notify,
    )


def _wait(workers, what: str, check, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        for worker in workers:
            assert worker.proc.poll() is None, f"{worker.name} exited" + tails(workers)
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} after {timeout:.0f}s" + tails(workers))
        time.sleep(0.2)


def test_a_high_job_submitted_second_runs_first_and_announces_its_end(
    fleet_env, tiny_model, tmp_path
):
    receiver = Receiver()
    workers = start_workers(
        ["prio@test"],
        fleet_env=fleet_env,
        model=tiny_model,
        log_dir=tmp_path,
        engine_args=PACED_INSTANT_ARGS,
    )
    try:
        low = _submit(
            fleet_env,
            _write(tmp_path / "low.jsonl", LOW_SHARDS * ROWS_PER_SHARD, "low"),
            tiny_model,
            "low",
        )
        _wait(
            workers,
            "the low job never started",
            lambda: any(s.started_at for s in load_job(fleet_env, low.id)[1]),
        )
        high = _submit(
            fleet_env,
            _write(tmp_path / "high.jsonl", 2 * ROWS_PER_SHARD, "high"),
            tiny_model,
            "high",
            notify=WebhookTarget(receiver.url, SECRET),
        )
        for job_id in (high.id, low.id):
            _wait(
                workers,
                f"job {job_id} did not end",
                lambda job_id=job_id: load_job(fleet_env, job_id)[0].status.is_final,
            )
        low_job, low_shards = load_job(fleet_env, low.id)
        high_job, high_shards = load_job(fleet_env, high.id)
        assert low_job.status is JobStatus.COMPLETED, low_job.error
        assert high_job.status is JobStatus.COMPLETED, high_job.error
        # Once the worker took the first high shard, it took no low shard until the last high
        # one: the high tasks went ahead of every low task still queued. The low shard the
        # worker had already taken when the high job's tasks were sent (between the send and
        # its commit of dispatched_at, a race of milliseconds with shards this short) is no
        # counter-example, so the order is judged from the first high start, not from the
        # high job's creation.
        first_high, last_high = (
            min(s.started_at for s in high_shards),
            max(s.started_at for s in high_shards),
        )
        starts = [(s.index, s.started_at) for s in low_shards]
        assert not [s for s in low_shards if first_high < s.started_at < last_high], starts
        # ...and low shards were still waiting then (first in, they would all have gone first).
        assert [s for s in low_shards if s.started_at > last_high], (
            "the low job ended before the high one started: nothing to order",
            starts,
        )

        # The worker's reconciler announces the high job's end (the low job has no webhook).
        _wait(workers, "no webhook arrived", lambda: receiver.received, timeout=60)
        ((headers, body),) = receiver.received
        assert verify(SECRET, headers["webhook-signature"], body)
        event = json.loads(body)
        assert (event["type"], event["data"]) == ("batch.completed", {"id": high.id})

        def attempts() -> list[tuple]:
            with session_scope(fleet_env.settings) as session:
                rows = session.query(WebhookAttempt).filter_by(job_id=high.id).all()
                return [(a.attempt, a.status_code, a.delivered) for a in rows]

        # The worker records the answer after the receiver has it: a fresh clone's make test
        # once read the attempt between the two, as (1, None, False).
        _wait(
            workers,
            "the delivery's answer to be recorded",
            lambda: any(code is not None for _, code, _ in attempts()),
        )
        assert attempts() == [(1, 200, True)]
        shown = fleet_env.cli("status", high.id)
        assert f"webhook    {receiver.url}: delivered" in shown.stdout, shown.stdout
    finally:
        stop_workers(workers)
        receiver.close()
