"""The dashboard of `batchllm serve` at /ui: jobs, one job's progress and throughput over
time, workers. Server-rendered templates, one stylesheet and one small script, all shipped in
the package (no CDN, no build step)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

from batchllm.api.dashboard.routes import _LoginNeeded, login_redirect, router

# The page loads only its own script and stylesheet; the progress bars' widths are inline
# styles. No other site may frame it (a framed Cancel button could be clicked by deceit).
_HEADERS = {
    "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount(
        "/ui/static", StaticFiles(directory=Path(__file__).parent / "static"), name="ui-static"
    )
    app.add_exception_handler(_LoginNeeded, login_redirect)

    @app.middleware("http")
    async def _secure_pages(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        if request.url.path.startswith("/ui"):
            response.headers.update(_HEADERS)
            response.headers.setdefault("cache-control", "no-store")
        return response
