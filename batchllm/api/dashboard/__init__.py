"""The dashboard of `batchllm serve` at /ui: jobs, one job's progress and throughput over
time, workers. Server-rendered templates, one stylesheet and one small script, all shipped in
the package (no CDN, no build step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import MutableHeaders

from batchllm.api.dashboard.login_limit import LoginLimit
from batchllm.api.dashboard.routes import _LoginNeeded, login_redirect, router

# The page loads only its own script and stylesheet; the progress bars' widths are inline
# styles. No other site may frame it (a framed Cancel button could be clicked by deceit).
_HEADERS = {
    "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


class _PageHeaders:
    """ASGI middleware adding _HEADERS to the dashboard's responses; every other request
    (the API's uploads among them) passes through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/ui"):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in _HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


def install(app: FastAPI) -> None:
    settings = app.state.settings
    app.state.login_limit = LoginLimit(settings.api_login_max_failures, settings.api_login_window)
    app.include_router(router)
    app.mount(
        "/ui/static", StaticFiles(directory=Path(__file__).parent / "static"), name="ui-static"
    )
    app.add_exception_handler(_LoginNeeded, login_redirect)
    app.add_middleware(_PageHeaders)
