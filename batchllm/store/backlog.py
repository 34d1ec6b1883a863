"""The work waiting per model, as an autoscaler reads it (`serve`'s /metrics): rows of unfinished
jobs not yet done, and the rate the model's recent jobs ran at."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchllm.store.models import Job, utcnow
from batchllm.store.state_machine import TAKING_WORK
from batchllm.store.states import JobStatus

# The jobs whose rate says how fast a model's fleet works: its most recent completed ones.
RECENT_JOBS = 20
# A model whose last job was created this long ago drops out of the gauges: it stays listed
# (at 0) a day after its backlog ends, so a scaler sees the fall to 0 rather than a gap.
LISTED_FOR = timedelta(days=1)


@dataclass(frozen=True)
class ModelBacklog:
    rows: int  # rows of validating, queued and running jobs not yet done
    rows_per_s: float | None  # the median rate of its recent completed jobs (None: none yet)

    @property
    def seconds(self) -> float | None:
        """The backlog at that rate (None without a rate)."""
        if self.rows == 0:
            return 0.0
        return self.rows / self.rows_per_s if self.rows_per_s else None


def backlog_by_model(session: Session) -> dict[str, ModelBacklog]:
    """Every model with unfinished work or a job in the last day. Two indexed queries and one
    small one per model: cheap to scrape every 15 s with any history."""
    waiting = dict(
        session.execute(
            select(
                Job.model,
                func.sum(Job.request_total - Job.request_completed - Job.request_failed),
            )
            .where(Job.status.in_(TAKING_WORK))
            .group_by(Job.model)
        ).all()
    )
    recent = session.scalars(
        select(Job.model).where(Job.created_at >= utcnow() - LISTED_FOR).distinct()
    ).all()
    backlog = {}
    for model in sorted({*waiting, *recent}):
        rates = sorted(
            rate
            for rate in session.scalars(
                select(Job.requests_per_s)
                .where(
                    Job.model == model,
                    Job.status == JobStatus.COMPLETED,
                    Job.requests_per_s.is_not(None),
                )
                .order_by(Job.created_at.desc())
                .limit(RECENT_JOBS)
            )
            if rate is not None
        )
        median = rates[len(rates) // 2] if rates else None
        backlog[model] = ModelBacklog(max(int(waiting.get(model) or 0), 0), median)
    return backlog
