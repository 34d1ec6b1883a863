"""The dashboard's parts that need no browser or fleet: the login and its cookie, CSRF, who sees
which job, the chart's series from checkpoints, and when a worker counts as silent (SQLite,
the in-memory broker, FastAPI's TestClient). The browser tests are in
tests/integration/test_dashboard_browser.py."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest
from fastapi.testclient import TestClient

from batchllm.api.app import create_app
from batchllm.api.dashboard.chart import chart_svg
from batchllm.api.dashboard.format import seconds
from batchllm.api.dashboard.queries import series, worker_rows
from batchllm.api.keys import create_key, revoke_key
from batchllm.store.db import get_engine, session_scope
from batchllm.store.models import Batch, Checkpoint, Job, Shard
from batchllm.store.states import JobStatus, ShardStatus

START = datetime(2026, 12, 1, 10, 0, tzinfo=timezone.utc)


@pytest.fixture
def app(settings, monkeypatch):
    monkeypatch.setenv("BATCHLLM_BROKER_URL", "memory://")
    get_engine(settings)
    return create_app(settings)


def add_job(settings, job_id: str, *, owner: str | None, status=JobStatus.IN_PROGRESS) -> None:
    with session_scope(settings) as session:
        job = Job(
            id=job_id,
            status=status,
            model="m",
            spec={},
            input_file="in.jsonl",
            storage_root=str(settings.resolved_storage),
            output_dir="out",
            request_total=100,
            request_completed=40,
            request_failed=2,
            created_at=START,
            started_at=START,
        )
        session.add(job)
        if owner is not None:
            session.add(
                Batch(
                    job_id=job_id,
                    owner=owner,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                    input_file_id="file-x",
                )
            )


def new_key(settings, name: str, *, admin: bool = False) -> tuple[str, str]:
    with session_scope(settings) as session:
        row, key = create_key(session, name, admin=admin)
        return row.id, key


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def log_in(client: TestClient, key: str):
    token = csrf_of(client.get("/ui/login").text)
    return client.post(
        "/ui/login", data={"csrf": token, "key": key, "next": "/ui"}, follow_redirects=False
    )


def test_the_root_leads_to_the_login_and_a_key_logs_in_with_a_strict_httponly_cookie(app, settings):
    client = TestClient(app)
    first = client.get("/", follow_redirects=False)
    assert (first.status_code, first.headers["location"]) == (307, "/ui")
    assert client.get("/ui", follow_redirects=False).headers["location"] == "/ui/login?next=%2Fui"
    _, key = new_key(settings, "alice")
    assert log_in(client, "sk-batchllm-wrong").status_code == 401
    done = log_in(client, key)
    assert (done.status_code, done.headers["location"]) == (303, "/ui")
    cookie = done.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert key not in cookie
    page = client.get("/ui")
    assert page.status_code == 200 and "alice" in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert client.get("/ui/static/dashboard.js").status_code == 200


def test_a_login_without_the_forms_token_or_from_another_origin_is_refused(app, settings):
    client = TestClient(app)
    _, key = new_key(settings, "alice")
    token = csrf_of(client.get("/ui/login").text)
    assert client.post("/ui/login", data={"csrf": "x", "key": key}).status_code == 403
    other_site = client.post(
        "/ui/login",
        data={"csrf": token, "key": key},
        headers={"origin": "https://evil.example"},
    )
    assert other_site.status_code == 403
    assert "batchllm_session" not in client.cookies


def test_a_revoked_keys_session_ends_and_a_forged_cookie_is_no_session(app, settings):
    client = TestClient(app)
    key_id, key = new_key(settings, "alice")
    log_in(client, key)
    assert client.get("/ui", follow_redirects=False).status_code == 200
    value = client.cookies["batchllm_session"]
    forged = value.rsplit(".", 1)[0] + "." + "0" * 64
    stranger = TestClient(app, cookies={"batchllm_session": forged})
    assert stranger.get("/ui", follow_redirects=False).status_code == 303
    with session_scope(settings) as session:
        revoke_key(session, key_id)
    assert client.get("/ui", follow_redirects=False).status_code == 303
    assert client.get("/ui?fragment=1").status_code == 401


def test_a_key_sees_its_own_batches_and_an_admin_every_job(app, settings):
    alice_id, alice = new_key(settings, "alice")
    bob_id, _ = new_key(settings, "bob")
    _, ops = new_key(settings, "ops", admin=True)
    add_job(settings, "job_alice", owner=alice_id)
    add_job(settings, "job_bob", owner=bob_id)
    add_job(settings, "job_submitted", owner=None)
    client = TestClient(app)
    log_in(client, alice)
    listed = client.get("/ui").text
    assert "job_alice" in listed and "job_bob" not in listed and "job_submitted" not in listed
    assert client.get("/ui/jobs/job_bob").status_code == 404
    assert client.get("/ui/jobs/job_alice").status_code == 200
    # The key's quotas as POST /v1/batches counts them: job_alice's 100 lines less its 42
    # done are enqueued, and it is the key's one unfinished batch (the defaults' limits).
    assert quota_of(listed) == ("58", "1,000,000", "1", "100")
    assert quota_of(client.get("/ui?fragment=1").text) == ("58", "1,000,000", "1", "100")
    admin = TestClient(app)
    log_in(admin, ops)
    listed = admin.get("/ui").text
    assert all(job in listed for job in ("job_alice", "job_bob", "job_submitted"))
    assert "42/100" in listed.replace("<b>", "").replace("</b>", "")
    assert quota_of(listed) == ("0", "1,000,000", "0", "100")  # its own key's: no batches


def test_the_jobs_page_shows_the_keys_enqueued_tokens_per_model_against_its_limit(app, settings):
    alice_id, alice = new_key(settings, "alice")
    add_job(settings, "job_alice", owner=alice_id)
    with session_scope(settings) as session:
        # 1,000 prompt tokens estimated, 42 of its 100 lines done: 580 still enqueued.
        session.get(Job, "job_alice").prompt_tokens_estimate = 1_000
    client = TestClient(app)
    log_in(client, alice)
    found = re.search(
        r'<b data-quota="enqueued-tokens" data-model="m">([\d,]+)</b> of ([\d,]+) prompt tokens '
        r"enqueued for m",
        client.get("/ui").text,
    )
    assert found and found.groups() == ("580", "1,000,000,000")


def quota_of(html: str) -> tuple[str, ...]:
    """(enqueued rows, their limit, unfinished batches, their limit) on the jobs page."""
    found = re.search(
        r'<b data-quota="enqueued-rows">([\d,]+)</b> of ([\d,]+) request lines enqueued'
        r' · <b data-quota="active-batches">([\d,]+)</b> of ([\d,]+) batches unfinished',
        html,
    )
    assert found, html
    return found.groups()


def test_no_auth_shows_every_job_only_to_a_local_dashboard(settings, monkeypatch):
    monkeypatch.setenv("BATCHLLM_BROKER_URL", "memory://")
    get_engine(settings)
    add_job(settings, "job_submitted", owner=None)
    local = TestClient(create_app(settings, auth=False, dashboard_sees_all=True))
    assert "job_submitted" in local.get("/ui").text
    exposed = TestClient(create_app(settings, auth=False, dashboard_sees_all=False))
    assert "job_submitted" not in exposed.get("/ui").text


def test_the_series_turns_checkpoint_commits_into_rates_over_time(settings):
    get_engine(settings)
    add_job(settings, "job_a", owner=None)
    with session_scope(settings) as session:
        shard = Shard(
            job_id="job_a",
            index=0,
            status=ShardStatus.RUNNING,
            input_path="p",
            rows=100,
            first_line=1,
            last_line=100,
        )
        session.add(shard)
        session.flush()
        for seq, at in enumerate((1, 3, 5, 7)):
            session.add(
                Checkpoint(
                    shard_id=shard.id,
                    seq=seq,
                    path=f"part-{seq}",
                    rows=10,
                    rows_ok=10,
                    rows_failed=0,
                    prompt_tokens=0,
                    completion_tokens=200,
                    engine_seconds=1.0,
                    created_at=START + timedelta(seconds=at),
                )
            )
    with session_scope(settings) as session:
        points = series(session, session.get(Job, "job_a"))
    # A point at least 2 s after the one before, each the average rate since it: never an
    # empty bucket between two commits.
    assert [p["t"] for p in points] == [3.0, 5.0, 7.0]
    assert [p["rows_per_s"] for p in points] == [6.667, 5.0, 5.0]
    assert points[1]["tokens_per_s"] == 100.0
    svg = chart_svg(points)
    assert svg.count('class="point rows"') == 3 and 'data-points="3"' in svg
    assert "no rows committed yet" in chart_svg([])


def test_a_worker_is_silent_when_its_shards_heartbeat_is_older_than_the_lease():
    shard = {
        "worker": "w1",
        "job_id": "job_a",
        "index": 0,
        "model": "m",
        "done": 50,
        "rows": 100,
        "attempts": 1,
        "started_at": 1000.0,
        "heartbeat_at": 1049.0,
    }
    registered = [{"node": "w1", "models": ["m"], "engine": None, "seen_at": 1045.0}]
    live = worker_rows(registered, [shard], now=1050.0, lease_seconds=10)
    assert [(w["node"], w["silent"], w["last_beat_age"]) for w in live] == [("w1", False, 1.0)]
    assert live[0]["rows_per_s"] == 1.0 and live[0]["engine_text"] == "per job"
    stale = worker_rows(registered, [shard], now=1070.0, lease_seconds=10)
    assert stale[0]["silent"]
    gone = worker_rows([], [{**shard, "worker": "w2"}], now=1050.0, lease_seconds=10)
    assert [(w["node"], w["silent"]) for w in gone] == [("w2", True)]
    idle = worker_rows(registered, [], now=1050.0, lease_seconds=10)
    assert not idle[0]["silent"] and idle[0]["rows_per_s"] is None


def test_durations_read_at_a_glance():
    assert [seconds(v) for v in (None, 42, 185, 7800)] == ["-", "42 s", "3 m 05 s", "2 h 10 m"]


def test_a_jobs_page_links_its_parents_and_children_that_the_viewer_may_open(app, settings):
    """Pipelines: `--from`/`--after` links on the job page, never naming another tenant's job."""
    from batchllm.store.models import JobParent

    alice_id, alice = new_key(settings, "alice")
    bob_id, _ = new_key(settings, "bob")
    _, ops = new_key(settings, "ops", admin=True)
    add_job(settings, "job_parent", owner=alice_id, status=JobStatus.COMPLETED)
    add_job(settings, "job_child", owner=alice_id)
    add_job(settings, "job_bobs_child", owner=bob_id)
    with session_scope(settings) as session:
        session.add(JobParent(child_id="job_child", parent_id="job_parent", kind="from"))
        session.add(JobParent(child_id="job_bobs_child", parent_id="job_parent", kind="after"))
    client = TestClient(app)
    log_in(client, alice)
    parent = client.get("/ui/jobs/job_parent").text
    assert '<a href="/ui/jobs/job_child">job_child</a>' in parent
    assert "job_bobs_child" not in parent
    child = client.get("/ui/jobs/job_child").text
    assert 'reads the rows of <a href="/ui/jobs/job_parent">job_parent</a>' in child
    admin = TestClient(app)
    log_in(admin, ops)
    assert '<a href="/ui/jobs/job_bobs_child">' in admin.get("/ui/jobs/job_parent").text
