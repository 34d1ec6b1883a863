"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the status
codes OpenAI uses, for every failure a route can meet (its own, FastAPI's validation)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    # A per-key limit (batches unfinished, bytes stored): OpenAI's type for a quota.
    429: "insufficient_quota",
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }


def not_found(kind: str, object_id: str) -> ApiError:
    # The same answer for another tenant's id as for a missing one: ids cannot be probed.
    return ApiError(404, f"No {kind} found with id '{object_id}'.", code="not_found")


def check_limit(limit: int, most: int) -> None:
    """A list route's `limit` query parameter: 1 to `most`."""
    if not 1 <= limit <= most:
        raise ApiError(400, f"limit: 1 to {most:,}", param="limit", code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg')}"
            for e in exc.errors()
        )
        return JSONResponse(error_body(400, message, param, "invalid_value"), 400)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, _exc: Exception) -> JSONResponse:
        # Anything else (the database or the broker unreachable, a bug): still OpenAI's shape,
        # which clients parse, and no internals in the message. Starlette logs the traceback.
        return JSONResponse(
            error_body(
                500,
                "The server had an error while processing your request.",
                None,
                "server_error",
            ),
            500,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (an unknown path, a malformed multipart body): a code too,
        # which clients switch on.
        code = _HTTP_CODES.get(exc.status_code)
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail), None, code), exc.status_code
        )


_HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}
