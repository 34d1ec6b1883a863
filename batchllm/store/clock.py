"""The fleet's one clock for leases: the database's.

A lease is a comparison between two times: when a worker last heartbeat its shard and when
another worker looks. If each side read its own machine's clock, a worker whose clock is ahead by
more than a lease would see every live shard as abandoned and take them all over (a storm of
wasted runs), and one whose clock is behind would write heartbeats that look stale at once (its
shards taken from under it) or, ahead, keep a dead worker's shard leased for as long as its clock
is off. The chaos run's clock-step fault (benchmarks/chaos.py) steps one worker's clock. So on
PostgreSQL every lease time (heartbeats, claims, the stale cut-off, task dispatch times) is the
server's `statement_timestamp()`; on SQLite (one machine: every process reads the same clock)
it is the process's own, which is that clock.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchllm.store.models import utcnow


def lease_clock(session: Session) -> datetime:
    """Now, as an aware UTC datetime, by the clock every worker of this database shares."""
    if session.get_bind().dialect.name != "postgresql":
        return utcnow()
    now: datetime = session.execute(select(func.statement_timestamp())).scalar_one()
    return now.astimezone(timezone.utc)
