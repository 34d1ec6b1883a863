"""`batchllm doctor`: what a user or operator checks before filing a bug, in a few seconds.

`diagnose()` gathers a Report: this machine and the settings in force with where each came
from (batchllm/doctor/machine.py), and the services that `run` and the fleet use
(database, broker, storage; below). A problem is something `batchllm run` cannot do without;
a warning is worth knowing but stops nothing. Each check is guarded, so one that fails becomes
a problem line rather than a traceback. Nothing here starts an engine (but `--startup`,
doctor/startup.py), imports vllm, or changes the database schema; the storage probe and any
directory it needed are removed.
"""

from __future__ import annotations

import logging
import os
import posixpath
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.doctor.machine import (
    Machine,
    Section,
    check_dtype,
    check_hardware,
    check_python,
    check_settings,
    check_torch,
    check_vllm,
    hide_password,
    read_machine,
    setting_sources,
)
from batchllm.settings import Settings
from batchllm.worker import redis_broker

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3
BROKER_TIMEOUT_S = 2


@dataclass
class Report:
    sections: list[Section]

    @property
    def problems(self) -> list[str]:
        return [f"{s.name}: {p}" for s in self.sections for p in s.problems]

    @property
    def warnings(self) -> list[str]:
        return [f"{s.name}: {w}" for s in self.sections for w in s.warnings]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "sections": {s.name: s.as_dict() for s in self.sections},
            "problems": self.problems,
            "warnings": self.warnings,
        }


def diagnose(
    *,
    model: str | None = None,
    fleet: bool = False,
    settings: Settings,
    startup: bool = False,
    enforce_eager: bool = False,
) -> Report:
    """Every check of `settings` and this machine, in the order the report shows them.
    `fleet` makes the broker required; `startup` builds `model`'s engine once and times it
    (doctor/startup.py), the only check that starts one."""
    sources = setting_sources()
    sections = [
        _guarded("python", "Python", check_python),
        _guarded("torch", "torch", check_torch),
        _guarded(
            "vllm", "vLLM", lambda: check_vllm(allow_unsupported=settings.allow_unsupported_vllm)
        ),
    ]
    try:
        machine: Machine | None = read_machine()
    except Exception:
        log.debug("reading the hardware failed", exc_info=True)
        machine = None
    sections += [
        _guarded("hardware", "Hardware", lambda: check_hardware(_known(machine))),
        _guarded("dtype", "dtype", lambda: check_dtype(_known(machine), model)),
        _guarded("database", "Database", lambda: check_database(settings.resolved_database_url)),
        _guarded(
            "broker",
            "Broker",
            lambda: check_broker(
                settings.broker_url, required_by=_broker_required_by(sources, fleet)
            ),
        ),
        _guarded(
            "storage",
            "Storage",
            lambda: check_storage(
                settings.resolved_storage, s3_endpoint=settings.resolved_s3_endpoint
            ),
        ),
        _guarded("settings", "Settings", lambda: check_settings(settings, sources)),
    ]
    if startup and model is not None:
        from batchllm.doctor.startup import check_startup

        sections.append(
            _guarded(
                "startup",
                "Engine start",
                lambda: check_startup(model, settings, enforce_eager=enforce_eager),
            )
        )
    report = Report(sections)
    log.info("doctor: %d problem(s), %d warning(s)", len(report.problems), len(report.warnings))
    return report


def _guarded(name: str, title: str, check: Callable[[], Section]) -> Section:
    try:
        return check()
    except Exception as exc:
        log.debug("doctor check %s failed", name, exc_info=True)
        failed = Section(name, title)
        failed.row("check", "failed")
        failed.problems.append(f"the check failed: {type(exc).__name__}: {exc}")
        return failed


def _known(machine: Machine | None) -> Machine:
    if machine is None:
        raise RuntimeError("could not read the hardware (run `batchllm -vv doctor` to see why)")
    return machine


def _broker_required_by(sources: Mapping[str, str], fleet: bool) -> str | None:
    """Why the broker must answer, or None: `run` needs none, so only a broker the user
    configured on purpose (or --fleet) makes an unreachable one a problem."""
    if fleet:
        return "--fleet"
    if sources["broker_url"] != "default":
        return f"BATCHLLM_BROKER_URL is set ({sources['broker_url']})"
    return None


# -- services ------------------------------------------------------------------------------


def check_database(url: str) -> Section:
    """Reachable, and at the newest schema (read, never upgraded)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.pool import NullPool

    parsed = make_url(url)
    shown = parsed.render_as_string(hide_password=True)
    backend = parsed.get_backend_name()
    section = Section("database", "Database")
    section.data = {"url": shown, "backend": backend}
    section.row("url", shown)
    if backend == "sqlite":
        if parsed.database not in (None, "", ":memory:") and not Path(parsed.database).exists():
            _sqlite_to_be_created(section, Path(parsed.database))
            return section
        connect_args: dict[str, Any] = {"timeout": CONNECT_TIMEOUT_S}
    elif backend in ("postgresql", "mysql", "mariadb"):
        connect_args = {"connect_timeout": CONNECT_TIMEOUT_S}
    else:  # other drivers name their timeout differently; the default applies
        connect_args = {}
    engine = create_engine(url, poolclass=NullPool, connect_args=connect_args)
    try:
        with engine.connect() as conn:
            from alembic.runtime.migration import MigrationContext

            current = MigrationContext.configure(conn).get_current_revision()
    except DBAPIError as exc:
        section.data["reachable"] = False
        section.row("reachable", "no")
        section.problems.append(f"cannot reach {shown}: {_first_line(exc.orig)}")
        return section
    finally:
        engine.dispose()
    _schema(section, url, backend, current)
    return section


def _sqlite_to_be_created(section: Section, file: Path) -> None:
    section.data.update(exists=False, reachable=None)
    parent = file.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK):
        section.row("status", "not created yet: created on first use")
    else:
        section.row("status", "cannot be created")
        section.problems.append(
            f"cannot create the SQLite database {file}: {parent} is not writable"
        )


def _schema(section: Section, url: str, backend: str, current: str | None) -> None:
    from alembic.script import ScriptDirectory

    from batchllm.store.db import alembic_config

    scripts = ScriptDirectory.from_config(alembic_config(url))
    head = scripts.get_current_head()
    at_head = current == head
    section.data.update(reachable=True, revision=current, head=head, schema_current=at_head)
    section.row("reachable", "yes")
    section.row(
        "schema", f"{current or 'empty'}" + (" (newest)" if at_head else f", newest is {head}")
    )
    if at_head:
        return
    if current is not None and current not in {s.revision for s in scripts.walk_revisions()}:
        # Nothing can upgrade from a revision this batchllm has no migration for.
        section.problems.append(
            f"{section.data['url']} is at schema {current}, which this batchllm does not know "
            "(written by a newer batchllm?)"
        )
    elif backend == "sqlite":  # the embedded database migrates itself when batchllm opens it
        section.row("", f"upgraded to {head} on first use")
    else:
        section.problems.append(
            f"{section.data['url']} is at schema {current or 'none (empty database)'}, not the "
            f"newest ({head}): run `batchllm db upgrade`"
        )


def _first_line(error: object) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def check_broker(url: str, *, required_by: str | None) -> Section:
    """Reachable, and how many tasks wait in each batchllm queue (Redis brokers only)."""
    shown = hide_password(url)
    section = Section("broker", "Broker")
    section.data = {"url": shown, "required": required_by is not None, "required_by": required_by}
    section.row("url", shown)
    section.row("needed", f"yes: {required_by}" if required_by else "only for submit/worker")
    if not redis_broker.is_redis(url):
        section.warnings.append(f"{shown}: not checked (doctor reads Redis brokers only)")
        return section
    import redis

    client = redis_broker.connect(url, timeout=BROKER_TIMEOUT_S, connect_timeout=BROKER_TIMEOUT_S)
    try:
        client.ping()
        queues = _queue_depths(client)
        unacked = int(client.hlen(redis_broker.UNACKED_KEY))
    except redis.RedisError as exc:
        section.data["reachable"] = False
        section.row("reachable", "no")
        message = f"cannot reach {shown}: {exc}"
        if required_by:
            section.problems.append(f"{message} (required: {required_by})")
        else:
            section.warnings.append(message + " (needed only for submit/worker, not for run)")
        return section
    finally:
        client.close()
    section.data.update(reachable=True, queues=queues, unacked=unacked)
    section.row("reachable", "yes")
    section.row("queued tasks", f"{sum(queues.values()):,}" if queues else "none")
    for queue, depth in sorted(queues.items()):
        section.row(f"  {queue}", f"{depth:,} waiting")
    section.row("unacked", f"{unacked:,} delivered, not yet acknowledged")
    _live_workers(section, url)
    return section


def _live_workers(section: Section, url: str) -> None:
    """Each live worker and the engine it serves (jobs adapt to these engines)."""
    from batchllm.execution.profile import EngineProfile
    from batchllm.worker.registry import live_workers

    workers = live_workers(url)
    section.data["workers"] = workers
    section.row("workers", f"{len(workers)} live" if workers else "none live")
    for worker in workers:
        engine = worker.get("engine")
        shown = (
            EngineProfile.from_dict(engine).describe()
            if engine
            else ", ".join(worker.get("models", []))
        )
        section.row(f"  {worker.get('node')}", shown)


def _queue_depths(client: Any) -> dict[str, int]:
    """Tasks waiting per Celery queue (batchllm.<model>#<digest>, see celery_app.queue_for_model)."""
    depths: dict[str, int] = {}
    for raw in client.scan_iter(match="batchllm.*", count=500):
        if client.type(raw) not in (b"list", "list"):
            continue
        key = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        queue = key.split(redis_broker.PRIORITY_SEPARATOR, 1)[0]
        depths[queue] = depths.get(queue, 0) + int(client.llen(raw))
    return depths


def check_storage(root: str, *, s3_endpoint: str = "") -> Section:
    """Writable: a probe file is written (as part files are: through a temporary name and a
    rename, or on an object store under its name, on `s3_endpoint`, "": AWS), read back and deleted.
    Directories the probe needed are removed again."""
    from batchllm.storage import Storage

    shown = hide_password(root)
    section = Section("storage", "Storage")
    section.data = {"root": shown}
    section.row("root", shown)
    storage = Storage(root, s3_endpoint=s3_endpoint)
    existed = storage.exists(storage.root)
    made = [] if existed or "://" in root else _missing_dirs(Path(storage.root))
    probe = posixpath.join(storage.root, f".batchllm-doctor-{uuid.uuid4().hex[:12]}")
    try:
        storage.makedirs(storage.root)
        storage.write_bytes(probe, b"batchllm doctor")
        writable = storage.read_bytes(probe) == b"batchllm doctor"
        storage.delete(probe)
    except OSError as exc:
        writable = False
        section.problems.append(f"{shown} is not writable: {exc}")
    finally:
        for directory in made:  # deepest first; rmdir leaves a directory someone filled
            try:
                directory.rmdir()
            except OSError:
                break
    section.data.update(exists=existed, writable=writable)
    if not existed:
        section.row("status", "not created yet: created on first use")
    section.row("writable", "yes" if writable else "no")
    if not writable and not section.problems:
        section.problems.append(f"{shown}: a probe file read back differently")
    return section


def _missing_dirs(path: Path) -> list[Path]:
    """The directories of `path` that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing
