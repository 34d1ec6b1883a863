"""Logs for log shippers: `--log-format json` gives one JSON object per line with time, level,
logger, message, and the job and shard ids where the line is about one (set by `job_context`
around the handling of a shard)."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from collections.abc import Iterator
from datetime import datetime, timezone

_JOB: contextvars.ContextVar[str | None] = contextvars.ContextVar("batchllm_job", default=None)
_SHARD: contextvars.ContextVar[int | None] = contextvars.ContextVar("batchllm_shard", default=None)


@contextlib.contextmanager
def shard_context(shard_id: int) -> Iterator[None]:
    """Lines logged inside (by this thread) carry the shard id, and the job id once
    `note_job` names it."""
    job_token, shard_token = _JOB.set(None), _SHARD.set(shard_id)
    try:
        yield
    finally:
        _JOB.reset(job_token)
        _SHARD.reset(shard_token)


def note_job(job_id: str) -> None:
    """The job of the shard being handled (until its shard_context ends)."""
    _JOB.set(job_id)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        job_id, shard_id = _JOB.get(), _SHARD.get()
        if job_id is not None:
            entry["job_id"] = job_id
        if shard_id is not None:
            entry["shard_id"] = shard_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def use_json(logger: logging.Logger | None = None) -> None:
    """Every handler of `logger` (default: the root logger) writes JSON lines."""
    for handler in (logger or logging.getLogger()).handlers:
        handler.setFormatter(JsonFormatter())
