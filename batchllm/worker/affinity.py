"""Which of a job's queued shards a free worker takes: shards are placed in prompt order
(input/shards.py), so a shared prefix that still spans shards is split between neighbours, and
the worker that ran a shard holds its prefixes in its prefix cache when it takes the next one.

A worker takes, in this order: (1) the shard after the one of the job it ran last, when that is
queued (affinity: its cache holds the prefixes that shard starts with); (2) the first shard of a
stretch of queued shards that no worker is heading into (its predecessor not running); (3) the
middle of the longest stretch, leaving its first half to the worker heading into it, as a work
stealer splits a range. So two workers on a 10-shard job run 0-4 and 5-9, one boundary shared
between them instead of nine. Affinity never idles a worker: while the job has a queued shard
that may run, every free worker gets one (as SGLang's and Ray Serve's prefix-aware routers fall
back to any worker).
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from batchllm.store.models import Shard, ShardStatus


def placed_shard(
    session: Session, job_id: str, ready: ColumnElement[bool], *, worker: str | None
) -> int | None:
    """The id of the queued shard of `job_id` (among those `ready` admits) that `worker` runs
    next, or None when none may run now."""
    queued = dict(
        session.execute(
            select(Shard.index, Shard.id).where(Shard.job_id == job_id, ready).order_by(Shard.index)
        ).all()
    )
    if not queued:
        return None
    if worker is not None:
        mine = session.scalar(
            select(Shard.index)
            .where(Shard.job_id == job_id, Shard.worker == worker, Shard.started_at.is_not(None))
            .order_by(Shard.started_at.desc())
            .limit(1)
        )
        if mine is not None and mine + 1 in queued:
            return queued[mine + 1]
    running = set(
        session.scalars(
            select(Shard.index).where(Shard.job_id == job_id, Shard.status == ShardStatus.RUNNING)
        )
    )
    return queued[_choose(sorted(queued), running)]


def _choose(queued: list[int], running: set[int]) -> int:
    """The index to take from the queued `queued` (sorted) when no affinity applies."""
    stretches: list[list[int]] = []
    for index in queued:
        if stretches and stretches[-1][-1] == index - 1:
            stretches[-1].append(index)
        else:
            stretches.append([index])
    for stretch in stretches:
        if stretch[0] - 1 not in running:  # nobody is heading into it
            return stretch[0]
    longest = max(stretches, key=len)
    return longest[len(longest) // 2]
