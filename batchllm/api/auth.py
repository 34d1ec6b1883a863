"""Bearer API keys: every route needs one (unless the server runs with --no-auth); the key's id
is the tenant that owns what the request creates and the only one that sees it."""

from __future__ import annotations

import threading
import time

from fastapi import Request
from starlette.concurrency import run_in_threadpool

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
    owner = cached_owner(settings, authorization)
    if owner is None:
        with session_scope(settings) as session:
            owner = owner_of(session, key.strip())
        if owner is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        _KEYS.put(key.strip(), owner)
    return owner


def cached_owner(settings: Settings, authorization: str) -> str | None:
    """The owner of the header's key when it was looked up in the last
    BATCHLLM_API_KEY_CACHE_SECONDS, else None: no database, so the guard asks on the event
    loop and goes to a thread (owner_for) only when this does not know."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return _KEYS.get(key.strip(), settings.api_key_cache_seconds)


class _KeyCache:
    """Live keys looked up in the last BATCHLLM_API_KEY_CACHE_SECONDS: a client polling every
    second cost a database session per request for its key alone. Only live keys are kept
    (an unknown key is looked up each time: nothing a stranger sends grows this), and a
    revoked key is refused once its entry is older than the setting. Entries are keyed by the
    key itself, in this process's memory only."""

    _MOST = 10_000  # keys kept at once; past it the cache starts over

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[str, tuple[str, float]] = {}
        self.clock = time.monotonic

    def get(self, key: str, max_age: float) -> str | None:
        with self._lock:
            found = self._owners.get(key)
        if found is None or self.clock() - found[1] >= max_age:
            return None
        return found[0]

    def put(self, key: str, owner: str) -> None:
        with self._lock:
            if len(self._owners) >= self._MOST:
                self._owners.clear()
            self._owners[key] = (owner, self.clock())


_KEYS = _KeyCache()


async def current_owner(request: Request) -> str:
    """FastAPI dependency: the owner id of the request's key (checked by the RequestGuard
    before the body was read, batchllm/api/guard.py); 401 without a live key.

    A coroutine, so FastAPI calls it on the event loop: a plain function dependency is run on
    the request threads, a second hop to a thread for every request beside the route's own,
    to read a value the guard has already put in the scope."""
    if not request.app.state.auth:
        return LOCAL_OWNER
    checked = request.scope.get("state", {}).get("owner")
    if checked is not None:
        return str(checked)
    settings, authorization = request.app.state.settings, request.headers.get("authorization", "")
    return await run_in_threadpool(owner_for, settings, authorization)
