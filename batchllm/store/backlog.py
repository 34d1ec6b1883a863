"""The work waiting per model, as an autoscaler reads it (`serve`'s /metrics): rows of unfinished
jobs not yet done, and the rate they are estimated to run at."""

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
    rows_per_s: float | None  # the rate the backlog is estimated at (None: nothing to go by)
    # Where that rate comes from: "recent" (the model's completed jobs), "live" (its running
    # jobs so far: a first job), "fleet" (other models' completed jobs: a first job no worker
    # has started), or None.
    rate_source: str | None = None

    @property
    def seconds(self) -> float | None:
        """The backlog at that rate (None without a rate)."""
        if self.rows == 0:
            return 0.0
        return self.rows / self.rows_per_s if self.rows_per_s else None


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _recent_rates(session: Session, model: str | None) -> list[float]:
    """The rows/s of the most recent completed jobs, of one model or of any."""
    query = select(Job.requests_per_s).where(
        Job.status == JobStatus.COMPLETED, Job.requests_per_s.is_not(None)
    )
    if model is not None:
        query = query.where(Job.model == model)
    found = session.scalars(query.order_by(Job.created_at.desc()).limit(RECENT_JOBS))
    return [rate for rate in found if rate is not None]


def _live_rate(session: Session, model: str) -> float | None:
    """The rows/s the model's running jobs have reached so far (their rows done over the time
    since each started, summed: jobs that share the fleet each run at their share)."""
    now = utcnow()
    rate = 0.0
    for done, started in session.execute(
        select(Job.request_completed + Job.request_failed, Job.started_at).where(
            Job.model == model,
            Job.status == JobStatus.IN_PROGRESS,
            Job.started_at.is_not(None),
        )
    ):
        elapsed = (now - started).total_seconds() if started is not None else 0.0
        if done and elapsed > 0:
            rate += done / elapsed
    return rate or None


def backlog_by_model(session: Session) -> dict[str, ModelBacklog]:
    """Every model with unfinished work or a job in the last day. Two indexed queries and a
    few small ones per model: cheap to scrape every 15 s with any history.

    A model's first job has no completed job to take a rate from (an autoscaler scaling from
    zero needs one most): its running jobs' rate so far stands in, and before any row of it is
    done, the median rate of the fleet's recent jobs of any model."""
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
    fleet_rate: float | None = None
    backlog = {}
    for model in sorted({*waiting, *recent}):
        rows = max(int(waiting.get(model) or 0), 0)
        rate, source = _median(_recent_rates(session, model)), "recent"
        if rate is None and rows:
            rate, source = _live_rate(session, model), "live"
        if rate is None and rows:
            if fleet_rate is None:
                fleet_rate = _median(_recent_rates(session, None)) or 0.0
            rate, source = fleet_rate or None, "fleet"
        backlog[model] = ModelBacklog(rows, rate, source if rate is not None else None)
    return backlog
