"""Bearer API keys: every route needs one (unless the server runs with --no-auth); the key's id
is the tenant that owns what the request creates and the only one that sees it."""

from __future__ import annotations

from fastapi import Request

from batchllm.api.errors import ApiError
from batchllm.api.keys import LOCAL_OWNER, owner_of
from batchllm.settings import Settings
from batchllm.store.db import session_scope


def owner_for(settings: Settings, authorization: str) -> str:
    """The owner id of the key an Authorization header carries; 401 without a live key."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(
            401,
            "Missing API key: send `Authorization: Bearer KEY` (keys come from "
            "`batchllm keys create NAME`).",
            code="missing_api_key",
        )
    with session_scope(settings) as session:
        owner = owner_of(session, key.strip())
    if owner is None:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    return owner


def current_owner(request: Request) -> str:
    """FastAPI dependency: the owner id of the request's key (checked by the RequestGuard
    before the body was read, batchllm/api/guard.py); 401 without a live key."""
    if not request.app.state.auth:
        return LOCAL_OWNER
    checked = request.scope.get("state", {}).get("owner")
    if checked is not None:
        return str(checked)
    return owner_for(request.app.state.settings, request.headers.get("authorization", ""))
