"""The dashboard (/ui) in a real browser: headless Chromium (Debian's package) driven by
Playwright, against a real `batchllm serve` with API keys and a real `batchllm worker` on the paced
instant engine (the pages are the subject, not generation), on conftest's isolated PostgreSQL
and Redis databases.

The tests look at what a person would: the batch's row and its progress appear and move without
a reload, the chart gains points as checkpoints commit, the job ends completed with its errors
grouped and its first rows shown, a cancel clicked on the page cancels the job, the worker is
shown live on its shard, and another key's job is nowhere to be seen. Screenshots go to the
test's tmp dir, and to docs/img/ (which the docs show) only with BATCHLLM_UPDATE_SCREENSHOTS=1:
a test run leaves the checkout as it found it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from batchllm.api import keys
from batchllm.store.db import session_scope
from batchllm.store.models import job_id_of
from batchllm.store.states import JobStatus
from tests.support import job_checks
from tests.support.fleet import PACED_INSTANT_ARGS, REPO, FleetEnv, Worker, stop_workers
from tests.support.serve import Server, post_batch
from tests.support.skips import require

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = REPO / "docs" / "img"
CHAT = "/v1/chat/completions"
# Long enough to watch, short enough for the suite: rows generate 16-48 tokens each on the
# paced instant engine (one token per request every 20 ms, 256 at a time), so 4,000 lines take
# about 16 s and 8,000 about 32 s whatever the machine's speed.
FOLLOWED_LINES = 4000
CANCELLED_LINES = 8000
SHARD_SIZE = "500"
TOO_LONG = 3  # lines whose prompt is over the worker's context: error rows, grouped
WORKER_NAME = "dash@test"
WORKER_SHOWN = "dash"  # as a key that is not an admin sees it: without its host


@dataclass
class Dashboard:
    fleet_env: FleetEnv
    server: Server
    worker: Worker
    model: str
    keys: dict[str, str]
    shots: Path

    def logs(self) -> str:
        return (
            f"\n--- serve log (tail) ---\n{self.server.tail()}"
            f"\n--- worker log (tail) ---\n{self.worker.tail()}"
        )

    def batch(self, key: str, lines: list[dict[str, Any]]) -> str:
        """Create a batch as the Batch API's clients do; its id (the job's)."""
        headers = {"Authorization": f"Bearer {self.keys[key]}"}
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        with httpx.Client(base_url=self.server.base_url, headers=headers, timeout=60) as http:
            batch = post_batch(http, content, content_type=None)
            assert batch.status_code == 200, batch.text
            return job_id_of(batch.json()["id"])  # the dashboard shows jobs

    def shoot(self, page: Any, name: str) -> None:
        path = self.shots / f"dashboard-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        if os.environ.get("BATCHLLM_UPDATE_SCREENSHOTS") == "1":
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, SCREENSHOTS / path.name)


def chat_lines(model: str, prefix: str, count: int, *, too_long: int = 0) -> list[dict[str, Any]]:
    lines = [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"{prefix}-{i}"}],
                "max_tokens": 16 + i % 33,
                "ignore_eos": True,
            },
        }
        for i in range(count)
    ]
    for i in range(too_long):  # far over the worker's 512-token context
        lines[100 + i]["body"]["messages"][0]["content"] = "word " * 2000
    return lines


@pytest.fixture(scope="module")
def dashboard(
    fleet_env: FleetEnv, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Dashboard]:
    require(CHROMIUM.exists(), f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        import playwright
    except ImportError as exc:
        require(False, f"playwright is not installed: {exc}")
    work = tmp_path_factory.mktemp("dashboard")
    shots = work / "screenshots"
    shots.mkdir()
    with session_scope(fleet_env.settings) as session:
        made = {
            name: keys.create_key(session, name, admin=name == "ops")[1]
            for name in ("alice", "bob", "ops")
        }
    env = fleet_env.worker_env(BATCHLLM_SHARD_SIZE=SHARD_SIZE, BATCHLLM_RECONCILE_SECONDS="2")
    worker = Worker(
        WORKER_NAME,
        model=tiny_model,
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0"},
        log_path=work / "worker.log",
        engine_args=PACED_INSTANT_ARGS,
    )
    # Configured, as a deployment whose batches may come before its worker announces it.
    served = {"BATCHLLM_SERVED_MODELS": json.dumps([str(tiny_model)])}
    server = Server({**env, **served}, work / "serve.log")
    try:
        server.wait_healthy()
        worker.wait_ready()
        yield Dashboard(fleet_env, server, worker, str(tiny_model), made, shots)
    finally:
        server.stop()
        stop_workers([worker])


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def logged_in(chromium: Any, dashboard: Dashboard, key: str) -> Any:
    """A page of a fresh browser context logged in with the key, through the login form."""
    context = chromium.new_context(
        base_url=dashboard.server.base_url, viewport={"width": 1280, "height": 900}
    )
    page = context.new_page()
    page.goto("/")
    assert page.url.endswith("/ui/login?next=%2Fui"), page.url  # / -> /ui -> the login
    page.fill("input[name=key]", dashboard.keys[key])
    page.click("button[type=submit]")
    page.wait_for_url("**/ui")
    return page


def wait_until(page: Any, script: str, arg: Any = None, timeout: float = 300) -> Any:
    """Poll the page's own DOM (which its script refreshes) until `script` is true."""
    return page.wait_for_function(script, arg=arg, timeout=timeout * 1000, polling=250)


def done_of(page: Any, selector: str) -> int:
    return int(page.get_attribute(f"{selector} .counts", "data-done"))


def test_a_key_follows_its_batch_from_submit_to_completion_with_the_chart_drawing(
    dashboard: Dashboard, chromium: Any
) -> None:
    page = logged_in(chromium, dashboard, "alice")
    cookie = next(c for c in page.context.cookies() if c["name"] == "batchllm_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    assert dashboard.keys["alice"] not in cookie["value"]

    job_id = dashboard.batch(
        "alice", chat_lines(dashboard.model, "followed", FOLLOWED_LINES, too_long=TOO_LONG)
    )
    row = f"tr[data-job='{job_id}']"
    # The jobs page refreshes itself: the new batch's row appears, then its count moves.
    page.wait_for_selector(row, timeout=60_000)
    wait_until(
        page,
        "s => { const c = document.querySelector(s + ' .counts');"
        " return c && +c.dataset.done > 0 && +c.dataset.done < +c.dataset.total; }",
        row,
    )
    first = done_of(page, row)
    wait_until(
        page, "([s, n]) => +document.querySelector(s + ' .counts').dataset.done > n", [row, first]
    )
    assert page.text_content(f"{row} .status") == "in_progress"
    dashboard.shoot(page, "jobs")

    page.click(f"{row} a")
    page.wait_for_url(f"**/ui/jobs/{job_id}")
    wait_until(page, "() => +document.querySelector('svg.chart').dataset.points >= 2")
    points = int(page.get_attribute("svg.chart", "data-points"))
    # The chart is redrawn as checkpoints commit, without a reload.
    wait_until(
        page,
        "n => { const c = document.querySelector('svg.chart');"
        " return +c.dataset.points > n || document.querySelector('#job').dataset.running === '0'; }",
        points,
    )
    assert page.locator("svg.chart circle.rows").count() >= 2
    assert page.locator("table.shards tbody tr[data-shard]").count() == FOLLOWED_LINES // 500
    assert WORKER_SHOWN in page.text_content("table.shards")
    assert WORKER_NAME not in page.text_content("table.shards")
    dashboard.shoot(page, "job-running")

    wait_until(page, "() => document.querySelector('#job').dataset.status === 'completed'")
    job, _ = job_checks.load_job(dashboard.fleet_env, job_id)
    assert job.status is JobStatus.COMPLETED, dashboard.logs()
    assert (job.request_completed, job.request_failed) == (FOLLOWED_LINES - TOO_LONG, TOO_LONG)
    counts = page.locator("#job > .progress .counts")
    assert counts.get_attribute("data-done") == str(FOLLOWED_LINES)
    assert f"{FOLLOWED_LINES - TOO_LONG:,} ok" in counts.text_content()
    assert f"{TOO_LONG} error" in counts.text_content()
    reason = page.locator("table.errors tr[data-reason]")
    assert reason.count() == 1
    assert reason.get_attribute("data-reason") == "context_length_exceeded"
    assert f"line {101}" in reason.text_content()  # lines count from 1
    assert page.locator("table.preview tbody tr").count() == 5
    assert "hardware" in page.text_content("dl.facts") and job.hardware in page.text_content(
        "dl.facts"
    )
    assert page.locator("#cancel").count() == 0 and page.locator("#retry").count() == 1
    assert int(page.get_attribute("svg.chart", "data-points")) >= 2
    dashboard.shoot(page, "job")
    # The browser's own timings of the page's refreshes, kept as an artifact (docs/dashboard.md
    # quotes them). How many there were depends on the machine's speed (two on a quiet one):
    # that the page redraws without a reload is what the waits above showed.
    refreshes = page.evaluate(
        "performance.getEntriesByType('resource')"
        ".filter(e => e.name.includes('fragment=1')).map(e => e.duration)"
    )
    (dashboard.shots.parent / "refresh-ms.json").write_text(json.dumps(refreshes))

    # The downloads, as the browser fetches them with the session cookie.
    parquet = page.request.get(f"/ui/jobs/{job_id}/download/output.parquet")
    assert parquet.ok
    table = pq.read_table(io.BytesIO(parquet.body()))
    assert table.num_rows == FOLLOWED_LINES
    assert table.column("status").to_pylist().count("ok") == FOLLOWED_LINES - TOO_LONG
    output = page.request.get(f"/ui/jobs/{job_id}/download/output.jsonl").text().splitlines()
    errors = page.request.get(f"/ui/jobs/{job_id}/download/errors.jsonl").text().splitlines()
    assert (len(output), len(errors)) == (FOLLOWED_LINES - TOO_LONG, TOO_LONG)
    series = page.request.get(f"/ui/jobs/{job_id}/series.json").json()
    assert series["status"] == "completed" and len(series["points"]) >= 2
    assert sum(p["rows_per_s"] for p in series["points"]) > 0
    page.context.close()


def test_a_cancel_from_the_job_page_cancels_the_running_job_and_the_worker_shows_its_shard(
    dashboard: Dashboard, chromium: Any
) -> None:
    page = logged_in(chromium, dashboard, "bob")
    job_id = dashboard.batch("bob", chat_lines(dashboard.model, "cancelled", CANCELLED_LINES))
    page.goto(f"/ui/jobs/{job_id}")
    wait_until(page, "() => +document.querySelector('#job > .progress .counts').dataset.done > 0")

    page.goto("/ui/workers")
    worker = page.locator(f"tr[data-worker='{WORKER_SHOWN}']")
    wait_until(
        page,
        "n => { const w = document.querySelector(`tr[data-worker='${n}']`);"
        " return w && w.querySelector('a') !== null; }",
        WORKER_SHOWN,
        timeout=60,
    )
    assert worker.get_attribute("data-state") == "live"
    assert dashboard.model in worker.text_content()
    assert job_id in worker.text_content() and "attempt 1" in worker.text_content()
    assert "ago" in worker.text_content()
    dashboard.shoot(page, "workers")

    page.goto(f"/ui/jobs/{job_id}")
    page.click("#cancel")
    page.wait_for_url(f"**/ui/jobs/{job_id}?message=*")
    wait_until(
        page, "() => document.querySelector('#job').dataset.status === 'cancelled'", timeout=120
    )
    job, _ = job_checks.load_job(dashboard.fleet_env, job_id)
    assert job.status is JobStatus.CANCELLED, dashboard.logs()
    assert 0 < job.request_completed < CANCELLED_LINES
    assert page.locator("#cancel").count() == 0
    dashboard.shoot(page, "job-cancelled")
    page.context.close()


def test_each_key_sees_only_its_own_jobs_and_an_admin_key_sees_every_job(
    dashboard: Dashboard, chromium: Any
) -> None:
    alices = dashboard.batch("alice", chat_lines(dashboard.model, "mine", 4))
    bobs = dashboard.batch("bob", chat_lines(dashboard.model, "theirs", 4))
    source = dashboard.shots.parent / "submitted.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"submitted {i}"}) + "\n" for i in range(4)))
    submitted = dashboard.fleet_env.submit(source, dashboard.model, shard_size=4, max_tokens=4).id

    alice = logged_in(chromium, dashboard, "alice")
    assert alice.locator(f"tr[data-job='{alices}']").count() == 1
    assert alice.locator(f"tr[data-job='{bobs}']").count() == 0
    assert alice.locator(f"tr[data-job='{submitted}']").count() == 0
    # Another key's job is not found, alike to one that does not exist; so are its data,
    # its downloads and its cancel.
    assert alice.goto(f"/ui/jobs/{bobs}").status == 404
    assert "No job" in alice.text_content("h1")
    assert alice.request.get(f"/ui/jobs/{bobs}/series.json").status == 404
    assert alice.request.get(f"/ui/jobs/{bobs}/download/output.parquet").status == 404
    alice.goto("/ui")
    token = alice.get_attribute("input[name=csrf]", "value")
    refused = alice.request.post(f"/ui/jobs/{bobs}/cancel", form={"csrf": token})
    assert refused.status == 404
    # A form posted without the page's token (as another site's page would) changes nothing.
    forged = alice.request.post(f"/ui/jobs/{alices}/cancel", form={"csrf": "guess"})
    assert forged.status == 403
    alice.context.close()

    ops = logged_in(chromium, dashboard, "ops")
    for job_id in (alices, bobs, submitted):
        assert ops.locator(f"tr[data-job='{job_id}']").count() == 1, job_id
    assert "all jobs" in ops.text_content("header")
    ops.select_option("select[name=status]", "cancelled")
    ops.click(".filters button")
    ops.wait_for_url("**/ui?status=cancelled*")
    statuses = ops.locator("tr[data-job]").evaluate_all("rows => rows.map(r => r.dataset.status)")
    assert statuses and set(statuses) == {"cancelled"}
    ops.context.close()

    anonymous = chromium.new_context(base_url=dashboard.server.base_url).new_page()
    anonymous.goto(f"/ui/jobs/{alices}")
    assert "/ui/login" in anonymous.url
    assert anonymous.request.get(f"/ui/jobs/{alices}/series.json").status == 401
    anonymous.context.close()
    for job_id in (alices, bobs, submitted):
        job_checks.wait_until_final(dashboard.fleet_env, job_id, timeout=120)
