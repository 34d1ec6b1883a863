"""The FastAPI application of `batchllm serve`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from anyio import to_thread
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest
from starlette.concurrency import run_in_threadpool

from batchllm.api import batches_routes, dashboard, files_routes
from batchllm.api.backlog_metrics import backlog_registry
from batchllm.api.errors import install_handlers
from batchllm.api.guard import RequestGuard
from batchllm.api.served import ServedModels
from batchllm.heap import serving_heap
from batchllm.settings import Settings, get_settings
from batchllm.store import recovery
from batchllm.store.db import session_scope

log = logging.getLogger(__name__)

# GET /metrics: these, and prometheus_client's process metrics (CPU, memory, open files).
API_REQUESTS = Counter(
    "batchllm_api_requests",
    "HTTP requests to the Batch API, by method, route (the path template, e.g. "
    "/v1/batches/{batch_id}; 'unmatched' for unknown paths) and status code.",
    ("method", "route", "status"),
)
BATCHES_CREATED = Counter(
    "batchllm_api_batch_creations",
    "Batches created by POST /v1/batches (a batch refused for its lines is created failed and "
    "counted too).",
)
_CREATE_BATCH = ("POST", "/v1/batches")


class _CountRequests:
    """ASGI middleware counting requests by route template (never the raw path: ids in paths
    would make a series per batch)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception escaping the app becomes a 500

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"]
            API_REQUESTS.labels(method, route, str(status)).inc()
            if (method, route) == _CREATE_BATCH and status == 200:
                BATCHES_CREATED.inc()


def expire_due_batches(settings: Settings) -> None:
    with session_scope(settings) as session:
        ended = recovery.expire_jobs(session, settings.lease_seconds)
    for job_id in ended:
        log.warning("batch %s: its completion window passed; it expired", job_id)


def expire_periodically_in_thread(settings: Settings) -> threading.Thread:
    """The expiry round on a thread of its own (a daemon: it ends with the process), for a
    process that runs no app itself: `serve --workers N`'s parent."""

    def rounds() -> None:
        while True:
            time.sleep(settings.reconcile_seconds)
            try:
                expire_due_batches(settings)
            except Exception:  # the database away for a moment: the next round retries
                log.exception("expiring due batches failed")

    thread = threading.Thread(target=rounds, name="batchllm-expiry", daemon=True)
    thread.start()
    return thread


# `serve --workers N` hands uvicorn this factory by name: each worker process builds its app
# from the environment's settings and these options (JSON), which the parent sets.
WORKER_OPTIONS_ENV = "_BATCHLLM_SERVE_WORKER_OPTIONS"


def worker_app() -> FastAPI:
    """The app of one `serve --workers N` process."""
    options = json.loads(os.environ[WORKER_OPTIONS_ENV])
    return create_app(get_settings(), expire_batches=False, **options)


async def _expire_periodically(settings: Settings) -> None:
    # serve may run with no worker, and so no reconciler: batches still end on time.
    while True:
        await asyncio.sleep(settings.reconcile_seconds)
        try:
            await run_in_threadpool(expire_due_batches, settings)
        except Exception:  # the database away for a moment: the next round retries
            log.exception("expiring due batches failed")


def create_app(
    settings: Settings | None = None,
    *,
    auth: bool = True,
    require_served_model: bool = False,
    own_models: Sequence[str] = (),
    dashboard_sees_all: bool | None = None,
    expire_batches: bool = True,
) -> FastAPI:
    """The app; `require_served_model`: only models of live workers (and configured ones) are
    served, not those of workers gone since; `own_models`: the models of `serve --worker`,
    served before their worker announces them (api/served.py). `dashboard_sees_all`: a server
    without keys shows every job in its dashboard (default: when it has no keys; `serve` says
    so only when it listens on this machine).
    `expire_batches`: the app runs the expiry round itself (`serve --workers N` runs it once,
    in the parent process, instead of once per worker process)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # The routes run on this many threads (anyio's default is 40); serve sizes its
        # database pool to match (cli/serve.py), so no request waits for a connection.
        to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        task = asyncio.create_task(_expire_periodically(settings)) if expire_batches else None
        try:
            # So that a create's validation (input/shards.py's frozen_heap) does not freeze
            # and thaw the heap: each thaw left its request's reference cycles where only a
            # full collection finds them, and memory grew with every batch (batchllm/heap.py).
            with serving_heap():
                yield
        finally:
            if task is not None:
                task.cancel()

    app = FastAPI(title="batchllm Batch API", version="1", docs_url="/docs", lifespan=lifespan)
    app.state.settings = settings
    app.state.auth = auth
    app.state.served = ServedModels(settings, own=own_models, live_only=require_served_model)
    app.state.dashboard_sees_all = (not auth) if dashboard_sees_all is None else dashboard_sees_all
    install_handlers(app)
    # Middleware added last runs first: requests are counted, then guarded.
    app.add_middleware(RequestGuard, settings=settings, auth=auth)
    app.add_middleware(_CountRequests)
    app.include_router(files_routes.router)
    app.include_router(batches_routes.router)
    dashboard.install(app)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    backlog = backlog_registry(settings)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        """Prometheus metrics of this server process and the fleet's backlog (no API key:
        scrapers have none)."""
        text = generate_latest(REGISTRY) + generate_latest(backlog)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app
