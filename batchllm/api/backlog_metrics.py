"""The fleet's backlog on `serve`'s /metrics, for autoscalers (a KEDA ScaledObject or an HPA on
an external metric, docker/k8s/): computed from the database and the worker registry at each
scrape, so every `serve` replica reports the same figures."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batchllm.settings import Settings
from batchllm.store.backlog import backlog_by_model
from batchllm.store.db import session_scope
from batchllm.worker.registry import served_models

log = logging.getLogger(__name__)

BACKLOG_ROWS = "batchllm_backlog_rows"
BACKLOG_SECONDS = "batchllm_backlog_seconds"
LIVE_WORKERS = "batchllm_live_workers"


class BacklogCollector(Collector):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = GaugeMetricFamily(
            BACKLOG_ROWS,
            "Rows of validating, queued and running jobs not yet done, per model.",
            labels=["model"],
        )
        seconds = GaugeMetricFamily(
            BACKLOG_SECONDS,
            "That backlog at the median rows/s of the model's 20 most recent completed jobs; "
            "for a model with none yet, at its running jobs' rate so far, or before any row of "
            "them is done at the median of the fleet's recent jobs of any model (absent only "
            "when no job has completed anywhere).",
            labels=["model"],
        )
        live = GaugeMetricFamily(
            LIVE_WORKERS, "Live worker processes serving the model.", labels=["model"]
        )
        try:
            with session_scope(self.settings) as session:
                backlog = backlog_by_model(session)
            served = served_models(self.settings.broker_url)
        except Exception:  # a scrape must not fail the server: the gauges are left out
            log.exception("the backlog gauges could not be read")
            return
        for model in sorted({*backlog, *served}):
            waiting = backlog.get(model)
            rows.add_metric([model], waiting.rows if waiting else 0)
            eta = waiting.seconds if waiting else 0.0
            if eta is not None:
                seconds.add_metric([model], eta)
            live.add_metric([model], served.get(model, 0))
        yield from (rows, seconds, live)


def backlog_registry(settings: Settings) -> CollectorRegistry:
    """A registry of its own per app: the process registry would refuse a second app's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BacklogCollector(settings))
    return registry
