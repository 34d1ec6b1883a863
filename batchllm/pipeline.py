"""Pipeline files: stages of jobs, each reading a file or an earlier stage's rows
(`batchllm pipeline run|submit|status FILE.toml`; the format: docs/pipelines.md).

A stage takes any `run` option by its name with underscores (model, max_tokens, choice,
prompt_template, ...), `from = "STAGE"` for an earlier stage's ok rows (`from_status` widens),
and `shard_size` and `strict` as `submit` does. Paths in the file (`input`, a `model` starting
with ./ or ../, a `json_schema` file) are relative to its folder, so a pipeline moves with them.
Each stage's job carries the labels `pipeline`, `stage` and `stage_key` (a digest of its settings
and parent job), so the pipeline's state lives in the database: run again, a stage whose latest
job completed with the same key is skipped, one still queued or running is waited for, and any
other (failed, cancelled, expired, or changed settings, input or parent) runs anew.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchllm.client import Client, Job
from batchllm.errors import BatchLLMError, InputError
from batchllm.input.job_rows import JobRows

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger(__name__)

# Stage keys that are not job options.
_STAGE_KEYS = {"name", "input", "from", "from_status", "shard_size", "strict"}
_LABELS = ("pipeline", "stage", "stage_key")


@dataclass(frozen=True)
class Stage:
    name: str
    input: str | None  # a path (resolved against the pipeline file's folder) or a URI
    parent: str | None  # the name of the stage whose rows it reads
    from_status: tuple[str, ...]
    options: dict[str, Any]  # build_job_spec's keywords (model, max_tokens, ...)
    shard_size: int | None = None
    strict: bool = False


@dataclass(frozen=True)
class Pipeline:
    name: str
    path: Path
    stages: list[Stage] = field(default_factory=list)


@dataclass
class StageState:
    """A stage as it stands: its latest job (None before the first) and whether that job is
    still the stage's: made with the stage's settings and parent job of now (`current`)."""

    stage: Stage
    job: Job | None
    current: bool


def load_pipeline(path: Path) -> Pipeline:
    """The pipeline file, checked: InputError naming the file, the stage and the key."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"name", "stage"}
    if unknown:
        raise InputError(f"{path}: unknown top-level key(s) {', '.join(sorted(unknown))}")
    raw = data.get("stage")
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{path}: no [[stage]] table; a pipeline has one or more stages")
    name = str(data.get("name") or path.stem)
    stages: list[Stage] = []
    for number, table in enumerate(raw, 1):
        stages.append(_stage(path, number, table, {s.name for s in stages}))
    return Pipeline(name, path, stages)


def _stage(path: Path, number: int, table: dict[str, Any], earlier: set[str]) -> Stage:
    where = f"{path}: stage {number}"
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InputError(f'{where}: needs a name (name = "...")')
    where = f"{path}: stage {name!r}"
    if name in earlier:
        raise InputError(f"{where}: a stage of this name comes earlier")
    source, parent = table.get("input"), table.get("from")
    if (source is None) == (parent is None):
        raise InputError(f"{where}: give one of input (a file) and from (an earlier stage)")
    if parent is not None and parent not in earlier:
        raise InputError(
            f"{where}: from = {parent!r} names no earlier stage"
            + (f" (earlier: {', '.join(sorted(earlier))})" if earlier else "")
        )
    if source is not None:
        source = str(source)
        if "://" not in source:
            source = str((path.parent / source).expanduser())
    options = {k: v for k, v in table.items() if k not in _STAGE_KEYS}
    if "model" not in options:
        raise InputError(f"{where}: needs a model")
    if str(options["model"]).startswith(("./", "../")):  # beside the file, as input is
        options["model"] = str((path.parent / options["model"]).resolve())
    if isinstance(options.get("choice"), str):  # "yes,no", as --choice takes it
        options["choice"] = [c.strip() for c in options["choice"].split(",") if c.strip()]
    if isinstance(options.get("json_schema"), str):  # a file, as --json-schema takes it
        options["json_schema"] = _json_file(where, path.parent / options["json_schema"])
    metadata = options.get("metadata", {})
    if not isinstance(metadata, dict) or set(metadata) & set(_LABELS):
        raise InputError(f"{where}: metadata must be a table without {', '.join(_LABELS)}")
    statuses = table.get("from_status", ["ok"])
    if isinstance(statuses, str):
        statuses = [s.strip() for s in statuses.split(",")]
    return Stage(
        name=name,
        input=source,
        parent=parent,
        from_status=tuple(statuses),
        options=options,
        shard_size=table.get("shard_size"),
        strict=bool(table.get("strict", False)),
    )


def _json_file(where: str, file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{where}: json_schema {file}: {exc}") from None


def stage_states(client: Client, pipeline: Pipeline) -> list[StageState]:
    """Every stage's latest job and whether it matches the stage now (reads only)."""
    states: dict[str, StageState] = {}
    for stage in pipeline.stages:
        parent = states[stage.parent] if stage.parent else None
        parent_job = parent.job if parent is not None else None
        found = latest_job(client, pipeline.name, stage.name)
        job, key = found if found is not None else (None, None)
        current = key == stage_key(stage, parent_job.id if parent_job else None)
        # A parent that runs again gives its children new rows: they run again too.
        current = current and (parent is None or parent.current)
        states[stage.name] = StageState(stage, job, job is not None and current)
    return list(states.values())


def stage_key(stage: Stage, parent_job: str | None) -> str:
    """A digest of what makes the stage's job: its input or parent job, and its options."""
    described = {
        "input": stage.input,
        "input_version": _file_version(stage.input),
        "parent_job": parent_job,
        "from_status": list(stage.from_status),
        "options": stage.options,
        "shard_size": stage.shard_size,
        "strict": stage.strict,
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _file_version(source: str | None) -> list[int] | None:
    """A local input's size and modification time: a file edited since its stage ran makes
    the stage run again. (An object-store URI is taken as it is named.)"""
    if source is None or "://" in source:
        return None
    try:
        info = Path(source).stat()
    except OSError:
        return None  # the run itself says the file is missing
    return [info.st_size, info.st_mtime_ns]


def latest_job(client: Client, pipeline: str, stage: str) -> tuple[Job, str | None] | None:
    """The newest job carrying this pipeline's and stage's labels, and its stage key."""
    from batchllm.store import service
    from batchllm.store.db import session_scope

    with session_scope(client.settings) as session:
        row = service.newest_job_labelled(session, pipeline=pipeline, stage=stage)
        if row is None:
            return None
        return Job.of(row), (row.job_metadata or {}).get("stage_key")


Report = Callable[[str, str, Job], None]  # (stage, what happened, its job)


def run_pipeline(
    client: Client,
    pipeline: Pipeline,
    *,
    fleet: bool,
    report: Report,
    engines: Any = None,
    poll: float = 2.0,
) -> list[StageState]:
    """Run (`fleet` False: each job here, to its end) or submit (`fleet`: to the workers,
    waiting for a stage's parent to complete before submitting it) every stage that has no
    completed job of its current settings. Stops at the first stage that does not complete
    (its children cannot read rows it has not got) with BatchLLMError naming it."""
    if not fleet:
        from batchllm.jobs.local import fail_abandoned_runs

        # A stage's job left running by a `pipeline run` that was killed is failed now (so it
        # runs again) rather than waited for; one another live process runs is waited for.
        fail_abandoned_runs(client.settings)
    done: dict[str, Job] = {}
    for stage in pipeline.stages:
        parent_job = done.get(stage.parent) if stage.parent else None
        key = stage_key(stage, parent_job.id if parent_job else None)
        found = latest_job(client, pipeline.name, stage.name)
        job = found[0] if found is not None and found[1] == key else None
        if job is not None and job.status == "completed":
            report(stage.name, "completed before: not run again", job)
        elif job is not None and not job.done:  # on the fleet: still queued or running
            report(stage.name, "queued or running: waiting for it", job)
            job = client.wait(job, poll=poll)
        else:
            job = _start(client, pipeline, stage, parent_job, key, fleet, engines)
            report(stage.name, "submitted" if fleet else "ran", job)
            if fleet:
                job = client.wait(job, poll=poll)
        done[stage.name] = job
        if job.status != "completed":
            raise BatchLLMError(
                f"pipeline {pipeline.name}: stage {stage.name!r} ended {job.status} "
                f"(job {job.id}{': ' + job.error if job.error else ''}); run the pipeline "
                "again to retry it"
            )
    return stage_states(client, pipeline)


def _start(
    client: Client,
    pipeline: Pipeline,
    stage: Stage,
    parent_job: Job | None,
    key: str,
    fleet: bool,
    engines: Any,
) -> Job:
    labels = {"pipeline": pipeline.name, "stage": stage.name, "stage_key": key}
    options = dict(stage.options)
    given = {str(k): str(v) for k, v in options.get("metadata", {}).items()}
    options["metadata"] = {**given, **labels}
    requests: Any = stage.input
    if parent_job is not None:
        requests = JobRows(parent_job.id, stage.from_status)
    try:
        if fleet:
            return client.submit(
                requests, strict=stage.strict, shard_size=stage.shard_size, **options
            )
        return client.run(requests, strict=stage.strict, engines=engines, **options)
    except TypeError as exc:  # build_job_spec: unknown job option(s)
        raise InputError(f"{pipeline.path}: stage {stage.name!r}: {exc}") from None
