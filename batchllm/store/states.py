"""Job and shard states: plain enums, free of SQLAlchemy, so the CLI can name them without
loading the database layer."""

from __future__ import annotations

import enum


class JobStatus(str, enum.Enum):
    """The OpenAI Batch API lifecycle."""

    VALIDATING = "validating"
    WAITING = "waiting"  # stored, held until the jobs it runs after complete (--after)
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its completion window passed first; finished rows are kept

    @property
    def is_final(self) -> bool:
        return self in (
            JobStatus.COMPLETED,
            JobStatus.FAILED,
            JobStatus.CANCELLED,
            JobStatus.EXPIRED,
        )


class ShardStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
