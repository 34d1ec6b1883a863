"""API keys of the Batch API server: created once (the key is shown then and never again),
stored as a SHA-256, revocable. Each key is a tenant: it sees only its own files and batches."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchllm.errors import BatchLLMError
from batchllm.jobs.models import ApiKey, utcnow

KEY_PREFIX = "sk-batchllm-"
# The owner of everything a server started with --no-auth creates.
LOCAL_OWNER = "local"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, name: str) -> tuple[ApiKey, str]:
    """A new key: its row and the key itself, which is not stored."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(id="key_" + secrets.token_hex(8), name=name, key_hash=_digest(key))
    session.add(row)
    session.flush()
    return row, key


def list_keys(session: Session) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at)))


def revoke_key(session: Session, ref: str) -> ApiKey:
    """Revoke a key by id or name; BatchLLMError when there is no such live key."""
    row = session.scalar(
        select(ApiKey).where((ApiKey.id == ref) | (ApiKey.name == ref), ApiKey.revoked_at.is_(None))
    )
    if row is None:
        raise BatchLLMError(f"no live API key with id or name {ref!r}")
    row.revoked_at = utcnow()
    return row


def owner_of(session: Session, key: str) -> str | None:
    """The id of the live key `key` is, or None (unknown or revoked)."""
    return session.scalar(
        select(ApiKey.id).where(ApiKey.key_hash == _digest(key), ApiKey.revoked_at.is_(None))
    )
