"""Bearer API keys: every route needs one (unless the server runs with --no-auth); the key's id
is the tenant that owns what the request creates and the only one that sees it."""

from __future__ import annotations

from fastapi import Request

from batchllm.api.errors import ApiError
from batchllm.jobs.db import session_scope
from batchllm.jobs.keys import LOCAL_OWNER, owner_of


def current_owner(request: Request) -> str:
    """FastAPI dependency: the owner id of the request's key; 401 without a live key."""
    if not request.app.state.auth:
        return LOCAL_OWNER
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(
            401,
            "Missing API key: send `Authorization: Bearer KEY` (keys come from "
            "`batchllm keys create NAME`).",
            code="missing_api_key",
        )
    with session_scope(request.app.state.settings) as session:
        owner = owner_of(session, key.strip())
    if owner is None:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    return owner
