"""The dashboard's LOW findings of issue 33, against a real `batchllm serve`: page numbers SQL
cannot take, the CSRF token bound to the session, logout ending the session on the server, a
limit on failed logins, sessions no database reader can forge, workers' hosts hidden from
tenants, and control characters in a custom_id shown escaped."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from batchllm.api import keys
from batchllm.output.parts import OutputBuffer, part_name, part_of, write_table
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import ApiKey, Job, Shard, job_id_of, utcnow
from batchllm.store.states import JobStatus, ShardStatus
from tests.support.output_rows import record_part
from tests.support.serve import Served, post_batch, start_serve, stop_serve

pytestmark = pytest.mark.security

CHAT = "/v1/chat/completions"
SESSION = "batchllm_session"
LOGIN_FAILURES = 3


def _new_key(served: Served, name: str, *, admin: bool = False) -> tuple[str, str]:
    with session_scope(served.settings) as session:
        row, key = keys.create_key(session, name, admin=admin)
        return row.id, key


def _csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None, html[:500]
    return found.group(1)


def _try_login(client: httpx.Client, key: str) -> httpx.Response:
    token = _csrf_of(client.get("/ui/login").text)
    return client.post("/ui/login", data={"csrf": token, "key": key, "next": "/ui"})


@contextmanager
def _dashboard(served: Served, key: str) -> Iterator[httpx.Client]:
    """A browser logged in with `key`."""
    with httpx.Client(base_url=served.base_url, timeout=30) as client:
        done = _try_login(client, key)
        assert done.status_code == 303, done.text[:300]
        yield client


def _line(custom_id: str) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def _create_batch(served: Served, key: str, custom_ids: tuple[str, ...] = ("a",)) -> str:
    content = "".join(json.dumps(_line(c)) + "\n" for c in custom_ids).encode()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=served.base_url, headers=headers, timeout=60) as api:
        batch = post_batch(api, content, filename="in.jsonl")
        assert batch.status_code == 200, batch.text
        return job_id_of(batch.json()["id"])  # the dashboard shows jobs


def _status(served: Served, job_id: str) -> JobStatus:
    with session_scope(served.settings) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.status


@pytest.mark.parametrize(
    "page", ["9223372036854775807", "99999999999999999999999999", "-1", "0", "abc", "1e9", "٣"]
)
def test_any_page_number_shows_a_page_not_a_500(serve: Served, page: str) -> None:
    _, key = _new_key(serve, "pager")
    with _dashboard(serve, key) as client:
        response = client.get("/ui", params={"page": page})
        assert response.status_code == 200, response.text[:300]
        assert "page 1 of 1" in response.text
        assert client.get("/ui", params={"page": page, "fragment": 1}).status_code == 200


def test_a_forms_token_is_its_sessions_alone(serve: Served) -> None:
    _, bob = _new_key(serve, "bob")
    _, alice = _new_key(serve, "alice")
    job_id = _create_batch(serve, bob)
    cancel = f"/ui/jobs/{job_id}/cancel"
    with _dashboard(serve, bob) as client, _dashboard(serve, alice) as other:
        # A token and cookie pair of the attacker's choosing (a cookie set by a sibling
        # domain): it matched itself, and the form passed for any session.
        client.cookies.set("batchllm_csrf", "planted", domain="127.0.0.1", path="/ui")
        assert client.post(cancel, data={"csrf": "planted"}).status_code == 403
        # Another session's token.
        alices = _csrf_of(other.get("/ui").text)
        assert client.post(cancel, data={"csrf": alices}).status_code == 403
        assert _status(serve, job_id) is not JobStatus.CANCELLING
        assert _status(serve, job_id) is not JobStatus.CANCELLED
        # The session's own token, from its own page, works.
        del client.cookies["batchllm_csrf"]
        own = _csrf_of(client.get(f"/ui/jobs/{job_id}").text)
        done = client.post(cancel, data={"csrf": own})
        assert done.status_code == 303, done.text[:300]
        assert _status(serve, job_id) in (JobStatus.CANCELLING, JobStatus.CANCELLED)


def test_logout_ends_the_session_for_a_replayed_cookie(serve: Served) -> None:
    _, key = _new_key(serve, "leaver")
    with _dashboard(serve, key) as client:
        value = client.cookies[SESSION]
        token = _csrf_of(client.get("/ui").text)
        out = client.post("/ui/logout", data={"csrf": token})
        assert (out.status_code, out.headers["location"]) == (303, "/ui/login")
    with httpx.Client(base_url=serve.base_url, cookies={SESSION: value}, timeout=30) as replay:
        again = replay.get("/ui")
        assert again.status_code == 303, "the logged-out session still shows the dashboard"
        assert again.headers["location"].startswith("/ui/login")


def test_the_database_holds_nothing_to_make_an_admin_session_from(serve: Served) -> None:
    key_id, key = _new_key(serve, "ops", admin=True)
    with session_scope(serve.settings) as session:
        key_hash = session.scalar(select(ApiKey.key_hash).where(ApiKey.id == key_id))
    assert key_hash is not None
    # The cookie as it was made before: the key's id and an expiry, signed with the hash the
    # database stores.
    payload = f"{key_id}.{int(time.time()) + 3600}"
    forged = (
        f"{payload}.{hmac.new(key_hash.encode(), payload.encode(), hashlib.sha256).hexdigest()}"
    )
    with httpx.Client(base_url=serve.base_url, cookies={SESSION: forged}, timeout=30) as client:
        assert client.get("/ui").status_code == 303
    # A real session's cookie is stored only as a hash.
    with _dashboard(serve, key) as client:
        value = client.cookies[SESSION]
        assert client.get("/ui").status_code == 200
    database = b"".join(path.read_bytes() for path in Path(serve.settings.home).glob("*.db*"))
    assert database and value.encode() not in database


@pytest.fixture
def strict_login(tmp_path: Path) -> Iterator[Served]:
    served = start_serve(tmp_path, BATCHLLM_API_LOGIN_MAX_FAILURES=str(LOGIN_FAILURES))
    try:
        yield served
    finally:
        stop_serve(served)


def test_failed_logins_from_one_client_are_answered_429(strict_login: Served) -> None:
    _, key = _new_key(strict_login, "victim")
    with httpx.Client(base_url=strict_login.base_url, timeout=30) as client:
        for attempt in range(LOGIN_FAILURES):
            assert _try_login(client, f"sk-batchllm-guess{attempt}").status_code == 401
        refused = _try_login(client, "sk-batchllm-guess-again")
        assert refused.status_code == 429, refused.text[:300]
        assert int(refused.headers["retry-after"]) >= 1
        # Not even the right key is tried until the window has passed.
        assert _try_login(client, key).status_code == 429
        assert SESSION not in client.cookies


def test_workers_hosts_are_shown_to_an_admin_only(serve: Served) -> None:
    _, alice = _new_key(serve, "alice")
    _, bob = _new_key(serve, "bob")
    _, ops = _new_key(serve, "ops", admin=True)
    job_id = _create_batch(serve, alice)
    node = "celery@gpu-node-7.corp.internal"
    with session_scope(serve.settings) as session:
        shard = session.scalars(select(Shard).where(Shard.job_id == job_id)).first()
        assert shard is not None
        shard.status, shard.worker = ShardStatus.RUNNING, node
        shard.started_at = shard.heartbeat_at = utcnow()
    for key in (alice, bob):
        with _dashboard(serve, key) as client:
            page = client.get("/ui/workers")
            assert page.status_code == 200
            # The worker's name without its host.
            assert "gpu-node-7" not in page.text and 'data-worker="celery"' in page.text
    with _dashboard(serve, alice) as client:
        page = client.get(f"/ui/jobs/{job_id}")  # its shards' workers
        assert page.status_code == 200 and "gpu-node-7" not in page.text
    with _dashboard(serve, ops) as client:
        assert node in client.get("/ui/workers").text
        assert node in client.get(f"/ui/jobs/{job_id}").text


def test_control_characters_in_a_custom_id_are_shown_escaped(serve: Served) -> None:
    _, key = _new_key(serve, "tricky")
    tricky = ("ok\u202egnp.exe", "nul\x00here", "zero\u200bwidth")
    job_id = _create_batch(serve, key, tricky)
    # The rows a worker commits: the first answered, the others error rows.
    with session_scope(serve.settings) as session:
        job = session.get(Job, job_id)
        shard = session.scalars(select(Shard).where(Shard.job_id == job_id)).one()
        assert job is not None
        storage = Storage(job.storage_root)
        out_dir = storage.output_dir(job_id)
        shard_id, index = shard.id, shard.index
    buffer = OutputBuffer()
    buffer.answer(tricky[0], 1, "hello", "stop", 3, 1, None, None, None, None)
    buffer.failed(tricky[1], 2, "refused", "invalid_request")
    buffer.failed(tricky[2], 3, "refused", "invalid_request")
    part = part_of(buffer.take())
    path = write_table(storage, out_dir, part_name(index, 0), part.table)
    with session_scope(serve.settings) as session:
        record_part(
            session,
            job_id,
            shard_id,
            0,
            path,
            rows=(part.rows_ok, part.rows_failed),
            tokens=(part.prompt_tokens, part.completion_tokens),
            seconds=0.1,
        )
    with _dashboard(serve, key) as client:
        page = client.get(f"/ui/jobs/{job_id}")
    assert page.status_code == 200
    for raw in ("\u202e", "\x00", "\u200b", "&#0;"):
        assert raw not in page.text, f"{raw!r} in the page"
    for shown in (r"ok\u202egnp.exe", r"nul\u0000here", r"zero\u200bwidth"):
        assert shown in page.text, shown
