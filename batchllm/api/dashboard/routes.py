"""The dashboard's pages under /ui: jobs, one job, workers, the login; server-rendered, with one
small script that refetches a page's live part every two seconds while something runs."""

from __future__ import annotations

import math
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pyarrow.parquet as pq
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from batchllm.api.dashboard import queries, session
from batchllm.api.dashboard.chart import chart_svg
from batchllm.api.dashboard.format import FILTERS
from batchllm.api.dashboard.login_limit import LoginLimit
from batchllm.api.dashboard.session import Viewer
from batchllm.errors import JobStateError
from batchllm.jobs.retry import retry_job
from batchllm.output import stream
from batchllm.output.openai_files import ERRORS_NAME, OUTPUT_NAME, export_openai
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.job_view import job_view
from batchllm.store.models import Batch, Job, batch_id_of, job_id_of
from batchllm.store.states import JobStatus
from batchllm.worker.registry import live_workers

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
templates.env.filters.update(FILTERS)
STATUSES = [status.value for status in JobStatus]


class _LoginNeeded(Exception):
    pass


def _viewer(request: Request) -> Viewer:
    viewer = session.viewer_of(request)
    if viewer is None:
        raise _LoginNeeded
    return viewer


def login_redirect(request: Request, exc: Exception) -> Response:
    """Pages send the browser to the login; the live parts and JSON answer 401."""
    if request.query_params.get("fragment") or request.url.path.endswith(".json"):
        return JSONResponse({"error": "log in again"}, status_code=401)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse("/ui/login?" + urlencode({"next": target}), status_code=303)


def _render(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
    context = {"viewer": None, "csrf": session.csrf_token(request), **context}
    response = templates.TemplateResponse(request, name, context, status_code=status)
    session.ensure_csrf(request, response)
    return response


def _page_or_fragment(
    request: Request, page: str, fragment: str, context: dict[str, Any]
) -> Response:
    return _render(request, fragment if request.query_params.get("fragment") else page, context)


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/ui", status_code=307)


@router.get("/ui/login")
def login_form(request: Request, next: str = "/ui") -> Response:
    return _render(request, "login.html", {"next": _safe_next(next), "error": None})


def _safe_next(target: str) -> str:
    # Only a path of the dashboard: a login must not bounce the browser to another site.
    return target if target.startswith("/ui") and not target.startswith("//") else "/ui"


@router.post("/ui/login")
async def login(request: Request) -> Response:
    form = await request.form()
    target = _safe_next(str(form.get("next", "/ui")))
    if not session.csrf_ok(request, str(form.get("csrf", ""))):
        return _render(
            request, "login.html", {"next": target, "error": "form expired: try again"}, 403
        )
    limit: LoginLimit = request.app.state.login_limit
    client = request.client.host if request.client else ""
    wait = limit.retry_after(client)
    if wait is not None:
        error = f"too many failed logins: try again in {math.ceil(wait)} s"
        response = _render(request, "login.html", {"next": target, "error": error}, 429)
        response.headers["retry-after"] = str(math.ceil(wait))
        return response
    value = await run_in_threadpool(session.login, request, str(form.get("key", "")))
    if value is None:
        limit.failed(client)
        return _render(
            request, "login.html", {"next": target, "error": "no live API key like that"}, 401
        )
    response = RedirectResponse(target, status_code=303)
    session.set_session(request, response, value)
    return response


@router.post("/ui/logout")
async def logout(request: Request) -> Response:
    form = await request.form()
    response = RedirectResponse("/ui/login", status_code=303)
    if session.csrf_ok(request, str(form.get("csrf", ""))):
        await run_in_threadpool(session.logout, request)
        session.set_session(request, response, None)
    return response


def _page_number(page: str) -> int:
    # Whatever a link or a hand-typed URL says: a page past the last shows the last
    # (job_page clamps it before SQL sees it), garbage or a negative number the first.
    if not (page.isascii() and page.isdigit()):
        return 1
    return int(page) if len(page) <= 18 else 10**18  # int() refuses over 4,300 digits


@router.get("/ui")
def jobs_page(request: Request, status: str = "", model: str = "", page: str = "1") -> Response:
    viewer = _viewer(request)
    status = status if status in STATUSES else ""
    settings = request.app.state.settings
    with session_scope(settings) as db:
        data = queries.job_page(db, viewer, status=status, model=model, page=_page_number(page))
        quota = queries.key_quota(db, viewer, settings)
    query = {k: v for k, v in (("status", status), ("model", model)) if v}
    context = {
        **data,
        "viewer": viewer,
        "statuses": STATUSES,
        "status": status,
        "model": model,
        "query": query,
        "quota": quota,
        "live_url": "/ui?" + urlencode({**query, "page": data["page"], "fragment": 1}),
    }
    return _page_or_fragment(request, "jobs.html", "jobs_live.html", context)


def _job_context(request: Request, viewer: Viewer, job_id: str) -> dict[str, Any] | None:
    settings = request.app.state.settings
    with session_scope(settings) as db:
        job = queries.visible_job(db, viewer, job_id)
        if job is None:
            return None
        view = job_view(job, shards=True)
        # Lineage links (--from, --after): only to jobs this viewer may open, so one tenant's
        # page never names another's jobs.
        view["lineage"] = {
            kind: [i for i in view[kind] if queries.visible_job(db, viewer, i) is not None]
            for kind in ("parents", "after", "children")
        }
        shards = queries.shards_of(job, datetime.now(timezone.utc))
        if not viewer.admin:  # the workers' hosts are the operator's to know
            shards = [{**shard, "worker": queries.node_name(shard["worker"])} for shard in shards]
        context = {
            "job": view,
            "summary": queries.job_summary(job),
            "shards": shards,
            "chart": chart_svg(queries.series(db, job)),
            "final": job.status.is_final,
            "local_run": job.local_run,
            "batch": db.get(Batch, job.id) is not None,
            "batch_id": batch_id_of(job.id),
        }
        db.expunge(job)
    preview, errors = queries.output_glance(settings, job)
    context.update(
        preview=preview,
        errors=errors,
        can_cancel=not context["final"],
        can_retry=context["final"]
        and not job.local_run
        and (job.request_failed > 0 or job.request_completed < job.request_total),
    )
    return context


def _not_found(request: Request, job_id: str, viewer: Viewer | None = None) -> Response:
    return _render(request, "missing.html", {"job_id": job_id, "viewer": viewer}, 404)


@router.get("/ui/jobs/{job_id}")
def job_page(request: Request, job_id: str, message: str = "") -> Response:
    if job_id_of(job_id) != job_id:  # a batch id, as the Batch API shows it: its job's page
        return RedirectResponse(f"/ui/jobs/{quote(job_id_of(job_id))}", status_code=307)
    viewer = _viewer(request)
    context = _job_context(request, viewer, job_id)
    if context is None:
        return _not_found(request, job_id, viewer)
    context.update(message=message, viewer=viewer)
    return _page_or_fragment(request, "job.html", "job_live.html", context)


@router.get("/ui/jobs/{job_id}/series.json")
def job_series(request: Request, job_id: str) -> Response:
    viewer = _viewer(request)
    with session_scope(request.app.state.settings) as db:
        job = queries.visible_job(db, viewer, job_id)
        if job is None:
            return JSONResponse({"error": f"no job {job_id}"}, status_code=404)
        return JSONResponse(
            {"job": job.id, "status": job.status.value, "points": queries.series(db, job)}
        )


async def _job_action(request: Request, job_id: str, act: Any) -> Response:
    job_id = job_id_of(job_id)  # a batch id names its job
    viewer = _viewer(request)
    form = await request.form()
    if not session.csrf_ok(request, str(form.get("csrf", ""))):
        return JSONResponse({"error": "cross-site or expired form"}, status_code=403)
    settings = request.app.state.settings
    with session_scope(settings) as db:
        if queries.visible_job(db, viewer, job_id) is None:
            return _not_found(request, job_id)
    try:
        message = await run_in_threadpool(act, settings, job_id)
    except JobStateError as exc:
        message = str(exc)
    return RedirectResponse(
        f"/ui/jobs/{job_id}?" + urlencode({"message": message}), status_code=303
    )


def _cancel(settings: Any, job_id: str) -> str:
    with session_scope(settings) as db:
        service.cancel_job(db, job_id, lease_seconds=settings.lease_seconds)
    return "cancel requested: running shards stop within a step"


def _retry(settings: Any, job_id: str) -> str:
    with session_scope(settings) as db:
        if db.get(Job, job_id).local_run:  # type: ignore[union-attr]
            raise JobStateError(
                "a `batchllm run` job is retried with `batchllm retry` where it ran"
            )
        batch = db.get(Batch, job_id)
        if batch is not None:  # its OpenAI files are written again when the retry ends
            batch.output_file_id = batch.error_file_id = None
    retry_job(job_id, settings=settings)
    return "retry queued"


@router.post("/ui/jobs/{job_id}/cancel")
async def cancel(request: Request, job_id: str) -> Response:
    return await _job_action(request, job_id, _cancel)


@router.post("/ui/jobs/{job_id}/retry")
async def retry(request: Request, job_id: str) -> Response:
    return await _job_action(request, job_id, _retry)


@router.get("/ui/jobs/{job_id}/download/{name}")
def download(request: Request, job_id: str, name: str) -> Response:
    """The job's committed rows as one Parquet file (readable while it runs), or, once it
    ended, its OpenAI batch output or error file."""
    viewer = _viewer(request)
    settings = request.app.state.settings
    with session_scope(settings) as db:
        job = queries.visible_job(db, viewer, job_id)
        if job is None or name not in ("output.parquet", OUTPUT_NAME, ERRORS_NAME):
            return _not_found(request, job_id)
        db.expunge(job)
    scratch = tempfile.TemporaryDirectory(prefix="batchllm-ui-")
    cleanup = BackgroundTask(scratch.cleanup)
    if name == "output.parquet":
        path = Path(scratch.name) / name
        writer = None
        for batch in stream.iter_committed_batches(settings, job.id):
            writer = writer or pq.ParquetWriter(path, batch.schema)
            writer.write_batch(batch)
        if writer is None:
            scratch.cleanup()
            return JSONResponse({"error": "no rows committed yet"}, status_code=404)
        writer.close()
    else:
        try:
            counts = export_openai(job, Path(scratch.name), settings=settings)
        except JobStateError as exc:
            scratch.cleanup()
            return JSONResponse({"error": str(exc)}, status_code=409)
        path = Path(counts.output_path if name == OUTPUT_NAME else counts.errors_path)
    return FileResponse(
        path, filename=f"{job.id}-{name}", background=cleanup, media_type=_media(name)
    )


def _media(name: str) -> str:
    return "application/vnd.apache.parquet" if name.endswith(".parquet") else "application/jsonl"


@router.get("/ui/workers")
def workers_page(request: Request) -> Response:
    viewer = _viewer(request)
    settings = request.app.state.settings
    try:
        registered, broker_error = live_workers(settings.broker_url), None
    except Exception as exc:  # the broker is away: the page says so and shows the shards
        registered, broker_error = [], str(exc)
    with session_scope(settings) as db:
        shards = queries.running_shards(db)
        visible = {
            job_id
            for job_id in db.scalars(
                queries.visible_jobs(viewer)
                .with_only_columns(Job.id)
                .where(Job.id.in_({s["job_id"] for s in shards}))
            )
        }
    for shard in shards:
        shard["visible"] = shard["job_id"] in visible
    rows = queries.worker_rows(
        registered, shards, now=time.time(), lease_seconds=settings.lease_seconds
    )
    if not viewer.admin:  # the workers' hosts are the operator's to know
        rows = queries.without_hosts(rows)
        # The broker's error names its address.
        broker_error = broker_error and "the broker is unreachable"
    context = {"workers": rows, "broker_error": broker_error, "viewer": viewer}
    return _page_or_fragment(request, "workers.html", "workers_live.html", context)
