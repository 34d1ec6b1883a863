"""A lock held to the end of the session's transaction, on SQLite and on PostgreSQL alike: what
a check-then-insert (a quota) takes before it counts, so two requests cannot both count the
same free slot.

SQLite: `BEGIN IMMEDIATE` takes the database's write lock before the count (pysqlite's own
BEGIN is deferred, and a plain SELECT runs outside any transaction, so two writers would count
in parallel and both insert). PostgreSQL: a transaction-scoped advisory lock on the name, which
also covers an owner without a row to lock (a --no-auth server's "local").
"""

from __future__ import annotations

import hashlib

from sqlalchemy import func, select
from sqlalchemy.orm import Session


def lock_name(session: Session, name: str) -> None:
    """Hold `name`'s lock until the session commits or rolls back. On SQLite it must be the
    session's first statement (it starts the transaction)."""
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        session.connection().exec_driver_sql("BEGIN IMMEDIATE")
    elif dialect == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(_lock_key(name))))
    else:
        raise NotImplementedError(f"no lock for the {dialect} database")


def _lock_key(name: str) -> int:
    # A signed 64-bit key, as pg_advisory_xact_lock(bigint) takes.
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
