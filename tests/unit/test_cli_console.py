"""What the quiet consoles of `run` and `worker` let through, and `-v` reaching the processes
of `worker --concurrency N`. (tests/integration/test_worker_console.py runs a real worker.)"""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner

from batchllm.cli import cli
from batchllm.cli.console import own_warnings, worker_lines
from tests.support.cli import capture_supervised


def record(logger: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord(logger, level, __file__, 1, "a line", (), None)


@pytest.mark.parametrize(
    ("logger", "level", "shown"),
    [
        ("batchllm.execution.finalize", logging.INFO, True),
        ("batchllm.worker.tasks", logging.WARNING, True),
        ("batchllm", logging.DEBUG, True),
        ("celery.apps.worker", logging.INFO, True),  # `NODE ready.`
        ("celery.app.trace", logging.ERROR, True),  # a task that raised, with its traceback
        ("celery.redirected", logging.WARNING, False),  # print() of libraries, vLLM's too
        ("vllm.config.vllm", logging.WARNING, False),
        ("vllm", logging.ERROR, False),
        ("py.warnings", logging.WARNING, False),
        ("alembic.runtime.migration", logging.INFO, False),
        ("batchllmx", logging.INFO, False),
        ("celeryish", logging.INFO, False),
    ],
)
def test_the_worker_console_shows_batchllm_and_celery_lines_only(logger, level, shown):
    assert worker_lines(record(logger, level)) is shown


def test_the_run_console_shows_batchllm_warnings_only():
    assert own_warnings(record("batchllm.jobs.local", logging.WARNING))
    assert not own_warnings(record("batchllm.jobs.local", logging.INFO))
    assert not own_warnings(record("celery.apps.worker", logging.ERROR))
    assert not own_warnings(record("vllm.engine", logging.ERROR))


@pytest.mark.parametrize(("flags", "expected"), [([], []), (["-v"], ["-v"]), (["-vv"], ["-v"] * 2)])
def test_worker_processes_of_concurrency_n_get_the_verbosity(monkeypatch, flags, expected):
    for name in ("BATCHLLM_WORKER_MODELS", "BATCHLLM_LOG_FORMAT", "BATCHLLM_METRICS_PORT"):
        monkeypatch.setenv(name, "")  # so that what the command sets is removed afterwards
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")  # restored after `cli -v` changed it
    monkeypatch.setattr("batchllm.engine.hardware.runs_on_cpu", lambda: True)
    started = capture_supervised(monkeypatch)

    result = CliRunner().invoke(cli, [*flags, "worker", "-m", "tiny", "--concurrency", "2"])

    assert result.exit_code == 0, result.output
    assert len(started) == 2
    for argv in started:
        assert argv[argv.index("batchllm") + 1 : argv.index("worker")] == expected
