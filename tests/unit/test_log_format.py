"""`--log-format json`: one JSON object per line, with the job and shard ids of the shard being
handled."""

from __future__ import annotations

import json
import logging

from batchllm.process.log_format import JsonFormatter, note_job, shard_context


def record(message: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("batchllm.execution.runner", level, __file__, 1, message, (), None)


def test_a_line_is_one_json_object_with_the_shard_and_job_it_is_about():
    formatter = JsonFormatter()
    outside = json.loads(formatter.format(record("idle")))
    with shard_context(17):
        before = json.loads(formatter.format(record("claimed")))
        note_job("job_abc")
        inside = json.loads(formatter.format(record("shard 17 done")))
    after = json.loads(formatter.format(record("idle again")))

    assert set(outside) == {"time", "level", "logger", "message"}
    assert outside["level"] == "WARNING" and outside["logger"] == "batchllm.execution.runner"
    assert before["shard_id"] == 17 and "job_id" not in before
    assert (inside["job_id"], inside["shard_id"], inside["message"]) == (
        "job_abc",
        17,
        "shard 17 done",
    )
    assert "job_id" not in after and "shard_id" not in after


def test_an_exception_is_kept_in_the_line():
    formatter = JsonFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = formatter.format(failed)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exception"]
