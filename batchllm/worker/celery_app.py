"""The Celery application: Redis broker, one queue per model, settings for long GPU tasks.

Tasks carry only a shard id; all state lives in the database, so a task is idempotent and a
redelivered one resumes from the shard's checkpoints.
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Any

from celery import Celery
from celery.signals import worker_init

from batchllm.settings import Settings
from batchllm.spec import JobSpec

TASK_RUN_SHARD = "batchllm.run_shard"


def queue_for_model(model: str) -> str:
    """The queue of a model's plain generation jobs. Shards are routed by model, so a worker
    never receives a shard of a model it does not serve, and a job for a model no worker
    serves waits without blocking anything else.

    The name is exact: a readable part (the name's characters other than letters, digits and
    `_.-` replaced, for operators) and a digest of the whole name as given, so two names that
    differ in any character ("models_tiny" and "/models/tiny") never share a queue."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", model.strip("/"))[-120:]
    digest = hashlib.sha256(model.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"batchllm.{readable}#{digest}"


# Jobs that need an engine built for them go to a queue of their kind: only workers whose
# engine serves it consume it, so a LoRA or embedding job never lands on a worker that would
# have to rebuild its engine (or refuse it) - it waits for one that can run it.
_KIND_SUFFIXES = {"lora": ".lora", "embed": ".embed", "classify": ".classify"}


def job_kind(spec: JobSpec) -> str:
    """generate, lora, embed or classify: the kind of engine a job's shards need."""
    if spec.engine.task in ("embed", "classify"):
        return spec.engine.task
    return "lora" if spec.engine.enable_lora else "generate"


def queue_for_job(spec: JobSpec) -> str:
    return queue_for_model(spec.model) + _KIND_SUFFIXES.get(job_kind(spec), "")


def queue_for_stored_spec(spec: dict) -> str:
    """The queue of a job whose spec is the database's JSON."""
    return queue_for_job(JobSpec.model_validate(spec))


def worker_queues(model: str, *, task: str, enable_lora: bool, allow_rebuild: bool) -> list[str]:
    """The queues a worker consumes: the kinds of job its engine serves (a LoRA engine serves
    plain jobs too); every kind when it may rebuild its engine for a job."""
    base = queue_for_model(model)
    if allow_rebuild:
        return [base, *(base + suffix for suffix in _KIND_SUFFIXES.values())]
    if task in ("embed", "classify"):
        return [base + _KIND_SUFFIXES[task]]
    return [base, base + _KIND_SUFFIXES["lora"]] if enable_lora else [base]


def create_app(settings: Settings) -> Celery:
    app = Celery("batchllm", broker=settings.broker_url, include=["batchllm.worker.tasks"])
    app.conf.update(
        # A shard is acknowledged only after it ran; a worker that dies leaves it in the broker.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # One shard at a time per worker process: a prefetched shard would wait behind a long one.
        worker_prefetch_multiplier=1,
        # Redis redelivers an unacknowledged task after this; it must exceed the longest shard.
        # (A redelivery while the first worker still runs is refused by the shard's heartbeat.)
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        # A broker restart must never end a worker: reconnect for as long as it takes (Celery
        # logs each attempt). The default gives up after 100 attempts and the worker exits.
        broker_connection_max_retries=None,
        worker_hijack_root_logger=False,
        task_default_queue="batchllm.default",
    )
    return app


_senders: dict[tuple[str, int], Celery] = {}
_senders_lock = threading.Lock()


def sender_app(settings: Settings) -> Celery:
    """The process's one Celery app for sending tasks to `settings`' broker, made on first use.

    Every front door that sends (serve, submit, the Client, pipelines, the reconciler) shares
    it with its producer pool. A new app per send leaked: kombu's Redis transport opens an
    epoll for each app's event poller and never closes it, one open file and ~380 KiB per
    `POST /v1/batches` under concurrent requests, until the server ran out of descriptors
    (tests/integration/test_serve_load.py)."""
    key = (settings.broker_url, settings.visibility_timeout)
    with _senders_lock:
        app = _senders.get(key)
        if app is None:
            app = _senders[key] = create_app(settings)
        return app


def run_worker(app: Celery, argv: list[str]) -> int:
    """Run a Celery worker with `argv` in this process until it stops; its exit code.
    `app.worker_main` drops it: after an "Unrecoverable error" (seen: kombu's Redis transport
    failing to restore unacknowledged tasks as Redis restarts, right after a database outage)
    Celery stops the worker with exit code 1, yet the process exited 0, which a supervisor
    (`worker --concurrency N`, systemd, Kubernetes) takes for a clean stop and never restarts."""
    controllers: list[Any] = []

    def keep(sender: Any = None, **_kwargs: Any) -> None:
        controllers.append(sender)

    worker_init.connect(keep, weak=False)
    try:
        app.start(["worker", *argv])
    finally:
        worker_init.disconnect(keep)
    return int(getattr(controllers[-1], "exitcode", 0) or 0) if controllers else 0
