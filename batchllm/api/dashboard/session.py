"""Who is looking at the dashboard: a login with an API key starts a session kept on the
server, and each form carries a CSRF token bound to that session.

The session cookie holds a random token; the database holds only its SHA-256, with the key and
an expiry (dashboard_sessions). So whoever reads the database cannot make a session cookie (they
were signed with the key's stored hash before, which the database holds: any admin session could
be forged from it), logging out deletes the row (a replayed cookie finds nothing), and every
request checks that the key is still live (a revoked key's sessions end at once). The key itself
is never stored in the browser. The cookie is HttpOnly (no script reads it) and SameSite=Strict
(another site's page cannot send it). A logged-in page's forms carry HMAC(session token): a token
of that session alone. The login form, before any session, carries a double-submit token checked
against a second cookie; a cross-site Origin is refused before anything is read.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from fastapi import Request
from sqlalchemy import delete, select
from starlette.responses import Response

from batchllm.api.keys import LOCAL_OWNER, live_key
from batchllm.store.db import session_scope
from batchllm.store.models import ApiKey, DashboardSession, utcnow

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


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def login(request: Request, key: str) -> str | None:
    """A new session's token (the cookie's value) for a live key, or None."""
    with session_scope(request.app.state.settings) as db:
        row = live_key(db, key.strip())
        if row is None:
            return None
        now = utcnow()
        # Ended sessions go as new ones start: the table holds about the live ones.
        db.execute(delete(DashboardSession).where(DashboardSession.expires_at < now))
        token = secrets.token_urlsafe(32)
        db.add(
            DashboardSession(
                token_hash=_digest(token),
                key_id=row.id,
                created_at=now,
                expires_at=now + timedelta(seconds=SESSION_SECONDS),
            )
        )
        return token


def logout(request: Request) -> None:
    """End the request's session on the server: its cookie is no session any more."""
    token = request.cookies.get(SESSION_COOKIE)
    if not token or not request.app.state.auth:
        return
    with session_scope(request.app.state.settings) as db:
        db.execute(delete(DashboardSession).where(DashboardSession.token_hash == _digest(token)))


def viewer_of(request: Request) -> Viewer | None:
    """The dashboard's viewer of this request, or None when it must log in."""
    state = request.app.state
    if not state.auth:
        return Viewer(owner=LOCAL_OWNER, name="local", admin=state.dashboard_sees_all, login=False)
    token = request.cookies.get(SESSION_COOKIE, "")
    if not token:
        return None
    with session_scope(state.settings) as db:
        row = db.scalar(
            select(ApiKey)
            .join(DashboardSession, DashboardSession.key_id == ApiKey.id)
            .where(
                DashboardSession.token_hash == _digest(token),
                DashboardSession.expires_at > utcnow(),
                ApiKey.revoked_at.is_(None),
            )
        )
        if row is None:
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


def _session_csrf(request: Request) -> str | None:
    # Derived from the session's token, which only the browser holding the cookie has: a
    # token taken from another session (or set by another page) does not pass for this one.
    token = request.cookies.get(SESSION_COOKIE) if request.app.state.auth else None
    if not token:
        return None
    return hmac.new(token.encode(), b"batchllm-dashboard-csrf", hashlib.sha256).hexdigest()


def csrf_token(request: Request) -> str:
    """The token the page's forms carry: the session's, or before a login the CSRF cookie's,
    or a new one (`ensure_csrf` sets it on the response)."""
    bound = _session_csrf(request)
    if bound is not None:
        return bound
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
    is the session's (before a login: matches the CSRF cookie's)."""
    origin = request.headers.get("origin")
    if origin and origin != "null":
        parts = urlsplit(origin)
        if parts.netloc != request.headers.get("host", ""):
            return False
    elif origin == "null":
        return False
    expected = _session_csrf(request) or request.cookies.get(CSRF_COOKIE, "")
    # As bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500).
    return bool(expected) and hmac.compare_digest(
        expected.encode(), submitted.encode("utf-8", "replace")
    )
