"""The FastAPI application of `batchllm serve`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest

from batchllm.api import batches_routes, files_routes
from batchllm.api.errors import install_handlers
from batchllm.settings import Settings, get_settings

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


def create_app(
    settings: Settings | None = None, *, auth: bool = True, require_served_model: bool = False
) -> FastAPI:
    app = FastAPI(title="batchllm Batch API", version="1", docs_url="/docs")
    app.state.settings = settings or get_settings()
    app.state.auth = auth
    app.state.require_served_model = require_served_model
    install_handlers(app)
    app.add_middleware(_CountRequests)
    app.include_router(files_routes.router)
    app.include_router(batches_routes.router)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        """Prometheus metrics of this server process (no API key: scrapers have none)."""
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app
