"""Jobs that wait for other jobs (`submit --after JOB`): a child is validated and stored at
once, its shards recorded `queued`, and the job held `waiting`, which no worker takes work
from. Each reconciler pass (worker/reconciler.py) looks at the waiting jobs: one whose
parents all completed moves to `queued` and its shards' tasks go out; one with a parent that
failed, was cancelled or expired fails, naming that parent. Both moves are conditional
UPDATEs, so two reconcilers never release a job twice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchllm.errors import JobStateError
from batchllm.store import recovery, state_machine
from batchllm.store.models import Job, JobParent, JobStatus, Shard, ShardStatus

AFTER = "after"  # JobParent.kind of a dependency (`from`: a job whose rows are the input)


@dataclass
class Moved:
    """What one look at the waiting jobs did: jobs released with their shards to send (id,
    job spec), and jobs failed because of a parent."""

    released: list[str] = field(default_factory=list)
    shards: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def resolve_parents(session: Session, parents: list[str]) -> tuple[list[str], list[str]]:
    """These jobs (ids or unique prefixes) by their ids, and those of them a child must wait
    for; JobNotFound for one that does not exist, JobStateError for one that ended without
    completing (the child could never start)."""
    from batchllm.store.service import get_job

    resolved: list[str] = []
    waiting: list[str] = []
    for ref in parents:
        parent = get_job(session, ref)
        resolved.append(parent.id)
        if parent.status is JobStatus.COMPLETED:
            continue
        if parent.status.is_final:
            raise JobStateError(
                f"--after {parent.id}: the job {parent.status.value}"
                f"{': ' + parent.error if parent.error else ''}; a job after it would never start"
            )
        waiting.append(parent.id)
    return list(dict.fromkeys(resolved)), waiting


def move_waiting_jobs(session: Session) -> Moved:
    """Release the waiting jobs whose parents all completed; fail those with a parent that
    ended otherwise."""
    moved = Moved()
    for job_id in session.scalars(select(Job.id).where(Job.status == JobStatus.WAITING)):
        parents = session.execute(
            select(Job.id, Job.status, Job.error)
            .join(JobParent, JobParent.parent_id == Job.id)
            .where(JobParent.child_id == job_id, JobParent.kind == AFTER)
        ).all()
        ended_badly = [
            p for p in parents if p.status.is_final and p.status is not JobStatus.COMPLETED
        ]
        if ended_badly:
            parent = ended_badly[0]
            reason = f"parent job {parent.id} {parent.status.value}"
            if parent.error:
                reason += f": {parent.error}"
            if _fail_waiting(session, job_id, reason):
                moved.failed.append(job_id)
        elif all(p.status is JobStatus.COMPLETED for p in parents):
            shards = _release(session, job_id)
            if shards is not None:
                moved.released.append(job_id)
                moved.shards += shards
    return moved


def _release(session: Session, job_id: str) -> list[tuple[int, dict[str, Any]]] | None:
    """waiting -> queued, its queued shards marked dispatched (their tasks go out next);
    None if another reconciler released it first."""
    if not state_machine.release_waiting_job(session, job_id):
        return None
    rows = session.execute(
        select(Shard.id, Job.spec)
        .join(Job)
        .where(Shard.job_id == job_id, Shard.status == ShardStatus.QUEUED)
        .order_by(Shard.index)
    ).all()
    recovery.mark_dispatched(session, [row.id for row in rows])
    return [(row.id, row.spec) for row in rows]


def _fail_waiting(session: Session, job_id: str, reason: str) -> bool:
    return state_machine.fail_waiting_job(session, job_id, reason)
