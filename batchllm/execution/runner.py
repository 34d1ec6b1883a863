"""The shard runner: streams shards' rows through one engine with a continuous feed.

The engine is kept full (a window of a few times max_num_seqs requests in flight) across shard
boundaries; finished rows are buffered per shard and committed as Parquet part files plus a
database checkpoint every `commit_rows` rows or `commit_seconds`, so a crash loses at most the
rows in flight. What runs between engine steps is kept small: tokenization happens in batches
when requests are fed, commits happen only at the thresholds.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from batchllm.engine.prompts import token_count, within_context
from batchllm.engine.protocol import Adapter, Engine
from batchllm.errors import EngineDied, ShardBusy, ShardLost
from batchllm.execution import metrics
from batchllm.execution.drain import Drain, start_drain
from batchllm.execution.finalize import finalize_job
from batchllm.execution.results import Sampling, record_finished, record_refused
from batchllm.execution.shard_state import ShardState, load_shard_state, sampling_for
from batchllm.heap import frozen_heap
from batchllm.input.adapters import local_adapter_path
from batchllm.input.formats.rows import InputRow
from batchllm.output.parts import OutputBuffer, Part
from batchllm.process.stopping import StopRequest
from batchllm.row_errors import INVALID_REQUEST, REQUEST_REJECTED, Refusal
from batchllm.settings import Settings
from batchllm.store import leases, service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import JobStatus, ShardStatus

log = logging.getLogger(__name__)

_PREPARE_BATCH = 256
_CONTROL_INTERVAL = 1.0  # seconds between checks for cancel / stop requests
_SAMPLING_CACHE = 4096  # distinct (job, per-line overrides) pairs kept built
# Request ids are unique per process, not per runner: requests of a runner that ended on an
# error may still be in the engine when the next runner starts on it.
_request_ids = itertools.count()


class Outcome(str, enum.Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # stopped by the worker's shutdown; rows committed, rest to redo
    ENGINE_DIED = "engine_died"  # the engine died; rows committed, the shard handed back
    SKIPPED = "skipped"  # nothing to do (already finished or cancelled before it started)
    BUSY = "busy"  # running on another live worker; try again later
    WAITING = "waiting"  # this worker's engine cannot run the job; for a worker that can
    LOST = "lost"  # this worker's lease ran out and another worker took the shard over
    RETRYING = "retrying"  # its run failed (counted on the shard); it runs again after a backoff


# A request in the engine: its shard, its row and what it runs under (a plain tuple: one is
# made per row).
_Pending = tuple[ShardState, InputRow, Sampling]
# One batch of a shard's rows to feed.
_Batch = tuple[ShardState, list[InputRow]]

ProgressFn = Callable[[int, int], None]


class ShardRunner:
    """Runs shards on one engine."""

    def __init__(
        self,
        engine: Engine,
        *,
        worker: str,
        settings: Settings,
        window: int | None = None,
        on_progress: ProgressFn | None = None,
        stop: StopRequest | None = None,
        first_wave: int = 0,
    ) -> None:
        """`first_wave` > 0: until the first request finishes, at most that many are in the
        engine. A full batch shares each step among all its requests, so its first answer
        comes late (1,000 questions here: 19 s into the run at 256 at once); a small first
        wave answers within a second or two, and the window then opens in full. `batchllm
        run` asks for it (its user watches); a fleet worker does not."""
        self.engine = engine
        self.settings = settings
        self.worker = worker
        self.window = window or 4 * engine.max_num_seqs
        self.first_wave = min(first_wave, self.window)
        self._ramping = self.first_wave > 0  # no request has finished yet
        self.on_progress = on_progress or (lambda rows, tokens: None)
        self.stop = stop or StopRequest()
        self._pending: dict[str, _Pending] = {}
        self._active: list[ShardState] = []
        self._outcomes: dict[int, Outcome] = {}
        self._started_jobs: set[str] = set()
        self._first_rows_committed: set[str] = set()
        # (job, the line's override text) -> what its rows run under
        self._sampling_cache: dict[tuple[str, str | None], Sampling] = {}
        self._stopping = False  # a stop was requested: no more rows are fed
        self._drain: Drain | None = None  # the rows in flight may finish until its deadline
        # Prometheus (execution/metrics.py). The engine serves one model, so the per-step gauges
        # go to the model of the shard claimed last; commits and shard ends to their own.
        self._metrics: metrics.ModelMetrics | None = None
        self._shard_started: dict[int, float] = {}

    # -- public ---------------------------------------------------------------------------

    def run(self, shard_ids: list[int]) -> dict[int, Outcome]:
        """Run these shards to an end; returns each shard's outcome."""
        self._outcomes = {}
        with frozen_heap():
            self._run(shard_ids)
        return self._outcomes

    def _run(self, shard_ids: list[int]) -> None:
        source = self._batches(shard_ids)
        exhausted = False
        last_control = time.monotonic()
        try:
            while True:
                window = self.first_wave if self._ramping else self.window
                while not exhausted and len(self._pending) < window and not self._stopping:
                    exhausted = self._feed(source)
                if self.engine.has_unfinished():
                    self._step()
                elif exhausted or self._stopping:
                    break
                if self._drain is not None and self._drain.over(self.stop):
                    self._stop_now()
                now = time.monotonic()
                if now - last_control >= _CONTROL_INTERVAL:
                    last_control = now
                    self._control()
                self._housekeep()
            self._housekeep()
            if self._stopping:  # a drain that ended with every row in flight finished
                self._stop_now()
        except BaseException as exc:
            self._fail_active(exc)
            raise
        finally:
            if self._metrics is not None:
                self._metrics.step(0, len(self._pending))

    # -- feeding --------------------------------------------------------------------------

    def _batches(self, shard_ids: list[int]) -> Iterator[_Batch]:
        """Each shard's rows still to do, claimed in turn, a batch of a shard at a time (one
        chat template and one tokenizer call per batch)."""
        for shard_id in shard_ids:
            if self._stopping:
                return
            try:
                with session_scope(self.settings) as session:
                    claimed = leases.claim_shard(
                        session, shard_id, self.worker, self.settings.lease_seconds
                    )
            except ShardBusy as exc:
                log.info("%s", exc)
                self._outcomes[shard_id] = Outcome.BUSY
                continue
            if claimed is None:
                self._outcomes[shard_id] = Outcome.SKIPPED
                continue
            state = load_shard_state(self.settings, shard_id)
            self._active.append(state)
            self._metrics = metrics.for_model(state.spec.model)
            self._metrics.shard_started(resumed=bool(state.done_lines))
            self._shard_started[shard_id] = time.monotonic()
            rows = state.rows()
            while not (self._stopping or state.fed_all):  # fed_all early: the job was cancelled
                size = self.first_wave if self._ramping else _PREPARE_BATCH
                batch = list(itertools.islice(rows, size))
                if batch:
                    yield state, batch
                if len(batch) < size:
                    break
            state.fed_all = True

    def _feed(self, source: Iterator[_Batch]) -> bool:
        """Feed one batch of rows; True when the source is exhausted."""
        item = next(source, None)
        if item is None:
            return True
        state, batch = item
        runnable = [row for row in batch if row.kind != "invalid"]
        errors = len(batch) - len(runnable)
        if errors:
            for row in batch:
                if row.kind == "invalid":
                    state.buffer.failed(
                        row.custom_id, row.line, row.error or "invalid line", INVALID_REQUEST
                    )
        if runnable:
            runnable = self._checked_ids(state, runnable)
            prepared = self._prepare(runnable, state.spec.chat_template)
            limit = state.spec.engine.max_model_len
            if limit is not None and limit < self.engine.max_model_len:
                # A warm engine with a longer context serves the job (execution/engines.py); the
                # context the user gave still bounds its rows, as on an engine of its own.
                prepared = within_context(runnable, prepared, limit, "the job's --max-model-len")
            errors += self._add_all(state, runnable, prepared)
        if errors:
            self.on_progress(errors, 0)
        return False

    def _checked_ids(self, state: ShardState, rows: list[InputRow]) -> list[InputRow]:
        """The rows, without the token ids stored for them when those are not what this
        engine's tokenizer gives. Another process tokenized them (`submit`, with a tokenizer
        loaded without torch, or a sizing pass): the first row with ids of each shard is
        tokenized here as well, and on a difference the shard's stored ids are dropped."""
        if not state.ids_checked:
            first = next((row for row in rows if row.token_ids is not None), None)
            if first is None:
                return rows
            state.ids_checked = True
            template = state.spec.chat_template
            own = self._prepare([dataclasses.replace(first, token_ids=None)], template)
            if own != self._prepare([first], template):
                state.ids_dropped = True
                log.warning(
                    "job %s shard %d: the token ids stored for line %d differ from this "
                    "engine's tokenizer; tokenizing the shard's rows here",
                    state.job_id,
                    state.index,
                    first.line,
                )
        if not state.ids_dropped:
            return rows
        return [
            row if row.token_ids is None else dataclasses.replace(row, token_ids=None)
            for row in rows
        ]

    def _prepare(self, rows: list[InputRow], chat_template: str | None) -> list[Any]:
        """The rows' prepared ids; when preparing the batch raises, each row alone, so a row
        that raises becomes its own error row instead of failing its shard (and, sent again,
        failing it again)."""
        try:
            return self.engine.prepare(rows, chat_template)
        except EngineDied:
            raise
        except Exception as exc:
            log.warning("preparing %d rows failed (%s); preparing them one by one", len(rows), exc)
        prepared: list[Any] = []
        for row in rows:
            try:
                prepared.extend(self.engine.prepare([row], chat_template))
            except EngineDied:
                raise
            except Exception as exc:
                prepared.append(
                    Refusal(f"the prompt could not be prepared: {type(exc).__name__}: {exc}")
                )
        return prepared

    def _add_all(self, state: ShardState, rows: list[InputRow], prepared: list[Any]) -> int:
        """Add a batch's prepared rows to the engine; returns how many were refused (each
        gets its error row). One loop with everything it calls bound once: this runs for every
        row of a job."""
        if state.job_id not in self._started_jobs and any(
            not isinstance(ids, Refusal) for ids in prepared
        ):
            self._started_jobs.add(state.job_id)
            with session_scope(self.settings) as session:
                service.mark_generation_started(
                    session,
                    state.job_id,
                    hardware=self.engine.hardware,
                    vllm_version=self.engine.version,
                )
        refused = added = 0
        cache, job, add, pending = (
            self._sampling_cache,
            state.job_id,
            self.engine.add,
            self._pending,
        )
        try:
            for row, ids in zip(rows, prepared, strict=True):
                if isinstance(ids, Refusal):  # refused where it was prepared (e.g. too long)
                    state.buffer.failed(row.custom_id, row.line, ids, ids.code)
                    refused += 1
                    continue
                sampling = cache.get((job, row.sampling))
                if sampling is None:
                    try:
                        sampling = self._sampling(state, row)
                    except Exception as exc:  # e.g. a parser this vLLM does not have
                        state.buffer.failed(
                            row.custom_id,
                            row.line,
                            str(exc),
                            REQUEST_REJECTED,
                            prompt_tokens=token_count(ids),
                        )
                        refused += 1
                        continue
                # Not a bare number: LLM.generate sorts its own outputs by int(request_id),
                # and the benchmark drives generate and this runner on one engine.
                request_id = f"r{next(_request_ids)}"
                try:
                    add(request_id, ids, sampling.params, sampling.adapter)
                except EngineDied:
                    raise
                except Exception as exc:  # vLLM refused this one request, not the job
                    record_refused(state.buffer, row, token_count(ids), sampling, exc)
                    refused += 1
                    continue
                pending[request_id] = (state, row, sampling)
                added += 1
        finally:
            state.inflight += added
        return refused

    def _sampling(self, state: ShardState, row: InputRow) -> Sampling:
        """The row's engine sampling parameters, constraint and adapter, built on a miss of
        the cache `_add_all` looks in first: once per job and distinct per-line override text.
        A job's lines share few of them, and decoding, merging and keying them again for every
        row was a third of the feed's own per-row work."""
        if len(self._sampling_cache) >= _SAMPLING_CACHE:  # e.g. a distinct seed per line
            self._sampling_cache.clear()
        merged = sampling_for(state.spec, row)
        adapter = self._adapter_of(state, merged.get("adapter"))
        built = Sampling(
            params=self.engine.sampling_params(merged),
            constraint=merged.get("structured"),
            adapter=adapter,
            adapter_name=adapter.name if adapter is not None and not adapter.base else None,
        )
        self._sampling_cache[(state.job_id, row.sampling)] = built
        return built

    def _adapter_of(self, state: ShardState, name: str | None) -> Adapter | None:
        """The row's LoRA adapter; for a base row of a job with adapters, a marker naming
        one of them (an engine may need its shapes, engine/vllm_engine.py)."""
        adapters = state.spec.adapters
        if name is not None:
            return Adapter(name, local_adapter_path(state.storage, adapters[name]))
        if adapters:
            first = sorted(adapters)[0]
            return Adapter("", local_adapter_path(state.storage, adapters[first]), base=True)
        return None

    def _step(self) -> None:
        started = time.perf_counter()
        finished = self.engine.step()
        elapsed = time.perf_counter() - started
        if finished:
            self._ramping = False
        running = [s for s in self._active if s.inflight]
        for state in running:
            state.step_seconds += elapsed / len(running)
        tokens = 0
        for out in finished:
            pending = self._pending.pop(out.request_id, None)
            if pending is None:  # aborted earlier
                continue
            if out.finish_reason == "abort":
                # Not ours (we forget a request before aborting it): the engine is stopping.
                raise EngineDied(
                    f"vLLM aborted request {out.request_id} itself: the engine is stopping"
                )
            state, row, sampling = pending
            state.inflight -= 1
            record_finished(state.buffer, row, sampling, out)
            state.cached_tokens += out.cached_tokens
            tokens += out.generated_tokens
        if finished:
            self.on_progress(len(finished), tokens)
        if self._metrics is not None:
            self._metrics.step(tokens, len(self._pending))

    # -- commits, shard ends, control ------------------------------------------------------

    def _housekeep(self) -> None:
        now = time.monotonic()
        for state in list(self._active):
            if state.finished:
                if self._commit(state):
                    self._end(state, ShardStatus.COMPLETED, Outcome.COMPLETED)
            elif len(state.buffer) >= self.settings.commit_rows or (
                state.buffer
                and (
                    now - state.last_commit >= self.settings.commit_seconds
                    or state.job_id not in self._first_rows_committed
                )
            ):
                # A job's first finished rows are committed at once, so `results --follow`
                # and the Client show answers seconds after generation starts; then the
                # usual cadence.
                self._first_rows_committed.add(state.job_id)
                self._commit(state)

    def _commit(self, state: ShardState) -> bool:
        """Commit the state's finished rows; False (and the shard dropped) if it was lost."""
        try:
            part = state.commit(self.settings)
        except ShardLost as exc:
            self._drop(state, exc)
            return False
        if part is not None:
            _count_committed(state.spec.model, part)
        return True

    def _drop(self, state: ShardState, reason: Exception) -> None:
        log.warning("shard %d: %s; dropping this worker's run of it", state.index, reason)
        self._abort(state)
        state.buffer = OutputBuffer()
        if state in self._active:
            self._active.remove(state)
        self._outcomes[state.shard_id] = Outcome.LOST
        self._shard_ended(state, Outcome.LOST)

    def _end(
        self, state: ShardState, status: ShardStatus, outcome: Outcome, error: str | None = None
    ) -> None:
        self._active.remove(state)
        self._outcomes[state.shard_id] = outcome
        with session_scope(self.settings) as session:
            next_step = state_machine.end_shard(
                session, state.shard_id, status, error, attempt=state.attempt
            )
        self._shard_ended(state, outcome)
        if next_step is JobStatus.FINALIZING:
            finalize_job(
                state.job_id,
                settings=self.settings,
                hardware=self.engine.hardware,
                vllm_version=self.engine.version,
            )

    def _abort(self, state: ShardState) -> None:
        ids = [rid for rid, (owner, _, _) in self._pending.items() if owner is state]
        self.engine.abort(ids)
        for rid in ids:
            del self._pending[rid]
        state.inflight = 0
        state.fed_all = True

    def _control(self) -> None:
        # The heartbeats come from this loop, not from a thread of their own: a lease then
        # says that the run makes progress. A hung engine step or commit stops them, and the
        # shard goes to another worker once the lease (120 s by default) runs out; a thread
        # would hold the shard for as long as the process lives. The cost is on a machine
        # where one step or commit can take longer than the lease (the chaos harness runs
        # 10 s leases on two busy cores): the shard runs again elsewhere, nothing is lost.
        if self.stop.requested.is_set() and not self._stopping:
            self._begin_stop()
            if self._drain is None:
                return
        job_ids = {s.job_id for s in self._active}
        if not job_ids:
            return
        with session_scope(self.settings) as session:
            lost = leases.heartbeat(session, {s.shard_id: s.attempt for s in self._active})
            states = {j: service.job_status(session, j) for j in job_ids}
        for state in [s for s in self._active if s.shard_id in lost]:
            self._drop(state, ShardLost("its lease ran out and another worker took it over"))
        for state in list(self._active):
            if states[state.job_id] in (JobStatus.CANCELLING, JobStatus.CANCELLED):
                log.info("job %s cancelled: aborting shard %d", state.job_id, state.index)
                self._abort(state)
                if self._commit(state):
                    self._end(state, ShardStatus.CANCELLED, Outcome.CANCELLED)

    def _begin_stop(self) -> None:
        """Feed nothing more; drain the rows in flight when the stop allows it, else stop now."""
        self._stopping = True
        self._drain = start_drain(self.engine, self._pending, self.stop)
        if self._drain is None:
            log.warning("stop requested: committing finished rows, handing the rest back")
            self._stop_now()

    def _stop_now(self) -> None:
        """Abort what is still in flight, commit what finished, hand the shards back."""
        drain, self._drain = self._drain, None
        if drain is not None:
            drain.ended(len(self._pending), self.stop, self._metrics)
        for state in list(self._active):
            self._abort(state)
            if self._commit(state):
                self._hand_back(state, Outcome.INTERRUPTED)

    def _hand_back(self, state: ShardState, outcome: Outcome) -> None:
        with session_scope(self.settings) as session:
            leases.release_shard(session, state.shard_id, state.attempt)
        self._active.remove(state)
        self._outcomes[state.shard_id] = outcome
        self._shard_ended(state, outcome)

    def _shard_ended(self, state: ShardState, outcome: Outcome) -> None:
        """Count the end of a shard run this runner started (once)."""
        started = self._shard_started.pop(state.shard_id, None)
        if started is None:
            return
        shard_metrics = metrics.for_model(state.spec.model)
        if outcome is Outcome.COMPLETED:
            shard_metrics.shard_finished(time.monotonic() - started)
        elif outcome is Outcome.FAILED:
            shard_metrics.shard_failed()
        else:
            shard_metrics.shard_stopped(outcome.value)

    def _fail_active(self, exc: BaseException) -> None:
        """A fatal error: keep what finished, then hand the shards back: their other rows run
        again. An engine death past BATCHLLM_MAX_SHARD_ATTEMPTS fails the shard; any other error
        goes to the caller, which counts it against the shard's bound with a backoff
        (execution/shard_failures.py) or, in `batchllm run`, ends the job failed."""
        try:  # none of the rows in flight is a result now; never leave them in the engine
            self.engine.abort(list(self._pending))
        except Exception:
            log.debug("could not abort the requests in flight", exc_info=True)
        self._pending.clear()
        if isinstance(exc, EngineDied):
            outcome = Outcome.ENGINE_DIED
        elif isinstance(exc, KeyboardInterrupt):
            outcome = Outcome.INTERRUPTED
        else:
            outcome = Outcome.RETRYING
        for state in list(self._active):
            state.inflight = 0
            try:
                if not self._commit(state):
                    continue
                if outcome is Outcome.ENGINE_DIED and (
                    state.attempt >= self.settings.max_shard_attempts
                ):
                    self._end(
                        state,
                        ShardStatus.FAILED,
                        Outcome.FAILED,
                        error=f"the engine died on run {state.attempt} of this shard "
                        f"(BATCHLLM_MAX_SHARD_ATTEMPTS): {exc}",
                    )
                else:
                    self._hand_back(state, outcome)
            except Exception:
                # The database is unreachable, most likely: the shard stays `running` and is
                # re-driven once its lease runs out (the reconciler).
                log.exception("shard %d: could not record its end", state.index)


def _count_committed(model: str, part: Part) -> None:
    """Add a committed part's rows and tokens to the model's counters."""
    metrics.for_model(model).committed(
        part.rows_ok,
        part.rows_failed,
        part.prompt_tokens,
        part.completion_tokens,
        part.cached_tokens,
    )
