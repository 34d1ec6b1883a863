"""Sending webhooks: a job's end as a signed POST, OpenAI's event shape, at least once.

The body is `{"id": "evt_<job id>", "object": "event", "type": "batch.completed", "created_at":
<unix seconds the job ended>, "data": {"id": "<batch id>"}}` (a Batch API batch's `batch_...` id;
a job submitted otherwise, its job id) (types batch.completed, batch.failed,
batch.cancelled, batch.expired). The headers `webhook-id` (the event id, the same on every
retry: receivers deduplicate on it), `webhook-timestamp` (unix seconds of this attempt) and
`webhook-signature: t=<timestamp>,v1=<hex HMAC-SHA256 of "<timestamp>.<body>" under the
secret>` let the receiver check that the POST is ours and recent.

Who sends: every worker's reconciler, each pass (so a process that died between the job's end
and the POST still gets it sent), and `batchllm run` right after its job ends. Each attempt is
claimed in SQL before it is sent (store/webhooks.py), so reconcilers never repeat an attempt;
a receiver's answer bounded by `webhook_timeout_seconds` keeps a slow one from holding a
reconciler.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.request

from batchllm.settings import Settings
from batchllm.store import webhooks
from batchllm.store.db import session_scope

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "webhook-signature"


def event_body(delivery: webhooks.DueDelivery) -> bytes:
    event = {
        "id": f"evt_{delivery.job_id}",
        "object": "event",
        "type": delivery.event,
        "created_at": int(delivery.finished_at.timestamp()),
        "data": {"id": delivery.subject_id},
    }
    return json.dumps(event, separators=(",", ":")).encode()


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value for `body` sent at `timestamp`."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify(secret: str, header: str, body: bytes, *, tolerance_seconds: float = 300) -> bool:
    """A receiver's check: the signature matches and its timestamp is recent (replays of an
    old POST are refused)."""
    parts = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs(time.time() - timestamp) > tolerance_seconds:
        return False
    expected = sign(secret, timestamp, body).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))


def post(delivery: webhooks.DueDelivery, timeout: float) -> tuple[int | None, str | None]:
    """POST the event once: (status code, error); a non-2xx answer is an error too."""
    body = event_body(delivery)
    timestamp = int(time.time())
    request = urllib.request.Request(
        delivery.url,
        data=body,
        method="POST",
        headers={
            "content-type": "application/json",
            "user-agent": "batchllm-webhooks",
            "webhook-id": f"evt_{delivery.job_id}",
            "webhook-timestamp": str(timestamp),
            SIGNATURE_HEADER: sign(delivery.secret, timestamp, body),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, None
    except urllib.error.HTTPError as exc:
        return exc.code, f"HTTP {exc.code}"
    except urllib.error.URLError as exc:  # its reason says what went wrong: refused, unresolved
        reason = exc.reason
        if isinstance(reason, BaseException):
            return None, f"{type(reason).__name__}: {reason}"
        return None, str(reason)
    except (OSError, ValueError) as exc:  # refused, timed out, unresolvable, bad URL
        return None, f"{type(exc).__name__}: {exc}"


def deliver_due(settings: Settings, *, job_id: str | None = None) -> list[str]:
    """Send every due webhook attempt (only `job_id`'s when given); returns the ids of the jobs
    whose event was delivered now."""
    with session_scope(settings) as session:
        due = webhooks.due_jobs(
            session,
            base_seconds=settings.webhook_retry_seconds,
            max_seconds=3600.0,
            max_attempts=settings.webhook_max_attempts,
            job_id=job_id,
        )
    delivered = []
    for due_job, attempt in due:
        with session_scope(settings) as session:
            claimed = webhooks.claim_attempt(session, due_job, attempt)
        if claimed is None:
            continue
        status_code, error = post(claimed, settings.webhook_timeout_seconds)
        with session_scope(settings) as session:
            webhooks.record_outcome(session, due_job, attempt, status_code=status_code, error=error)
        if error is None:
            delivered.append(due_job)
            log.info("job %s: %s delivered to %s", due_job, claimed.event, claimed.url)
        else:
            log.warning(
                "job %s: webhook attempt %d to %s failed (%s); retrying later",
                due_job,
                attempt,
                claimed.url,
                error,
            )
    return delivered


def deliver_soon(job_id: str, settings: Settings, *, within_seconds: float) -> bool:
    """`batchllm run`'s own delivery of its job's event: attempts as they fall due for up to
    `within_seconds`; True once delivered (otherwise a reconciler keeps trying)."""
    deadline = time.monotonic() + within_seconds
    while True:
        if deliver_due(settings, job_id=job_id):
            return True
        with session_scope(settings) as session:
            if not webhooks.due_jobs(
                session,
                base_seconds=0,
                max_seconds=0,
                max_attempts=settings.webhook_max_attempts,
                job_id=job_id,
            ):
                return False  # delivered by someone else, or out of attempts
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
