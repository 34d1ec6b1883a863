"""Fixtures for the fault suite (tests/faults): the private Redis and PostgreSQL, the pools of
real worker processes (`pool`: paced instant engines, for the cases about orchestration;
`engine_pool`: vLLM engines, for the cases about the engine and its processes), the
recovery-time table printed at the end of the run, and worker and service log tails attached to
a failing test's report. The machinery itself is in tests/support/faults.py.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import faults as harness
from tests.support.faults import (
    WORKER_SETTINGS,
    FaultEnv,
    Pool,
    RedisServer,
    fault_postgres,
    postgres_bin,
    require_private_services,
    stop_all_workers,
)
from tests.support.fleet import INSTANT_ARGS, fleet_env_vars, settings_of, tail
from tests.support.skips import require


@pytest.fixture(scope="session")
def fault_env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultEnv]:
    require(importlib.util.find_spec("vllm") is not None, "vllm is not installed")
    require(importlib.util.find_spec("psycopg") is not None, "psycopg is not installed")
    bin_dir = require_private_services()

    work_dir = tmp_path_factory.mktemp("faults")
    redis_server = RedisServer(work_dir=work_dir)
    postgres = fault_postgres(bin_dir)
    atexit.register(harness.last_resort_cleanup, redis_server, postgres)
    try:
        redis_server.start()
        postgres.init()
        postgres.start()
        postgres.create_database()
        from batchllm.store.db import get_engine, upgrade

        upgrade(postgres.url)
        env = fleet_env_vars(
            root=work_dir,
            database_url=postgres.url,
            broker_url=redis_server.url,
            worker_settings=WORKER_SETTINGS,
        )
        settings = settings_of(env)
        yield FaultEnv(
            settings=settings,
            env=env,
            redis=redis_server,
            postgres=postgres,
            model=tiny_model,
            work_dir=work_dir,
        )
        get_engine(settings).dispose()
    finally:
        stop_all_workers()
        redis_server.stop()
        postgres.destroy()


# The fault cases catch a shard part-way (some rows committed, many to go) by polling the
# database: at one token per request every 50 ms, a 250-row shard of 24-80 tokens runs 1.2-4 s
# and commits its rows over ~3 s, whatever the machine's speed.
FAULT_INSTANT_ARGS = (*INSTANT_ARGS, "--instant-step-seconds", "0.05")


@pytest.fixture(scope="session")
def pool(fault_env: FaultEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """Paced instant-engine workers (ready in seconds), shared by the session's cases."""
    workers = Pool(
        fault_env,
        tmp_path_factory.mktemp("workers"),
        engine_args=FAULT_INSTANT_ARGS,
        label="faults",
    )
    try:
        yield workers
    finally:
        workers.stop_all()


@pytest.fixture(scope="session")
def engine_pool(fault_env: FaultEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """vLLM workers (an engine build each, 20-90 s), shared by the session's cases whose
    subject is the engine or its processes. Their engine core runs in a process of its own
    (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default and what a several-device engine always
    does), so that the engine can die while its worker lives: the case these tests are about.
    batchllm's own default runs a one-device engine's core in the worker's process
    (engine/start_settings.py), where the engine's death is the worker's, which
    TestWorkerLoss in test_fleet_faults.py covers."""
    workers = Pool(
        fault_env,
        tmp_path_factory.mktemp("engine-workers"),
        label="engine",
        extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    try:
        yield workers
    finally:
        workers.stop_all()


# -- recovery times ------------------------------------------------------------------------


@pytest.fixture
def recovery(record_property) -> Callable[..., None]:
    """record(what, seconds, note=""): one measured recovery time for the summary table."""

    def record(what: str, seconds: float | None, note: str = "") -> None:
        record_property("recovery", {"what": what, "seconds": seconds, "note": note})

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = []
    for key in ("passed", "failed", "error"):
        for report in terminalreporter.stats.get(key, []):
            if getattr(report, "when", None) != "call" and key != "error":
                continue
            for name, value in getattr(report, "user_properties", []):
                if name == "recovery":
                    test = report.nodeid.split("::")[-1]
                    rows.append((test, key, value))
    if not rows:
        return
    terminalreporter.section("fault recovery times")
    terminalreporter.write_line(f"{'test':<72} {'outcome':<7} {'measure':<44} {'seconds':>8}")
    for test, outcome, value in rows:
        seconds = value.get("seconds")
        shown = f"{seconds:8.1f}" if isinstance(seconds, (int, float)) else f"{'-':>8}"
        terminalreporter.write_line(
            f"{test[:72]:<72} {outcome:<7} {value['what'][:44]:<44} {shown}"
        )
        if value.get("note"):
            terminalreporter.write_line(f"{'':<81}{value['note']}")


# -- failure reports -----------------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
    if report.failed and f"{os.sep}faults{os.sep}" in str(item.fspath):
        for worker in list(harness.running_workers):
            report.sections.append((f"worker {worker.name} log (tail)", worker.tail()))
        env = item.funcargs.get("fault_env") if hasattr(item, "funcargs") else None
        if env is not None:
            report.sections.append(("redis log (tail)", tail(env.redis.log_path, 20)))
            report.sections.append(("postgres log (tail)", tail(env.postgres.log_path, 30)))
