"""Webhook bookkeeping in SQL: which ended jobs still owe their receiver an event, the claim of
each attempt, and its outcome. The POST itself is execution/webhooks.py's.

A job with a `notify_url` owes one event once it ends (completed, failed, cancelled, expired).
Attempts are numbered 1, 2, ...; attempt n+1 is due `backoff(n)` after attempt n was written,
until one is delivered (a 2xx answer) or `max_attempts` were made.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from sqlalchemy import case, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from batchllm.errors import BatchLLMError
from batchllm.store.models import Batch, Job, WebhookAttempt, batch_id_of, utcnow
from batchllm.store.states import JobStatus

SECRET_PREFIX = "whsec_"
# An attempt written but never completed (its process died mid-POST) counts as failed.
_NO_OUTCOME = "no outcome recorded (the sender stopped during the request)"
EVENT_TYPES = {
    JobStatus.COMPLETED: "batch.completed",
    JobStatus.FAILED: "batch.failed",
    JobStatus.CANCELLED: "batch.cancelled",
    JobStatus.EXPIRED: "batch.expired",
}


@dataclass(frozen=True)
class WebhookTarget:
    """Where a job's end is announced and the secret that signs the POST."""

    url: str
    secret: str


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(24)


def check_url(url: str) -> str:
    """An http(s) URL with a host, or BatchLLMError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BatchLLMError(f"webhook URL {url!r}: must be http:// or https:// with a host")
    return url


@dataclass(frozen=True)
class DueDelivery:
    """One attempt to make now: the job, its event and the attempt number claimed."""

    job_id: str
    # What the event's `data.id` names: a Batch API batch's `batch_` id (what the receiver
    # retrieves, as on OpenAI), else the job id.
    subject_id: str
    url: str
    secret: str
    event: str
    finished_at: datetime
    attempt: int


def backoff(attempt: int, *, base_seconds: float, max_seconds: float) -> timedelta:
    """The wait after failed attempt `attempt` (1-based): base, 2 base, 4 base, ... capped."""
    return timedelta(seconds=min(base_seconds * 2 ** (attempt - 1), max_seconds))


def due_jobs(
    session: Session,
    *,
    base_seconds: float,
    max_seconds: float,
    max_attempts: int,
    job_id: str | None = None,
) -> list[tuple[str, int]]:
    """(job id, next attempt number) of ended jobs whose event is undelivered and due now."""
    attempts = (
        select(
            WebhookAttempt.job_id,
            func.count().label("made"),
            func.max(WebhookAttempt.created_at).label("last_at"),
            func.max(case((WebhookAttempt.delivered, 1), else_=0)).label("delivered"),
        )
        .group_by(WebhookAttempt.job_id)
        .subquery()
    )
    query = (
        select(Job.id, attempts.c.made, attempts.c.last_at, attempts.c.delivered)
        .outerjoin(attempts, attempts.c.job_id == Job.id)
        .where(Job.notify_url.is_not(None), Job.status.in_(list(EVENT_TYPES)))
    )
    if job_id is not None:
        query = query.where(Job.id == job_id)
    now = utcnow()
    due = []
    for found_id, made, last_at, delivered in session.execute(query):
        made = made or 0
        if delivered or made >= max_attempts:
            continue
        if (
            made
            and last_at + backoff(made, base_seconds=base_seconds, max_seconds=max_seconds) > now
        ):
            continue
        due.append((found_id, made + 1))
    return due


def claim_attempt(session: Session, job_id: str, attempt: int) -> DueDelivery | None:
    """Write attempt `attempt` of the job's event before sending it; None if another sender
    wrote it first (the (job, attempt) pair is unique)."""
    job = session.get(Job, job_id)
    if job is None or job.notify_url is None or job.status not in EVENT_TYPES:
        return None
    event = EVENT_TYPES[job.status]
    try:
        with session.begin_nested():
            session.add(
                WebhookAttempt(
                    job_id=job_id,
                    url=job.notify_url,
                    event=event,
                    attempt=attempt,
                    error=_NO_OUTCOME,
                )
            )
    except IntegrityError:
        return None
    is_batch = session.get(Batch, job_id) is not None
    return DueDelivery(
        job_id=job_id,
        subject_id=batch_id_of(job_id) if is_batch else job_id,
        url=job.notify_url,
        secret=job.notify_secret or "",
        event=event,
        finished_at=job.finished_at or utcnow(),
        attempt=attempt,
    )


def record_outcome(
    session: Session, job_id: str, attempt: int, *, status_code: int | None, error: str | None
) -> None:
    row = session.scalar(
        select(WebhookAttempt).where(
            WebhookAttempt.job_id == job_id, WebhookAttempt.attempt == attempt
        )
    )
    if row is None:
        return
    row.status_code = status_code
    row.error = error
    row.delivered = error is None and status_code is not None and 200 <= status_code < 300


def attempts_of(session: Session, job_id: str) -> list[WebhookAttempt]:
    return list(
        session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.job_id == job_id)
            .order_by(WebhookAttempt.attempt)
        )
    )
