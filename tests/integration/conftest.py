"""Fixtures for the fleet tests: the real Redis and PostgreSQL on 127.0.0.1 and real
`batchllm worker` processes (the harness itself is tests/support/fleet.py).

Each test session gets a fresh PostgreSQL database and an empty Redis database of its own, so
sessions running side by side on one machine cannot take each other's shards. Worker log tails
are attached to a failing test's report.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import fleet
from tests.support.fleet import (
    WORKER_SETTINGS,
    FleetEnv,
    Worker,
    fleet_env_vars,
    settings_of,
    warm_workers,
)
from tests.support.services import postgres_database, redis_database
from tests.support.skips import require


@pytest.fixture(scope="session")
def fleet_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetEnv]:
    require(importlib.util.find_spec("vllm") is not None, "vllm is not installed")
    token = uuid.uuid4().hex[:12]
    with (
        redis_database(token) as (broker, broker_url),
        postgres_database(f"batchllm_it_{token}") as url,
    ):
        from batchllm.store.db import get_engine, upgrade

        upgrade(url)
        root = tmp_path_factory.mktemp("fleet")
        env = fleet_env_vars(
            root=root, database_url=url, broker_url=broker_url, worker_settings=WORKER_SETTINGS
        )
        settings = settings_of(env)
        try:
            yield FleetEnv(settings=settings, env=env, redis=broker)
        finally:
            get_engine(settings).dispose()


@pytest.fixture(scope="class")
def pair(fleet_env: FleetEnv, tiny_model: Path, tmp_path_factory) -> Iterator[list[Worker]]:
    """Two paced instant-engine workers serving the tiny model, alive for one test class."""
    work_dir = tmp_path_factory.mktemp("workers")
    with warm_workers(
        ["w1@test", "w2@test"], fleet_env=fleet_env, model=tiny_model, work_dir=work_dir
    ) as workers:
        yield workers


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for worker in list(fleet.running):
            report.sections.append((f"worker {worker.name} log (tail)", worker.tail()))
