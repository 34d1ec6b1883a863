"""A shard's run that failed with an error no single row explains (its sizing, its storage,
a bug): counted on the shard, retried with backoff, and bounded.

A row's own failure (a prompt the tokenizer refuses, a request the engine refuses) is that
row's error row and never reaches here (engine/prompts.py, execution/runner.py). What does is
an exception that escaped the whole shard. Sent again at once, such a shard failed again on
every delivery and, first in its queue's fair share, took every other tenant's turn with it
(issue 33). Now each failure is recorded on the shard (`failures`, `error`), the shard waits
`retry_delay` before it runs again (fair share skips it meanwhile), and after
BATCHLLM_MAX_SHARD_FAILURES failures its uncommitted rows become error rows (`shard_failed`)
and the shard ends, so its job ends with the results it has.

A storage that is away for a while (an S3 endpoint failing or unreachable, a full disk:
storage.storage_unavailable) is the deployment's outage, not the shard's fault, as a database
outage is: the shard goes back and runs again after the first backoff step, without using up
its failures. Found by the chaos run's 20-second S3 outage, where three failed commits used up
a shard's failures within seconds and its error rows could not be written either, so its lines
ended with no row at all.
"""

from __future__ import annotations

import logging

from batchllm.errors import ShardBusy
from batchllm.execution.finalize import finalize_job
from batchllm.execution.shard_state import load_shard_state
from batchllm.row_errors import INVALID_REQUEST, SHARD_FAILED
from batchllm.settings import Settings
from batchllm.storage import storage_unavailable
from batchllm.store import leases
from batchllm.store.db import session_scope
from batchllm.store.models import JobStatus, ShardStatus
from batchllm.store.state_machine import count_shard_failure, end_shard

log = logging.getLogger(__name__)

_MAX_RETRY_SECONDS = 600.0
_MAX_MESSAGE = 2000  # characters of the error kept on the shard


def retry_delay(failures: int, settings: Settings) -> float:
    """Seconds before a shard that failed `failures` times runs again: doubling, capped."""
    return min(settings.shard_retry_seconds * 2 ** max(failures - 1, 0), _MAX_RETRY_SECONDS)


def describe(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text[:_MAX_MESSAGE]


def shard_failed(shard_id: int, exc: BaseException, *, worker: str, settings: Settings) -> bool:
    """Record a failed run of the shard. True when it runs again (after its backoff), False
    when it has ended (this failure was its last allowed, or it had ended already)."""
    error = describe(exc)
    if storage_unavailable(exc):
        return _wait_for_storage(shard_id, error, worker=worker, settings=settings)
    with session_scope(settings) as session:
        failures = count_shard_failure(
            session,
            shard_id,
            error,
            worker=worker,
            delay=lambda n: retry_delay(n, settings),
        )
    if failures is None:  # e.g. the runner ended it failed, with this error
        log.error("shard %s: its run failed and it has ended: %s", shard_id, error, exc_info=exc)
        return False
    if failures < settings.max_shard_failures:
        # One line a failure; the traceback with the first only (the same one, most likely).
        log.error(
            "shard %s failed (%d of %d allowed; again in %.0f s): %s",
            shard_id,
            failures,
            settings.max_shard_failures,
            retry_delay(failures, settings),
            error,
            exc_info=exc if failures == 1 else None,
        )
        return True
    message = f"the shard failed {failures} times (BATCHLLM_MAX_SHARD_FAILURES); the last: {error}"
    log.error(
        "shard %s: %s; its remaining rows become error rows",
        shard_id,
        message,
        exc_info=exc if failures == 1 else None,
    )
    return not give_up(shard_id, message, worker=worker, settings=settings)


def _wait_for_storage(shard_id: int, error: str, *, worker: str, settings: Settings) -> bool:
    """The shard's storage is away: the shard goes back, its failures not counted. True when
    it runs again, False when it had ended."""
    wait = retry_delay(1, settings)
    with session_scope(settings) as session:
        failures = count_shard_failure(
            session, shard_id, error, worker=worker, delay=lambda _n: wait, count=False
        )
    if failures is None:
        log.error("shard %s: its run failed and it has ended: %s", shard_id, error)
        return False
    log.warning(
        "shard %s: its storage is unavailable (%s); it runs again in %.0f s (a storage outage "
        "is not counted against BATCHLLM_MAX_SHARD_FAILURES)",
        shard_id,
        error,
        wait,
    )
    return True


def give_up(shard_id: int, message: str, *, worker: str, settings: Settings) -> bool:
    """End the shard: each row it has not committed becomes an error row (an invalid line
    keeps its own error), then the job moves on as after any shard's end. True when the shard
    ended (or another worker runs it after all); False when its storage was away while its
    error rows were written: it then goes back, to run (or give up) again once the storage is back,
    so that no line is left without a row."""
    try:
        with session_scope(settings) as session:
            claimed = leases.claim_shard(session, shard_id, worker, settings.lease_seconds)
            if claimed is None:  # ended meanwhile (e.g. its job was cancelled)
                return True
            attempt, job_id = claimed.attempts, claimed.job_id
    except ShardBusy as exc:  # another worker runs it after all: its run decides
        log.info("%s", exc)
        return True
    try:
        state = load_shard_state(settings, shard_id)
        for row in state.rows():
            if row.kind == "invalid":
                state.buffer.failed(
                    row.custom_id, row.line, row.error or "invalid line", INVALID_REQUEST
                )
            else:
                state.buffer.failed(row.custom_id, row.line, message, SHARD_FAILED)
            if len(state.buffer) >= settings.commit_rows:
                state.commit(settings)
        state.commit(settings)
        status, error = ShardStatus.COMPLETED, message
    except Exception as exc:
        if storage_unavailable(exc):
            return not _wait_for_storage(shard_id, describe(exc), worker=worker, settings=settings)
        # Its rows cannot even be read: the shard (and job) fails.
        log.exception("shard %s: could not write its error rows", shard_id)
        status, error = ShardStatus.FAILED, f"{message}; its rows could not be read: {exc}"
    with session_scope(settings) as session:
        # The job this may end is tidied as the transaction commits (output/commit.py's hook).
        next_step = end_shard(session, shard_id, status, error, attempt=attempt)
    if next_step is JobStatus.FINALIZING:
        finalize_job(job_id, settings=settings, hardware=None, vllm_version=None)
    return True
