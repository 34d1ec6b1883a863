"""Who is looking at the dashboard: a login with an API key leaves a session cookie, and each
form carries a CSRF token.

The session cookie names the key and an expiry, signed with HMAC-SHA256 keyed by the key's
stored hash: no server secret to configure or share between `serve` processes, every request
checks that the key is still live (a revoked key's sessions end at once), and the key itself is
never stored in the browser. The cookie is HttpOnly (no script reads it) and SameSite=Strict
(another site's page cannot send it); the forms also carry a double-submit token, checked
against a second cookie, and a cross-site Origin is refused before anything is read.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request
from starlette.responses import Response

from batchllm.api.keys import LOCAL_OWNER, live_key
from batchllm.store.db import session_scope
from batchllm.store.models import ApiKey

SESSION_COOKIE = "batchllm_session"
CSRF_COOKIE = "batchllm_csrf"
SESSION_SECONDS = 12 * 3600
COOKIE_PATH = "/ui"


@dataclass(frozen=True)
class Viewer:
    """The key looking (its id is the owner of its batches); `admin` sees every job."""

    owner: str
    name: str
    admin: bool
    login: bool  # signed in with a key (False: a --no-auth server)


def _sign(row: ApiKey, payload: str) -> str:
    return hmac.new(row.key_hash.encode(), payload.encode(), hashlib.sha256).hexdigest()


def session_value(row: ApiKey, now: float | None = None) -> str:
    expires = int((now if now is not None else time.time()) + SESSION_SECONDS)
    payload = f"{row.id}.{expires}"
    return f"{payload}.{_sign(row, payload)}"


def login(request: Request, key: str) -> str | None:
    """The session cookie's value for a live key, or None."""
    with session_scope(request.app.state.settings) as session:
        row = live_key(session, key.strip())
        return session_value(row) if row is not None else None


def viewer_of(request: Request) -> Viewer | None:
    """The dashboard's viewer of this request, or None when it must log in."""
    state = request.app.state
    if not state.auth:
        return Viewer(owner=LOCAL_OWNER, name="local", admin=state.dashboard_sees_all, login=False)
    value = request.cookies.get(SESSION_COOKIE, "")
    key_id, _, rest = value.partition(".")
    expires, _, signature = rest.partition(".")
    if not key_id or not expires.isdigit() or int(expires) < time.time():
        return None
    with session_scope(state.settings) as session:
        row = session.get(ApiKey, key_id)
        if row is None or row.revoked_at is not None:
            return None
        if not hmac.compare_digest(signature, _sign(row, f"{key_id}.{expires}")):
            return None
        return Viewer(owner=row.id, name=row.name, admin=bool(row.admin), login=True)


def set_session(request: Request, response: Response, value: str | None) -> None:
    """Set (or with None, clear) the session cookie."""
    secure = request.url.scheme == "https"
    if value is None:
        response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, secure=secure, httponly=True)
        return
    response.set_cookie(
        SESSION_COOKIE,
        value,
        max_age=SESSION_SECONDS,
        path=COOKIE_PATH,
        secure=secure,
        httponly=True,
        samesite="strict",
    )


def csrf_token(request: Request) -> str:
    """The token the page's forms carry: the CSRF cookie's, or a new one (`ensure_csrf` sets
    it on the response)."""
    token = request.cookies.get(CSRF_COOKIE) or getattr(request.state, "new_csrf", None)
    if not token:
        token = request.state.new_csrf = secrets.token_urlsafe(24)
    return str(token)


def ensure_csrf(request: Request, response: Response) -> None:
    new = getattr(request.state, "new_csrf", None)
    if new and not request.cookies.get(CSRF_COOKIE):
        response.set_cookie(
            CSRF_COOKIE,
            new,
            path=COOKIE_PATH,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )


def csrf_ok(request: Request, submitted: str) -> bool:
    """A form POST is the dashboard's own: same-origin (when the browser says) and its token
    matches the cookie's."""
    origin = request.headers.get("origin")
    if origin and origin != "null":
        parts = urlsplit(origin)
        if parts.netloc != request.headers.get("host", ""):
            return False
    elif origin == "null":
        return False
    cookie = request.cookies.get(CSRF_COOKIE, "")
    return bool(cookie) and hmac.compare_digest(cookie, submitted)
