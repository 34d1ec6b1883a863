"""The Python API: jobs from a data pipeline (Airflow, Dagster, a notebook) rather than a
terminal. The same library calls as the CLI, typed, with no click and no printing.

    from batchllm import Client

    client = Client()
    job = client.submit("prompts.jsonl", model="meta-llama/Llama-3.1-8B-Instruct", max_tokens=64)
    job = client.wait(job, timeout=3600)
    table = client.results(job).to_table()      # pyarrow; .to_pandas() for pandas

vllm and torch are imported only by `run` (which builds an engine here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

# The output layer registers, on import, the tidying of ended jobs' output as part of every
# commit (store/db.py `before_commit`): a job this client cancels is tidied like any other.
import batchllm.output  # noqa: F401
from batchllm.errors import BatchLLMError
from batchllm.input.job_rows import JobRows, child_options
from batchllm.input.job_spec import build_job_spec
from batchllm.settings import Settings, get_settings
from batchllm.spec import JobSpec
from batchllm.store.states import JobStatus

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.dataset as ds

    from batchllm.engine.protocol import EngineSource
    from batchllm.input.files.source import InputSource
    from batchllm.jobs.estimate import Estimate
    from batchllm.store.models import Job as JobRow
    from batchllm.store.webhooks import WebhookTarget

# A path, an s3:// URI, request dicts, another job's rows (JobRows: `--from`), or an input the
# CLI already resolved.
Requests: TypeAlias = "str | Path | InputSource | JobRows | Iterable[Mapping[str, Any]]"


@dataclass(frozen=True)
class Job:
    """A job as it stood when read: id, state, counts, where its output is, throughput."""

    id: str
    status: str
    model: str
    total: int
    completed: int
    failed: int
    output_dir: str
    error: str | None = None
    throughput: dict[str, Any] = field(default_factory=dict)
    shards: int = 0
    # Lines refused by validation, which become error rows: known on the Job `submit` returns
    # (before any row ran, `failed` is 0), None on a Job read later.
    invalid: int | None = None
    # The secret signing the job's webhook (`notify`): on the Job `submit` and `run` return.
    notify_secret: str | None = None
    # Its runs: the first, then each retry ({"attempt", "lines", "status", ...}, oldest first).
    attempts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """The job ended (completed, failed, cancelled or expired)."""
        return JobStatus(self.status).is_final

    @classmethod
    def of(cls, row: JobRow) -> Job:
        from batchllm.store.job_view import job_view

        view = job_view(row)
        counts = view["request_counts"]
        return cls(
            id=view["id"],
            status=view["status"],
            model=view["model"],
            total=counts["total"],
            completed=counts["completed"],
            failed=counts["failed"],
            output_dir=view["output_dir"],
            error=view["error"],
            throughput={name: view["throughput"][name] for name in _THROUGHPUT},
            shards=row.shards_total,
            attempts=view["attempts"],
        )


# The throughput figures a program reading a Job gets (`batchllm status --json` shows more).
_THROUGHPUT = (
    "prompt_tokens",
    "completion_tokens",
    "requests_per_s",
    "output_tokens_per_s",
    "wall_seconds",
    "cached_tokens",
    "prefix_cache_hit_rate",
)


class Client:
    """Jobs on the database, storage and broker of `settings` (default: BATCHLLM_* variables,
    as the CLI)."""

    def __init__(self, settings: Settings | None = None, *, keep_engine: bool = False) -> None:
        """`keep_engine`: `run` keeps its vLLM engine up between jobs with the same model and
        engine settings (a notebook's second job starts at once); `close()` stops it."""
        self.settings = settings or get_settings()
        self._engines: EngineSource | None = None
        if keep_engine:
            from batchllm.execution.engines import EngineCache

            self._engines = EngineCache(self.settings)

    def close(self) -> None:
        """Stop the engine kept by `keep_engine`, if any."""
        if self._engines is not None:
            self._engines.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def submit(
        self,
        requests: Requests,
        *,
        model: str,
        strict: bool = False,
        shard_size: int | None = None,
        notify: str | None = None,
        **options: Any,
    ) -> Job:
        """Validate and store the requests (a JSONL path, a Parquet or CSV path with
        `prompt_column=` or `messages_column=` and optionally `id_column=`, `system=`, or
        request dicts in any line form) and queue the job for the fleet; returns at once.
        `priority="high"|"normal"|"low"` orders it among queued jobs; `notify=URL` gets a
        signed POST when the job ends."""
        with _as_source(requests, self.settings) as path:
            spec = _spec(model, requests, path, self.settings, options)
            return self.submit_spec(path, spec, strict=strict, shard_size=shard_size, notify=notify)

    def submit_spec(
        self,
        requests: Requests,
        spec: JobSpec,
        *,
        strict: bool = False,
        shard_size: int | None = None,
        notify: str | None = None,
    ) -> Job:
        """`submit` with a ready JobSpec (the CLI builds one from its flags). `shard_size`:
        rows per shard, default BATCHLLM_SHARD_SIZE."""
        from batchllm.jobs.submit import submit_job

        invalid: list[int] = []
        target = self._webhook(notify)
        with _as_source(requests, self.settings) as path:
            row = submit_job(
                path,
                spec,
                strict=strict,
                shard_size=shard_size,
                settings=self.settings,
                on_stored=lambda stored: invalid.append(stored.invalid),
                notify=target,
            )
        return dataclasses.replace(
            Job.of(row), invalid=invalid[0], notify_secret=target.secret if target else None
        )

    def _webhook(self, url: str | None) -> WebhookTarget | None:
        """A job's webhook: the URL, checked, and BATCHLLM_WEBHOOK_SECRET or a new secret."""
        from batchllm.store.webhooks import WebhookTarget, check_url, new_secret

        if url is None:
            return None
        return WebhookTarget(check_url(url), self.settings.webhook_secret or new_secret())

    def run(
        self,
        requests: Requests,
        *,
        model: str,
        strict: bool = False,
        engines: EngineSource | None = None,
        notify: str | None = None,
        **options: Any,
    ) -> Job:
        """Run the job to its end in this process (vLLM here, no broker); returns it ended.
        `engines` hands it an engine source of the caller's (tests use a fake one); `notify`
        as for `submit`."""
        with _as_source(requests, self.settings) as path:
            spec = _spec(model, requests, path, self.settings, options)
            return self.run_spec(path, spec, strict=strict, engines=engines, notify=notify)

    def run_spec(
        self,
        requests: Requests,
        spec: JobSpec,
        *,
        strict: bool = False,
        engines: EngineSource | None = None,
        on_created: Callable[[Job], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        notify: str | None = None,
    ) -> Job:
        """`run` with a ready JobSpec. `on_created(job)` once the job is stored (before the
        engine is up); `on_progress(rows, completion_tokens)` as rows finish."""
        from batchllm.jobs.local import run_job

        target = self._webhook(notify)

        def created(row: JobRow) -> None:
            if on_created is not None:
                on_created(
                    dataclasses.replace(
                        Job.of(row), notify_secret=target.secret if target else None
                    )
                )

        with _as_source(requests, self.settings) as path:
            row = run_job(
                path,
                spec,
                strict=strict,
                settings=self.settings,
                engines=engines or self._engines,
                on_created=created,
                on_progress=on_progress,
                notify=target,
            )
        return dataclasses.replace(Job.of(row), notify_secret=target.secret if target else None)

    def dry_run(self, requests: Requests, *, model: str, **options: Any) -> Estimate:
        """What `submit` or `run` with these arguments would process: the requests validated,
        their prompt tokens counted with the model's tokenizer (no vLLM), the output bounded
        by max_tokens, the time from this model's earlier jobs on this hardware. Creates no
        job and starts no engine."""
        with _as_source(requests, self.settings) as path:
            spec = _spec(model, requests, path, self.settings, options)
            return self.dry_run_spec(path, spec)

    def dry_run_spec(self, requests: Requests, spec: JobSpec) -> Estimate:
        """`dry_run` with a ready JobSpec."""
        from batchllm.jobs.estimate import estimate_job

        with _as_source(requests, self.settings) as path:
            return estimate_job(path, spec, settings=self.settings)

    def status(self, job: Job | str) -> Job:
        from batchllm.store import service
        from batchllm.store.db import session_scope

        with session_scope(self.settings) as session:
            return Job.of(service.get_job(session, _id(job)))

    def wait(
        self,
        job: Job | str,
        timeout: float | None = None,
        poll: float = 2.0,
        on_poll: Callable[[Job], None] | None = None,
    ) -> Job:
        """Poll until the job ends; TimeoutError after `timeout` seconds. `on_poll(job)` sees
        every state read, the last (ended) one too: a progress display follows it."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        while True:
            current = self.status(job)
            if on_poll is not None:
                on_poll(current)
            if current.done:
                return current
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {current.id} is still {current.status} after {timeout} s")
            time.sleep(poll)

    def cancel(self, job: Job | str) -> Job:
        from batchllm.store import service
        from batchllm.store.db import session_scope

        with session_scope(self.settings) as session:
            cancelled = service.cancel_job(
                session, _id(job), lease_seconds=self.settings.lease_seconds
            )
            return Job.of(cancelled)

    def retry(
        self,
        job: Job | str,
        *,
        all_errors: bool = False,
        engines: EngineSource | None = None,
        on_started: Callable[[int, int], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Job:
        """Run the lines of an ended job that did not succeed again, as its next attempt: lines
        without an answer (cancelled, expired, failed runs) and error rows of a retryable kind
        (the engine's failures; with `all_errors`, every error row). Each new row replaces the
        old one: the output keeps one row per line. A job `run` created runs here to its end
        (vLLM in this process); a job `submit` created goes back to the fleet and is returned
        queued (`wait` for it). `on_started(lines, lines_without_row)` once the attempt is
        recorded. JobStateError for a job still running or with nothing to retry."""
        from batchllm.jobs.retry import retry_job

        row = retry_job(
            _id(job),
            all_errors=all_errors,
            settings=self.settings,
            engines=engines or self._engines,
            on_started=on_started,
            on_progress=on_progress,
        )
        return Job.of(row)

    def results(self, job: Job | str) -> ds.Dataset:
        """The job's output (committed rows so far, all of them once it completed) as a
        pyarrow dataset with the Parquet contract's schema; `.to_table().to_pandas()`."""
        from batchllm.output.parts import output_dataset
        from batchllm.storage import Storage
        from batchllm.store import service
        from batchllm.store.db import session_scope

        with session_scope(self.settings) as session:
            row = service.get_job(session, _id(job))
            job_id = row.id
        storage = Storage.for_job(row, self.settings)
        return output_dataset(storage, storage.output_dir(job_id))

    def iter_results(
        self,
        job: Job | str,
        *,
        follow: bool = False,
        columns: Sequence[str] | None = None,
        poll: float = 1.0,
    ) -> Iterator[dict[str, Any]]:
        """The job's committed rows as dicts, each once, a part file at a time (memory stays
        flat on any job size). `follow`: keep yielding rows as they are committed until the
        job ends. `columns`: only these columns of the Parquet contract."""
        for batch in self.iter_result_batches(job, follow=follow, columns=columns, poll=poll):
            yield from batch.to_pylist()

    def iter_result_batches(
        self,
        job: Job | str,
        *,
        follow: bool = False,
        columns: Sequence[str] | None = None,
        poll: float = 1.0,
    ) -> Iterator[pa.RecordBatch]:
        """`iter_results` as pyarrow record batches (a few thousand rows each)."""
        from batchllm.output.stream import iter_committed_batches

        return iter_committed_batches(
            self.settings, _id(job), columns=columns, follow=follow, poll=poll
        )

    def delete(self, job: Job | str) -> list[str]:
        """Delete an ended job for good: its rows in the database and its files in the
        storage (input, output, adapters, Batch API result files). JobStateError for a job
        that has not ended: cancel it first. Returns the directories and files removed."""
        from batchllm.output.deletion import delete_job

        return delete_job(self.settings, _id(job)).removed


def _spec(
    model: str, requests: Requests, path: InputSource, settings: Settings, options: dict[str, Any]
) -> JobSpec:
    """The job spec of these options; for a parent's rows, with a child's table options."""
    if isinstance(requests, JobRows):
        options = child_options(requests, options)
    return build_job_spec(model, settings=settings, requests=path, **options)


def _id(job: Job | str) -> str:
    return job.id if isinstance(job, Job) else job


class _as_source:
    """The requests as an input file, resolved once (input/files/source.py): the path or s3:// URI
    given, or a temporary JSONL file the dicts are streamed into (removed afterwards: the job
    keeps its own validated copy). A source already resolved (the CLI's) is used as it is."""

    def __init__(self, requests: Requests, settings: Settings) -> None:
        self.requests = requests
        self.settings = settings
        self.temporary: Path | None = None
        self.parent: contextlib.ExitStack | None = None

    def __enter__(self) -> InputSource:
        from batchllm.input.files.source import InputSource, resolve_input

        endpoint = self.settings.resolved_s3_endpoint
        if isinstance(self.requests, InputSource):
            return self.requests
        if isinstance(self.requests, JobRows):  # a temporary table of the parent's rows
            from batchllm.jobs.parent_rows import parent_input

            self.parent = contextlib.ExitStack()
            return self.parent.enter_context(parent_input(self.requests, self.settings))
        if isinstance(self.requests, str) and "://" in self.requests:
            return resolve_input(self.requests, s3_endpoint=endpoint)  # Path() would mangle it
        if isinstance(self.requests, (str, Path)):
            return resolve_input(Path(self.requests), s3_endpoint=endpoint)
        handle = tempfile.NamedTemporaryFile(
            "w", suffix=".jsonl", prefix="batchllm-requests-", delete=False, encoding="utf-8"
        )
        with handle:
            for request in self.requests:
                if not isinstance(request, Mapping):
                    raise BatchLLMError(f"a request must be a dict, got {type(request).__name__}")
                handle.write(json.dumps(request) + "\n")
        self.temporary = Path(handle.name)
        return resolve_input(self.temporary, s3_endpoint=endpoint)

    def __exit__(self, *_exc: object) -> None:
        if self.temporary is not None:
            self.temporary.unlink(missing_ok=True)
        if self.parent is not None:
            self.parent.close()
