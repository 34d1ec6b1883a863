"""The FastAPI application of `batchllm serve`."""

from __future__ import annotations

from fastapi import FastAPI

from batchllm.api import batches_routes, files_routes
from batchllm.api.errors import install_handlers
from batchllm.settings import Settings, get_settings


def create_app(
    settings: Settings | None = None, *, auth: bool = True, require_served_model: bool = False
) -> FastAPI:
    app = FastAPI(title="batchllm Batch API", version="1", docs_url="/docs")
    app.state.settings = settings or get_settings()
    app.state.auth = auth
    app.state.require_served_model = require_served_model
    install_handlers(app)
    app.include_router(files_routes.router)
    app.include_router(batches_routes.router)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
