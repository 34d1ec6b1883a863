"""API keys of the Batch API server: created once (the key is shown then and never again),
stored as a SHA-256, revocable. Each key is a tenant: it sees only its own files and batches."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchllm.errors import BatchLLMError
from batchllm.store.models import ApiKey, utcnow
from batchllm.store.webhooks import WebhookTarget, check_url, new_secret

KEY_PREFIX = "sk-batchllm-"
# The owner of everything a server started with --no-auth creates.
LOCAL_OWNER = "local"
MAX_NAME = 128  # the column's length
_ID_PREFIX = "key_"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, name: str, *, admin: bool = False) -> tuple[ApiKey, str]:
    """A new key: its row and the key itself, which is not stored. BatchLLMError for a name
    that is not 1..MAX_NAME printable characters, or that starts like a key id. An `admin`
    key sees every job in the dashboard; through the API it is a tenant like any other."""
    _check_name(name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        id=_ID_PREFIX + secrets.token_hex(8), name=name, key_hash=_digest(key), admin=admin
    )
    session.add(row)
    session.flush()
    return row, key


def list_keys(session: Session) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at)))


def revoke_key(session: Session, ref: str) -> ApiKey:
    """Revoke the one live key with this id or name. BatchLLMError when there is none, or when
    several match (keys of one name, or a name equal to another key's id, from before names
    were checked): revoking a guess could leave the key meant running."""
    row = _live_key(session, ref, "revoke")
    row.revoked_at = utcnow()
    return row


def set_webhook(session: Session, ref: str, url: str | None) -> ApiKey:
    """Announce the end of the key's batches to `url` (None: no more webhooks). A new URL
    gets a new signing secret (`webhook_secret` of the row returned); batches created before
    keep the URL and secret they were created with."""
    row = _live_key(session, ref, "name it")
    row.webhook_url = check_url(url) if url is not None else None
    row.webhook_secret = new_secret() if url is not None else None
    return row


def set_limits(
    session: Session,
    ref: str,
    *,
    weight: float | None = None,
    enqueued_tokens: int | None = None,
    default_tokens: bool = False,
) -> ApiKey:
    """Set the key's weight in the fair share of tokens served (worker/fair_share.py: a key of
    weight 2 is served twice the tokens of a key of weight 1 while both have work queued)
    and its own limit of enqueued prompt tokens per model (`default_tokens`: back to the
    server's BATCHLLM_API_MAX_ENQUEUED_TOKENS). What is not given is left as it is."""
    if weight is not None and not 0 < weight <= 1000:
        raise BatchLLMError(f"a key's weight is over 0 and at most 1000, not {weight}")
    if enqueued_tokens is not None and enqueued_tokens < 1:
        raise BatchLLMError(f"an enqueued-token limit is at least 1, not {enqueued_tokens}")
    row = _live_key(session, ref, "set its limits")
    if weight is not None:
        row.share_weight = weight
    if enqueued_tokens is not None:
        row.enqueued_token_limit = enqueued_tokens
    elif default_tokens:
        row.enqueued_token_limit = None
    return row


def webhook_of(session: Session, owner: str) -> WebhookTarget | None:
    """The webhook of key `owner`'s batches, if it set one."""
    row = session.get(ApiKey, owner)
    if row is None or not row.webhook_url or not row.webhook_secret:
        return None
    return WebhookTarget(row.webhook_url, row.webhook_secret)


def _live_key(session: Session, ref: str, action: str) -> ApiKey:
    rows = session.scalars(
        select(ApiKey)
        .where((ApiKey.id == ref) | (ApiKey.name == ref), ApiKey.revoked_at.is_(None))
        .order_by(ApiKey.created_at)
    ).all()
    if not rows:
        raise BatchLLMError(f"no live API key with id or name {ref!r}")
    if len(rows) > 1:
        ids = ", ".join(row.id for row in rows)
        raise BatchLLMError(f"{len(rows)} live API keys match {ref!r} ({ids}); {action} by id")
    return rows[0]


def _check_name(name: str) -> None:
    # Names are shown in `keys list` and logs, and `keys revoke` takes a name or an id.
    if not 1 <= len(name) <= MAX_NAME:
        raise BatchLLMError(f"a key name has 1 to {MAX_NAME} characters, not {len(name)}")
    if not name.isprintable() or not name.strip():
        raise BatchLLMError(
            f"key name {name!r}: only printable characters (no control characters), not only spaces"
        )
    if name.startswith(_ID_PREFIX):
        raise BatchLLMError(
            f"key name {name!r}: must not start with {_ID_PREFIX!r}, as key ids do "
            "(`keys revoke` takes either)"
        )


def live_key(session: Session, key: str) -> ApiKey | None:
    """The live key row `key` is, or None (unknown or revoked)."""
    return session.scalar(
        select(ApiKey).where(ApiKey.key_hash == _digest(key), ApiKey.revoked_at.is_(None))
    )


def owner_of(session: Session, key: str) -> str | None:
    """The id of the live key `key` is, or None (unknown or revoked)."""
    return session.scalar(
        select(ApiKey.id).where(ApiKey.key_hash == _digest(key), ApiKey.revoked_at.is_(None))
    )
