"""SQLAlchemy 2.0 models: a Job, its Shards, and each shard's committed Checkpoints.

Request counts and token totals are only ever changed by SQL increments in the same transaction
that records a checkpoint, so they count each committed row exactly once, even with several
workers on PostgreSQL and redelivered shards.
"""

from __future__ import annotations

import enum
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    select,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from batchllm.store.states import JobStatus, ShardStatus


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp column that always reads back as an aware UTC datetime.

    Every moment is written in UTC (utcnow). PostgreSQL's `timestamptz` keeps the zone; SQLite
    has no zone and hands back naive datetimes, which Python refuses to compare with aware ones.
    The stored format is DateTime(timezone=True)'s, as the migrations create it: only what is
    read changes."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    pass


def _enum(kind: type[enum.Enum], name: str) -> Enum:
    # Stored by value ("in_progress"), not by member name, so SQL readers see the API's words.
    return Enum(
        kind,
        name=name,
        values_callable=lambda e: [m.value for m in e],
        native_enum=False,
        length=16,
    )


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        # The reconciler's webhook pass reads only the jobs that announce their end.
        Index(
            "ix_jobs_notified_status",
            "status",
            postgresql_where=text("notify_url IS NOT NULL"),
            sqlite_where=text("notify_url IS NOT NULL"),
        ),
        # The dashboard lists an admin's models one index step each, and a model's newest jobs
        # (a model alone, SQLite sorted every job of the model for a page).
        Index("ix_jobs_model_created_at", "model", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    status: Mapped[JobStatus] = mapped_column(_enum(JobStatus, "job_status"), index=True)
    model: Mapped[str] = mapped_column(String(512))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    job_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    input_file: Mapped[str] = mapped_column(Text)
    storage_root: Mapped[str] = mapped_column(Text)
    output_dir: Mapped[str] = mapped_column(Text)
    max_model_len: Mapped[int | None] = mapped_column(Integer)
    # Run by one `batchllm run` process, not the fleet: no reconciler re-drives its shards.
    local_run: Mapped[bool] = mapped_column(Boolean, default=False)
    # The end of its completion window (Batch API): the reconciler ends it `expired` then.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Where its end is announced (a signed POST, store/webhooks.py) and the secret that signs it.
    notify_url: Mapped[str | None] = mapped_column(Text)
    notify_secret: Mapped[str | None] = mapped_column(String(128))
    # Its runs, oldest first, once it was retried (`batchllm retry`; null before): {"attempt",
    # "lines", "all_errors", "status", "started_at", "finished_at", "wall_seconds"}.
    attempts: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)

    request_total: Mapped[int] = mapped_column(Integer, default=0)
    request_completed: Mapped[int] = mapped_column(Integer, default=0)
    request_failed: Mapped[int] = mapped_column(Integer, default=0)
    shards_total: Mapped[int] = mapped_column(Integer, default=0)
    shards_done: Mapped[int] = mapped_column(Integer, default=0)

    # Indexed: `batchllm jobs` lists the newest of a long history.
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # When it entered `cancelling` (a cancel asked for; not an expiry) and `finalizing`: a
    # Batch object's cancelling_at and finalizing_at.
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(Text)

    # Throughput. Counters add up from checkpoints; rates are computed when the job ends.
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # Prompt tokens vLLM served from its prefix cache, over every run of a row: a retry does
    # not take the replaced rows' hits off (no row records them), as a usage figure should.
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # A Batch API job's prompt tokens as estimated at create (api/token_limit.py): what its
    # key's enqueued-token limit reserves for it, released as its rows finish.
    prompt_tokens_estimate: Mapped[int | None] = mapped_column(BigInteger)
    engine_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    # Rows that ran under a structured output constraint, and those whose text satisfied it.
    structured_rows: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    structured_valid: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    wall_seconds: Mapped[float | None] = mapped_column(Float)
    requests_per_s: Mapped[float | None] = mapped_column(Float)
    output_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    total_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    hardware: Mapped[str | None] = mapped_column(String(256))
    vllm_version: Mapped[str | None] = mapped_column(String(64))

    shards: Mapped[list[Shard]] = relationship(
        back_populates="job", order_by="Shard.index", cascade="all, delete-orphan"
    )
    webhook_attempts: Mapped[list[WebhookAttempt]] = relationship(
        order_by="WebhookAttempt.attempt", cascade="all, delete-orphan"
    )
    parent_links: Mapped[list[JobParent]] = relationship(
        order_by="JobParent.parent_id", cascade="all, delete-orphan"
    )

    @property
    def attempt(self) -> int:
        """The number of its current (or last) run: 1, then one more per retry."""
        return len(self.attempts) if self.attempts else 1


class Shard(Base):
    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("job_id", "index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    # Indexed: the reconciler finds the few running and queued shards among every shard ever.
    status: Mapped[ShardStatus] = mapped_column(_enum(ShardStatus, "shard_status"), index=True)
    input_path: Mapped[str] = mapped_column(Text)
    rows: Mapped[int] = mapped_column(Integer)
    first_line: Mapped[int] = mapped_column(Integer)
    last_line: Mapped[int] = mapped_column(Integer)

    rows_ok: Mapped[int] = mapped_column(Integer, default=0)
    rows_failed: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    engine_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    next_seq: Mapped[int] = mapped_column(Integer, default=0)

    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Runs that failed with an error no row explains (execution/shard_failures.py): counted, the
    # last one's message in `error`; the shard is not run again before `retry_at` (backoff),
    # and its rows become error rows once BATCHLLM_MAX_SHARD_FAILURES runs have failed.
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    retry_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    worker: Mapped[str | None] = mapped_column(String(256))
    # Refreshed every second by the worker running the shard: a redelivered shard is taken over
    # only when its heartbeat is older than the lease, so a live worker is never doubled.
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # When a task for this shard was last sent to the broker: the reconciler looks for a
    # queued shard's task in the broker only once it had time to get there.
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(Text)

    job: Mapped[Job] = relationship(back_populates="shards")


class Checkpoint(Base):
    """One committed part file: its rows are done and must never be produced again."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("shard_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    rows: Mapped[int] = mapped_column(Integer)
    rows_ok: Mapped[int] = mapped_column(Integer)
    rows_failed: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    engine_seconds: Mapped[float] = mapped_column(Float)
    # The job's run that committed it (1: the first; a retry's rows replace only older runs').
    job_attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # Indexed: fair share sums each tenant's tokens served within a recent window of it.
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)


class ApiKey(Base):
    """A key of the Batch API server. Only its SHA-256 is stored: the key is shown once."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # An admin key sees every job in the dashboard, those of other keys and of `submit`/`run`.
    admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    # The key's batches announce their end here, signed with the key's webhook secret.
    webhook_url: Mapped[str | None] = mapped_column(Text)
    webhook_secret: Mapped[str | None] = mapped_column(String(128))
    # The key's own limit of enqueued prompt tokens per model (None: the server's
    # BATCHLLM_API_MAX_ENQUEUED_TOKENS), and its weight in the fair share of tokens served.
    enqueued_token_limit: Mapped[int | None] = mapped_column(BigInteger)
    share_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")


class DashboardSession(Base):
    """A dashboard login (api/dashboard/session.py). The browser holds a random token; only its
    SHA-256 is stored, so whoever reads the database cannot make a session of it, and logging
    out deletes the row: a replayed cookie finds nothing."""

    __tablename__ = "dashboard_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32), ForeignKey("api_keys.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)


class StoredFile(Base):
    """A file uploaded to the Batch API (`/v1/files`), or one it wrote (a batch's output and
    error files). `owner` is the API key's id that may see it."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner: Mapped[str] = mapped_column(String(32), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(Integer)
    lines: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


def _job_model(context: Any) -> str | None:
    """The model of the batch's job, for an insert that does not give it."""
    job_id = context.get_current_parameters()["job_id"]
    model: str | None = context.connection.scalar(select(Job.model).where(Job.id == job_id))
    return model


JOB_PREFIX = "job_"
# A Batch API batch is a job: its id is the job's with OpenAI's prefix (`batch_<hex>` for
# `job_<hex>`). A prefix mapping, not a stored column: no migration, every job made before it
# has its batch id too, and either id finds the job (the API shows `batch_`, the CLI `job_`).
BATCH_PREFIX = "batch_"


def batch_id_of(job_id: str) -> str:
    """The id the Batch API shows for the job `job_id` (`job_ab12` -> `batch_ab12`)."""
    return BATCH_PREFIX + job_id.removeprefix(JOB_PREFIX)


def job_id_of(ref: str) -> str:
    """The job id a batch id names (`batch_ab12` -> `job_ab12`); any other id unchanged (a job
    id, or one that names no job and is answered as unknown where it is looked up)."""
    if ref.startswith(BATCH_PREFIX):
        return JOB_PREFIX + ref.removeprefix(BATCH_PREFIX)
    return ref


class Batch(Base):
    """The Batch API's view of a job (same id): who owns it and its OpenAI fields."""

    __tablename__ = "batches"
    __table_args__ = (
        # GET /v1/batches and the dashboard page a key's newest batches.
        Index("ix_batches_owner_created_at", "owner", "created_at"),
        # The dashboard lists a key's models one index step each, however long its history,
        # and pages a key's newest batches of one model.
        Index("ix_batches_owner_model_created_at", "owner", "model", "created_at"),
    )

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    owner: Mapped[str] = mapped_column(String(32), index=True)
    # Its job's model (a job's never changes), beside the owner for that index: jobs have no
    # owner. Read from the job when an insert does not give it.
    model: Mapped[str] = mapped_column(String(512), default=_job_model)
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    input_file_id: Mapped[str] = mapped_column(String(40))
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    # Validation errors of the whole batch (e.g. lines naming other models), OpenAI's shape.
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    job: Mapped[Job] = relationship()

    @property
    def batch_id(self) -> str:
        """The id the Batch API shows (`batch_...`; `job_id` is the job's own)."""
        return batch_id_of(self.job_id)


class WebhookAttempt(Base):
    """One POST of a job's end event to its webhook URL. The row is written before the POST
    (the unique attempt number is the claim, so two reconcilers never send the same attempt)
    and completed with its outcome after."""

    __tablename__ = "webhook_attempts"
    __table_args__ = (UniqueConstraint("job_id", "attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(Text)
    event: Mapped[str] = mapped_column(String(32))
    attempt: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    delivered: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class JobParent(Base):
    """A job's parent: a job whose rows it reads (`--from`). Recorded when the child is
    created; the parent's id has no foreign key, so a child still names a parent that was
    deleted since."""

    __tablename__ = "job_parents"

    child_id: Mapped[str] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    # Indexed: `batchllm status PARENT` lists its children.
    parent_id: Mapped[str] = mapped_column(String(32), primary_key=True, index=True)
    kind: Mapped[str] = mapped_column(String(16), default="from", server_default="from")
