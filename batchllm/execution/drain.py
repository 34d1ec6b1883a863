"""A stop's drain (process/stopping.py says when one happens): the rows not yet
generating go back at once, those generating may finish until a deadline or a second stop."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from batchllm.engine.protocol import Engine
from batchllm.execution import metrics
from batchllm.process.stopping import StopRequest

log = logging.getLogger(__name__)


class _Owner(Protocol):
    """A shard's state as the drain sees it (execution/shard_state.py's ShardState)."""

    inflight: int
    rows_dropped: bool


Owner = TypeVar("Owner", bound=_Owner)


@dataclass(slots=True)
class Drain:
    """The rows generating when it began (and those not started, aborted at its start), when
    it began, and for how long at most."""

    in_flight: int
    unstarted: int
    started: float
    seconds: float

    def over(self, stop: StopRequest) -> bool:
        return stop.cut_short.is_set() or time.monotonic() - self.started >= self.seconds

    def ended(
        self, aborted: int, stop: StopRequest, model_metrics: metrics.ModelMetrics | None
    ) -> None:
        """Log (and count) how it ended: `aborted` rows were still generating."""
        saved = max(self.in_flight - aborted, 0)
        seconds = time.monotonic() - self.started
        why = (
            "all finished"
            if not aborted
            else "cut short"
            if stop.cut_short.is_set()
            else "deadline"
        )
        log.warning(
            "drain ended (%s) after %.1f s: %d of %d rows generating finished and are "
            "committed, %d aborted; with the %d not started, handed back",
            why,
            seconds,
            saved,
            self.in_flight,
            aborted,
            self.unstarted,
        )
        if model_metrics is not None:
            model_metrics.drained(saved, aborted, self.unstarted, seconds)


def start_drain(
    engine: Engine, pending: dict[str, tuple[Owner, Any, Any]], stop: StopRequest
) -> Drain | None:
    """The drain of a stop that allows one (rows in flight, drain seconds, no second stop yet),
    after aborting the rows not yet generating; None: stop now."""
    seconds = stop.drain_seconds
    if seconds <= 0 or not pending or stop.cut_short.is_set():
        return None
    unstarted = _abort_unstarted(engine, pending)
    log.warning(
        "stop requested: draining %d rows in flight for up to %.0f s (a second signal "
        "cuts it short), then committing and handing the rest back; %d rows not yet "
        "started go back now",
        len(pending),
        seconds,
        unstarted,
    )
    return Drain(len(pending), unstarted, time.monotonic(), seconds)


def _abort_unstarted(engine: Engine, pending: dict[str, tuple[Owner, Any, Any]]) -> int:
    """Abort the rows fed after the engine's first max_num_seqs in flight: the engine
    schedules first come, first served, so these have not started generating. Aborting
    them loses no work, and the drain then waits only for rows that can finish."""
    unstarted = list(pending)[engine.max_num_seqs :]
    if unstarted:
        engine.abort(unstarted)
        for request_id in unstarted:
            owner, _, _ = pending.pop(request_id)
            owner.inflight -= 1
            owner.rows_dropped = True
    return len(unstarted)
