"""The machine's Redis and PostgreSQL, as the suites use them: a fresh PostgreSQL database and
an empty Redis database per use, so sessions running side by side on one machine never see
each other's rows or tasks. A service that is missing is a skip locally, a failure under CI
(tests/conftest.py's `require`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from tests.support.ports import HOST
from tests.support.skips import require

REDIS_PORT = 6379
POSTGRES_PORT = 5432
POSTGRES_USERS = ("root", "postgres")
_SESSION_MARK = "batchllm-integration-session"


@contextmanager
def postgres_database(name: str) -> Iterator[str]:
    """A fresh database on the local PostgreSQL, dropped afterwards; yields its URL."""
    try:
        import psycopg
    except ImportError as exc:
        require(False, f"psycopg is not installed: {exc}")
    errors = []
    for user in POSTGRES_USERS:
        try:
            admin = psycopg.connect(
                host=HOST,
                port=POSTGRES_PORT,
                user=user,
                dbname="test",
                autocommit=True,
                connect_timeout=3,
            )
            break
        except psycopg.Error as exc:
            errors.append(f"{user}: {exc}")
    else:
        require(
            False,
            f"PostgreSQL is not reachable at {HOST}:{POSTGRES_PORT} (database "
            f"`test`): " + "; ".join(errors),
        )
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql+psycopg://{user}@{HOST}:{POSTGRES_PORT}/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def redis_database(token: str) -> Iterator[tuple[redis.Redis, str]]:
    """An empty database on the local Redis, marked as ours so that a test session running
    beside this one picks another; flushed afterwards. Yields a client and its URL."""
    try:
        redis.Redis(host=HOST, port=REDIS_PORT, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        require(False, f"Redis is not reachable at {HOST}:{REDIS_PORT}: {exc}")
    for index in range(15, 0, -1):
        client = redis.Redis(host=HOST, port=REDIS_PORT, db=index, socket_connect_timeout=3)
        try:
            if client.dbsize() == 0 and client.set(_SESSION_MARK, token, nx=True):
                break
        except redis.ResponseError:  # the server has fewer databases
            continue
    else:
        require(False, f"no empty Redis database on {HOST}:{REDIS_PORT} for the fleet tests")
    try:
        yield client, f"redis://{HOST}:{REDIS_PORT}/{index}"
    finally:
        client.flushdb()
