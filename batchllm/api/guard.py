"""The first thing a request meets: past BATCHLLM_API_MAX_IN_FLIGHT requests in the server it is
shed (503, Retry-After), its key and its body size are checked before a byte of the body is
read, and the body has a deadline.

FastAPI reads an UploadFile or Form parameter (spooling it to temp files) before the route's
code and its dependencies run, so a key or size check there comes after the client's bytes were
taken: a gigabyte sent without a key would be written to disk first. This ASGI middleware runs
before that: a request without a live key is answered 401 unread, a declared Content-Length over
the limit 413 unread, and a body streamed (chunked) past the limit is cut off there, so the temp
space a refused upload takes is bounded by the limit, not by what the client sends.

Bodies have a deadline too (uvicorn has none, and api/http.py bounds only heads): a body must
arrive at BATCHLLM_API_MIN_BODY_RATE bytes a second after a grace of BATCHLLM_API_BODY_TIMEOUT
seconds, or it is answered 408 and its connection closed. Measured before: an upload sending a
byte every 2 s held its connection and file descriptor for as long as the client liked. The
dashboard's forms (the login needs no key) are small: their bodies have a limit of their own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from batchllm.api.auth import cached_owner, owner_for
from batchllm.api.errors import ApiError, error_body
from batchllm.settings import Settings

UPLOAD = ("POST", "/v1/files")
# Multipart framing around the uploaded file (boundaries, part headers, the purpose field).
FRAMING = 64 * 1024
# Every other body is a small JSON object (create batch): a megabyte is far over any of them.
OTHER_BODY_LIMIT = 1 << 20
# The dashboard's forms (an API key, a CSRF token, a path to return to): a few hundred bytes.
FORM_BODY_LIMIT = 16 * 1024
FORM_PATHS = "/ui"


class _Refused(Exception):
    """Raised out of `receive` to stop whatever is reading the body; it is answered with
    `error` instead."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


# Answered whatever the load: a liveness probe must not restart a server for being busy, and a
# scraper must see the overload.
NEVER_SHED = frozenset({"/health", "/metrics"})
RETRY_AFTER_SECONDS = 1
BODILESS = frozenset({"GET", "HEAD"})


class RequestGuard:
    def __init__(self, app: Any, *, settings: Settings, auth: bool) -> None:
        self.app = app
        self.settings = settings
        self.auth = auth
        # Requests past this guard and not yet answered. One event loop runs every request's
        # guard, so a plain count is exact.
        self.in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in NEVER_SHED:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.settings.api_max_in_flight:
            await _shed(self.in_flight, scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _guarded(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = Headers(scope=scope)
        if self.auth and scope["path"].startswith("/v1/"):
            authorization = headers.get("authorization", "")
            owner = cached_owner(self.settings, authorization)
            if owner is None:
                try:
                    owner = await run_in_threadpool(owner_for, self.settings, authorization)
                except ApiError as exc:
                    await _refuse(exc, scope, receive, send)
                    return
            # The route's dependency takes it from here instead of looking the key up again.
            scope.setdefault("state", {})["owner"] = owner
        if (
            scope["method"] in BODILESS
            and "content-length" not in headers
            and "transfer-encoding" not in headers
        ):
            # No route of these reads a body: nothing to cap or time (a poll's path, kept short).
            await self.app(scope, receive, send)
            return
        limit = self._body_limit(scope)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _refuse(self._too_large(scope), scope, receive, send)
            return
        await self._capped(scope, receive, send, limit)

    def _body_limit(self, scope: dict[str, Any]) -> int:
        if (scope["method"], scope["path"]) == UPLOAD:
            return self.settings.api_max_file_bytes + FRAMING
        if scope["path"].startswith(FORM_PATHS):
            return FORM_BODY_LIMIT
        return OTHER_BODY_LIMIT

    def _too_large(self, scope: dict[str, Any]) -> ApiError:
        if (scope["method"], scope["path"]) == UPLOAD:
            return ApiError(413, too_large(self.settings.api_max_file_bytes), code="file_too_large")
        return ApiError(
            413,
            f"the request body is over {self._body_limit(scope):,} bytes",
            code="request_too_large",
        )

    def _too_slow(self) -> ApiError:
        return ApiError(
            408,
            f"the request body came slower than {self.settings.api_min_body_rate:,} bytes a "
            f"second after {self.settings.api_body_timeout:g} s (BATCHLLM_API_MIN_BODY_RATE, "
            "BATCHLLM_API_BODY_TIMEOUT)",
            code="request_timeout",
        )

    async def _capped(self, scope: dict[str, Any], receive: Any, send: Any, limit: int) -> None:
        received = 0
        body_done = False
        refused: ApiError | None = None
        started = time.monotonic()
        grace, rate = self.settings.api_body_timeout, self.settings.api_min_body_rate

        async def capped_receive() -> dict[str, Any]:
            nonlocal received, body_done, refused
            if body_done:  # what a response waits for after the body: the client leaving
                return await receive()
            # The body may take the grace, and then as long as its bytes so far allow.
            left = started + grace + received / rate - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0.0))
            except asyncio.TimeoutError:
                refused = self._too_slow()
                raise _Refused(refused) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    refused = self._too_large(scope)
                    raise _Refused(refused)
            return message

        async def quiet_once_refused(message: dict[str, Any]) -> None:
            # FastAPI answers a body it could not finish reading with its own 400; the
            # refusal below replaces it.
            if refused is None:
                await send(message)

        try:
            await self.app(scope, capped_receive, quiet_once_refused)
        except Exception:
            if refused is None:
                raise
        if refused is not None:
            await _refuse(refused, scope, receive, send)


def too_large(limit: int) -> str:
    return f"the file is over the limit of {limit:,} bytes (BATCHLLM_API_MAX_FILE_BYTES)"


async def _shed(in_flight: int, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """503 with Retry-After, at once: more requests than BATCHLLM_API_MAX_IN_FLIGHT are in the
    server. A request with a body (unread) also closes its connection."""
    headers = {"retry-after": str(RETRY_AFTER_SECONDS)}
    if scope["method"] in ("POST", "PUT", "PATCH"):
        headers["connection"] = "close"
    message = (
        f"the server is busy ({in_flight} requests in flight, BATCHLLM_API_MAX_IN_FLIGHT): "
        f"retry after {RETRY_AFTER_SECONDS} s"
    )
    response = JSONResponse(
        error_body(503, message, None, "server_overloaded"), 503, headers=headers
    )
    await response(scope, receive, send)


async def _refuse(exc: ApiError, scope: dict[str, Any], receive: Any, send: Any) -> None:
    # The body may be unread: closing the connection after the answer keeps the server from
    # waiting on (or reading) the rest of it.
    response = JSONResponse(
        error_body(exc.status, exc.message, exc.param, exc.code),
        exc.status,
        headers={"connection": "close"},
    )
    await response(scope, receive, send)
