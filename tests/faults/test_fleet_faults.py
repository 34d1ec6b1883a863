"""Faults injected into a real fleet in the middle of a job: the private Redis restarted, the
private PostgreSQL stopped for 30 s, an engine process or a whole worker killed with SIGKILL,
a worker killed while it finalizes, and two faults in one job.

Every case checks the same outcome: the job reaches a final state within a bounded time (the
database is polled; a job that makes no progress for STALL seconds fails at once instead of
waiting for the overall deadline), every input line is in the output exactly once, and no `ok`
row has a finish reason other than stop/length or fewer tokens than it asked for (every job
runs with ignore_eos, so an `ok` row cut short by an abort would show). The measured recovery
time of each case goes to the "fault recovery times" table at the end of the run.

The workers live in session-wide pools (tests/faults/conftest.py). The cases about
orchestration (services going away, a worker killed mid-shard or while finalizing, a cancel)
run paced instant-engine workers, which start in seconds. The cases whose subject is the engine
or its processes (an EngineCore killed, a worker's engine processes dying with it) run one vLLM
worker beside an instant partner that takes over what it loses, and are ordered so that as few
engines as possible are built.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import DBAPIError

from batchllm.demo.workload import write_workload
from batchllm.output.parts import MANIFEST_NAME, SUCCESS_NAME
from batchllm.storage import Storage
from batchllm.store import service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus
from tests.support.faults import (
    FaultEnv,
    Pool,
    Worker,
    alive_of,
    kill_recorded,
    run_probe_job,
    wait_for,
)
from tests.support.job_checks import (
    assert_each_line_at_most_once,
    assert_exactly_once,
    checkpoints_of,
    expected_rows,
    load_job,
    output_rows,
)

pytestmark = pytest.mark.faults

ROWS = 2000
SHARD_SIZE = 250  # 8 shards: with two workers, six wait in the queue at first
# Per-line max_tokens spread over a range: rows of a shard finish over its whole run (not all
# at the same step), so a shard is caught with some rows committed and many still to go.
TOKENS = (24, 80)
# Longer rows for the case that must catch one of the job's last two shards part-way (the queue
# is empty only then): a warm pair runs a 250-row shard of TOKENS in ~3 s, too short a window
# for a poll of the database to land in reliably on a busy machine; these make it ~8 s.
LONG_TOKENS = (60, 200)
JOB_TIMEOUT = 400  # the longest any case may take from its fault to the job's end
STALL = 120  # ... and the longest it may make no progress at all (an engine start is 20-90 s)
# A case whose only worker must rebuild its engine makes no progress while it does: 146 s was
# seen with the machine's load at 8 (a rebuild and another session's engine builds at once).
REBUILD_STALL = 420


# -- helpers -------------------------------------------------------------------------------


def workload(
    tmp_path: Path, *, seed: int, tokens: tuple[int, int] = TOKENS, rows: int = ROWS
) -> Path:
    return write_workload(
        tmp_path / f"prompts-{seed}.jsonl", requests=rows, max_tokens=tokens, seed=seed
    )


def asked_tokens(source: Path) -> dict[int, int]:
    return {
        n: json.loads(raw)["max_tokens"]
        for n, raw in enumerate(source.read_text().splitlines(), start=1)
    }


def poll_job(env: FaultEnv, job_id: str) -> tuple[Job, list[Shard]] | None:
    """The job and its shards, or None while the database cannot be reached."""
    try:
        return load_job(env, job_id)
    except DBAPIError:
        return None


def progress_key(job: Job, shards: list[Shard]) -> tuple:
    return (
        job.status,
        job.request_completed,
        job.request_failed,
        job.shards_done,
        tuple((s.status, s.attempts, s.rows_ok + s.rows_failed) for s in shards),
    )


def wait_until_final(
    env: FaultEnv,
    job_id: str,
    workers: list[Worker],
    *,
    timeout: float = JOB_TIMEOUT,
    stall: float = STALL,
    on_poll=None,
) -> tuple[Job, list[Shard]]:
    """Poll until the job is final. Fails after `timeout`, or sooner when nothing about the job
    (state, counts, shard states and attempts) changed for `stall` seconds."""
    deadline = time.monotonic() + timeout
    last_key, last_change = None, time.monotonic()
    while True:
        polled = poll_job(env, job_id)
        now = time.monotonic()
        if on_poll is not None:
            on_poll(polled)
        if polled is not None:
            job, shards = polled
            if job.status.is_final:
                return job, shards
            key = progress_key(job, shards)
            if key != last_key:
                last_key, last_change = key, now
        if now - last_change > stall or now > deadline:
            state = "unreachable database" if polled is None else describe(*polled)
            why = (
                f"made no progress for {stall:.0f}s"
                if now - last_change > stall
                else f"did not end within {timeout:.0f}s"
            )
            raise AssertionError(f"job {job_id} {why}: {state}")
        time.sleep(0.5)


def describe(job: Job, shards: list[Shard]) -> str:
    parts = [
        f"{s.index}:{s.status.value}/{s.worker}/a{s.attempts}/{s.rows_ok + s.rows_failed}of{s.rows}"
        for s in shards
    ]
    return (
        f"{job.status.value}, {job.request_completed + job.request_failed} of "
        f"{job.request_total} rows, shards {job.shards_done}/{job.shards_total} done "
        f"[{' '.join(parts)}]"
    )


def running_shard(
    env: FaultEnv, job_id: str, workers: list[Worker], *, min_done: int = 60, min_left: int = 100
) -> Shard | None:
    """A running shard on one of `workers` with some rows committed and many still to go."""
    polled = poll_job(env, job_id)
    if polled is None:
        return None
    job, shards = polled
    assert not job.status.is_final, f"the job ended before the fault: {describe(job, shards)}"
    names = {w.name for w in workers}
    for shard in shards:
        done = shard.rows_ok + shard.rows_failed
        if (
            shard.status is ShardStatus.RUNNING
            and shard.worker in names
            and min_done <= done <= shard.rows - min_left
        ):
            return shard
    return None


def wait_mid_shard(env: FaultEnv, job_id: str, workers: list[Worker], **kwargs) -> Shard:
    return wait_for(
        lambda: running_shard(env, job_id, workers, **kwargs),
        timeout=240,
        what="a shard part-way through (some rows committed, many to go)",
        interval=0.1,
    )


def by_name(workers: list[Worker]) -> dict[str, Worker]:
    return {w.name: w for w in workers}


def assert_rows_are_results(rows: list[dict], asked: dict[int, int]) -> None:
    """`ok` rows are real results: stop/length, never an aborted request's partial output."""
    wrong = [
        r for r in rows if r["status"] == "ok" and r["finish_reason"] not in ("stop", "length")
    ]
    assert not wrong, (
        f"{len(wrong)} ok rows with finish_reason {wrong[0]['finish_reason']!r}: {wrong[0]}"
    )
    short = [r for r in rows if r["status"] == "ok" and r["completion_tokens"] != asked[r["line"]]]
    assert not short, (
        f"{len(short)} ok rows (ignore_eos) with fewer tokens than asked, e.g. "
        f"line {short[0]['line']}: {short[0]['completion_tokens']} of "
        f"{asked[short[0]['line']]}"
    )


def assert_completed_exactly_once(
    env: FaultEnv, job: Job, shards: list[Shard], source: Path, workers: list[Worker]
) -> list[dict]:
    assert job.status is JobStatus.COMPLETED, f"job {job.status.value}: {job.error}; " + describe(
        job, shards
    )
    rows = output_rows(env, job.id)
    assert_exactly_once(rows, expected_rows(source))
    assert_rows_are_results(rows, asked_tokens(source))
    assert job.request_completed + job.request_failed == job.request_total == len(rows)
    assert [s.status for s in shards] == [ShardStatus.COMPLETED] * len(shards)
    storage = Storage.of(env.settings)
    assert storage.exists(f"{storage.output_dir(job.id)}/{SUCCESS_NAME}")
    return rows


def committed_lines(env: FaultEnv, shard_id: int) -> set[int]:
    from batchllm.output.parts import read_lines

    storage = Storage.of(env.settings)
    lines: set[int] = set()
    for checkpoint in checkpoints_of(env, shard_id):
        lines.update(read_lines(storage, checkpoint.path))
    return lines


def end_active_jobs(env: FaultEnv) -> None:
    """Leave nothing running for the next case: cancel what is still active (live workers
    abort within a second), then end by hand whatever is left."""
    try:
        with session_scope(env.settings) as session:
            active = list(
                session.scalars(select(Job.id).where(Job.status.in_(state_machine.ACTIVE)))
            )
        for job_id in active:
            try:
                with session_scope(env.settings) as session:
                    service.cancel_job(session, job_id)
            except Exception:
                pass
        deadline = time.monotonic() + 15
        while active and time.monotonic() < deadline:
            with session_scope(env.settings) as session:
                active = list(
                    session.scalars(select(Job.id).where(Job.status.in_(state_machine.ACTIVE)))
                )
            time.sleep(0.5)
        with session_scope(env.settings) as session:
            session.execute(
                update(Shard)
                .where(Shard.status.in_([ShardStatus.QUEUED, ShardStatus.RUNNING]))
                .values(status=ShardStatus.CANCELLED)
            )
            session.execute(
                update(Job)
                .where(Job.status.in_(state_machine.ACTIVE))
                .values(status=JobStatus.CANCELLED, error="ended by the fault suite's clean-up")
            )
    except DBAPIError:
        pass


def instant_workers(pool: Pool, engine_pool: Pool, count: int) -> list[Worker]:
    """`count` instant-engine workers, and no vLLM worker left to take the case's shards."""
    engine_pool.ensure(0)
    return pool.ensure(count)


def engine_and_partner(pool: Pool, engine_pool: Pool) -> tuple[Worker, Worker]:
    """A vLLM worker (the case's subject) and an instant-engine partner on the same queue,
    which takes over what the vLLM worker loses. The vLLM worker is proven alone first."""
    pool.ensure(0)
    (engine_worker,) = engine_pool.ensure(1)
    (partner,) = pool.ensure(1)
    return engine_worker, partner


@pytest.fixture(autouse=True)
def settle(request, fault_env: FaultEnv, pool: Pool, engine_pool: Pool):
    """After each case: both services up again, no job left running; after a failed case the
    workers are proven (or replaced) before the next case relies on them."""
    yield
    if not fault_env.redis.running():
        fault_env.redis.start()
    if not fault_env.postgres.running():
        fault_env.postgres.start()
    end_active_jobs(fault_env)
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        pool.suspect = engine_pool.suspect = True


# -- the cases -----------------------------------------------------------------------------


class TestPrivateFleet:
    """The harness itself: the private services and a warm pair run a job to completion."""

    def test_a_pair_of_workers_completes_a_job_on_the_private_redis_and_postgres(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        pair = instant_workers(pool, engine_pool, 2)
        assert fault_env.redis.port not in (6379,) and fault_env.postgres.port != 5432
        source = workload(tmp_path, seed=10)
        started = time.monotonic()
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=max(TOKENS))
        assert (job.shards_total, job.request_total) == (8, ROWS)
        job, shards = wait_until_final(fault_env, job.id, pair)
        took = time.monotonic() - started
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        assert {s.worker for s in shards} == {w.name for w in pair}
        recovery(
            "no fault: submit to completed",
            took,
            f"baseline: {ROWS} rows, 8 shards, {job.output_tokens_per_s:.0f} out tok/s",
        )


class TestServiceOutages:
    """A warm pair; Redis and PostgreSQL go away and come back while a job runs."""

    def test_a_redis_restart_while_shard_tasks_wait_in_the_queue_loses_no_shard(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        pair = instant_workers(pool, engine_pool, 2)
        source = workload(tmp_path, seed=11)
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=max(TOKENS))

        def tasks_waiting():
            polled = poll_job(fault_env, job.id)
            running = polled and sum(s.status is ShardStatus.RUNNING for s in polled[1])
            return running and fault_env.queue_length() >= 3

        wait_for(
            tasks_waiting, timeout=240, what="running shards with tasks still queued", interval=0.1
        )
        waiting = fault_env.queue_length()
        fault_at = fault_env.redis.restart()
        assert fault_env.queue_length() == 0, "the restart kept the queued tasks"

        job, shards = wait_until_final(fault_env, job.id, pair)
        took = time.monotonic() - fault_at
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        recovery("redis restart -> completed", took, f"{waiting} queued tasks were lost")

    def test_a_redis_restart_while_shards_run_loses_no_row(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        pair = instant_workers(pool, engine_pool, 2)
        source = workload(tmp_path, seed=12, tokens=LONG_TOKENS)
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=max(LONG_TOKENS))

        def running_with_none_queued():
            # No shard waits for a task: every one runs or is done. (A running shard's own task
            # may still sit in the queue: a worker may run it in another task's turn, fair
            # share and affinity, and that task then steps aside; the restart forgets it.)
            shard = running_shard(fault_env, job.id, pair, min_done=1, min_left=60)
            polled = poll_job(fault_env, job.id) if shard else None
            if polled is None or any(s.status is ShardStatus.QUEUED for s in polled[1]):
                return None
            return shard

        shard = wait_for(
            running_with_none_queued,
            timeout=300,
            interval=0.1,
            what="a shard running part-way with no shard left queued",
        )
        fault_at = fault_env.redis.restart()

        job, shards = wait_until_final(fault_env, job.id, pair)
        took = time.monotonic() - fault_at
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        recovery(
            "redis restart -> completed",
            took,
            f"shard {shard.index} was running ({shard.rows_ok} of {shard.rows} rows)",
        )

    def test_postgresql_down_for_30_seconds_mid_job_loses_no_row(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        pair = instant_workers(pool, engine_pool, 2)
        source = workload(tmp_path, seed=13)
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=max(TOKENS))
        wait_mid_shard(fault_env, job.id, pair)
        before, _ = load_job(fault_env, job.id)
        done_before = before.request_completed + before.request_failed

        stopped_at = time.monotonic()
        fault_env.postgres.stop()
        time.sleep(max(0.0, 30 - (time.monotonic() - stopped_at)))  # the outage itself
        fault_env.postgres.start()
        back_at = time.monotonic()
        resumed: list[float] = []

        def note_resume(polled):
            if (
                not resumed
                and polled is not None
                and polled[0].request_completed + polled[0].request_failed > done_before
            ):
                resumed.append(time.monotonic() - back_at)

        job, shards = wait_until_final(fault_env, job.id, pair, on_poll=note_resume)
        took = time.monotonic() - back_at
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        recovery("postgres back -> rows committed again", resumed[0] if resumed else None)
        alive = [w.name for w in pair if w.alive()]
        recovery(
            "postgres back -> completed",
            took,
            f"outage {back_at - stopped_at:.0f}s; workers alive after: {alive}",
        )


class TestEngineLoss:
    """kill -9 of a worker's VLLM::EngineCore process (the engine dies, the worker lives). The
    vLLM worker that rebuilds its engine in the first case is the one of the next cases (the
    second and TestWorkerLoss's first), so each kill costs one engine build, not two."""

    def test_a_killed_engine_loses_no_row_and_its_worker_serves_again_or_exits(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        victim, partner = engine_and_partner(pool, engine_pool)
        pair = [victim, partner]
        source = workload(tmp_path, seed=14)
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=max(TOKENS))
        # Any running shard of the vLLM worker with rows still to go: it generates a shard's 250
        # rows in one batch and commits them at 100, 200 and 250 within a fraction of a second
        # on an idle machine, so "some rows committed" can pass between two polls (it did once,
        # and the job ended before the fault). Rows in flight are what an engine kill loses.
        shard = wait_mid_shard(fault_env, job.id, [victim], min_done=0, min_left=1)
        core = victim.engine_core()
        assert core is not None, f"no EngineCore process under {victim.name}"
        victim.record_descendants()
        core.kill()
        killed_at = time.monotonic()

        job, shards = wait_until_final(fault_env, job.id, pair)
        took = time.monotonic() - killed_at
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        recovery(
            "engine kill -> completed", took, f"engine of {victim.name} on shard {shard.index}"
        )

        # The worker whose engine died must not sit alive and idle: it serves the next job
        # (rebuilding its engine) or it has exited with an error for its supervisor to see.
        if victim.alive():
            # The probe job goes to the victim alone: beside its instant partner it proved
            # nothing on a busy machine (the partner ran every shard while the victim was still
            # rebuilding its engine). The pool starts a new partner for the next case.
            partner.stop(grace=10)
            pool.drop_dead()
            used = run_probe_job(fault_env, 1, timeout=600, workers=[victim], unless_exits=victim)
            assert victim.name in used or not victim.alive(), (
                f"{victim.name} is alive but took no shard of the next job"
            )
        if not victim.alive():
            assert victim.proc.returncode != 0, (
                f"{victim.name} exited with 0 after losing its engine"
            )
            recovery(
                "engine kill: worker outcome",
                None,
                f"{victim.name} exited with {victim.proc.returncode}",
            )
        else:
            recovery(
                "engine kill: worker outcome",
                None,
                f"{victim.name} rebuilt its engine and served the next job",
            )

    def test_with_one_worker_a_killed_engine_still_lets_the_job_complete(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        """The only worker loses its engine mid-shard. It rebuilds its engine, or it exits
        non-zero and the test restarts it, as its supervisor (systemd, Kubernetes) would."""
        pool.ensure(0)
        (solo,) = engine_pool.ensure(1)
        source = workload(tmp_path, seed=19)
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=max(TOKENS))
        wait_mid_shard(fault_env, job.id, [solo])
        core = solo.engine_core()
        assert core is not None, f"no EngineCore process under {solo.name}"
        solo.record_descendants()
        core.kill()
        killed_at = time.monotonic()
        restarts: list[str] = []
        current = [solo]

        def supervise(_polled):
            worker = current[0]
            if not worker.alive():
                code = worker.proc.returncode
                assert code != 0, f"{worker.name} exited with 0 with a job left"
                restarts.append(f"{worker.name} exited with {code}")
                current[0] = engine_pool.replace(worker)

        job, shards = wait_until_final(
            fault_env,
            job.id,
            current,
            on_poll=supervise,
            stall=REBUILD_STALL,
            timeout=JOB_TIMEOUT + REBUILD_STALL,
        )
        took = time.monotonic() - killed_at
        assert_completed_exactly_once(fault_env, job, shards, source, current)
        recovery(
            "one worker, engine kill -> completed",
            took,
            "; ".join(restarts) + " -> restarted by the test"
            if restarts
            else f"{solo.name} rebuilt its engine (no restart)",
        )


class TestWorkerLoss:
    """kill -9 of a worker's main process mid-shard, as an OOM killer would."""

    def test_a_worker_killed_mid_shard_loses_no_row_and_leaves_no_engine_process(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        victim, survivor = engine_and_partner(pool, engine_pool)
        pair = [victim, survivor]
        # LONG_TOKENS: the vLLM worker's shard has 3-4 s to go when it is found with a
        # checkpoint in, not the ~1 s of TOKENS, which a busy machine's stall of the test process
        # once outlasted (the found shard was completed by the victim before the kill came).
        # 1,000 rows: the paced partner's LONG_TOKENS shards take ~10 s each.
        source = workload(tmp_path, seed=15, tokens=LONG_TOKENS, rows=1000)
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=max(LONG_TOKENS))
        wait_mid_shard(fault_env, job.id, [victim], min_done=1, min_left=100)
        children = victim.record_descendants()
        assert any("VLLM" in t or "EngineCore" in t for t in alive_of(children).values()), (
            f"no engine process recorded under {victim.name}: {alive_of(children)}"
        )
        killed_at = victim.kill_main()
        # The shard it held when it died: the found one, or (after a stall of this process) the
        # next it took. Read at once: no other worker claims it before its lease runs out.
        held = [
            s
            for s in load_job(fault_env, job.id)[1]
            if s.status is ShardStatus.RUNNING and s.worker == victim.name
        ]

        # Its engine processes must die with it, not live on under PID 1.
        gone_after = None
        deadline = killed_at + 30
        while time.monotonic() < deadline:
            if not alive_of(children):
                gone_after = time.monotonic() - killed_at
                break
            time.sleep(0.25)
        orphans = alive_of(children)
        orphan_parents = {pid: _ppid(pid) for pid in orphans}
        kill_recorded(children)  # whatever the verdict, they must not slow the rest down
        assert held, f"{victim.name} held no shard when it was killed: the case needs one"
        (shard,) = held

        job, shards = wait_until_final(fault_env, job.id, pair)
        took = time.monotonic() - killed_at
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        taken = next(s for s in shards if s.id == shard.id)
        assert taken.attempts >= 2 and taken.worker == survivor.name, (taken.attempts, taken.worker)
        recovery(
            "worker kill -> completed",
            took,
            f"{victim.name} killed on shard {shard.index}, "
            f"{shard.rows_ok + shard.rows_failed} of {shard.rows} rows committed",
        )
        recovery(
            "worker kill -> its engine processes gone",
            gone_after,
            f"{len(children)} children recorded",
        )
        assert not orphans, (
            f"30 s after kill -9 of {victim.name}, its engine processes still "
            f"ran: {orphans} (parents {orphan_parents})"
        )

    def test_a_worker_whose_engine_core_runs_in_it_killed_mid_shard_loses_no_row(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        """batchllm's default for a one-device engine: vLLM's engine core in the worker's own
        process (engine/start_settings.py), so the engine's death is the worker's. kill -9 of
        such a worker mid-shard: the partner runs the shard again, every line once, and there
        was no engine process to outlive it."""
        engine_pool.ensure(0)  # its build and this one's would share the two cores
        log_dir = tmp_path / "in-process-worker"
        log_dir.mkdir()
        in_process = Pool(fault_env, log_dir, label="in-process")
        try:
            (victim,) = in_process.ensure(1)
            (partner,) = pool.ensure(1)
            pair = [victim, partner]
            source = workload(tmp_path, seed=21)
            job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=max(TOKENS))
            shard = wait_mid_shard(fault_env, job.id, [victim], min_done=0, min_left=1)
            children = alive_of(victim.record_descendants())
            assert not [t for t in children.values() if "VLLM" in t or "EngineCore" in t], children
            killed_at = victim.kill_main()

            job, shards = wait_until_final(fault_env, job.id, pair)
            assert_completed_exactly_once(fault_env, job, shards, source, pair)
            recovery(
                "in-process engine: worker kill -> completed",
                time.monotonic() - killed_at,
                f"{victim.name} killed on shard {shard.index}",
            )
        finally:
            in_process.stop_all()

    def test_cancelling_a_job_whose_worker_was_killed_ends_it_cancelled_and_keeps_its_rows(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        pair = instant_workers(pool, engine_pool, 2)
        workers = by_name(pair)
        source = workload(tmp_path, seed=16, tokens=(48, 120))
        expected = expected_rows(source)
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=120)
        shard = wait_mid_shard(fault_env, job.id, pair)
        victim = workers[shard.worker]
        victim.kill_main()
        kept_by_victim = committed_lines(fault_env, shard.id)

        cancelled_at = time.monotonic()
        result = fault_env.cli("cancel", job.id)
        assert result.returncode == 0, result.stderr
        assert job.id in result.stdout

        job, shards = wait_until_final(fault_env, job.id, pair, timeout=90, stall=90)
        took = time.monotonic() - cancelled_at
        assert job.status is JobStatus.CANCELLED, f"job {job.status.value}: {job.error}"
        rows = output_rows(fault_env, job.id)
        assert_each_line_at_most_once(rows, expected)
        assert_rows_are_results(rows, asked_tokens(source))
        assert len(rows) == job.request_completed + job.request_failed
        assert kept_by_victim and kept_by_victim <= {r["line"] for r in rows}, (
            "rows the killed worker had committed were dropped"
        )
        assert {s.status for s in shards} <= {ShardStatus.COMPLETED, ShardStatus.CANCELLED}
        storage = Storage.of(fault_env.settings)
        assert not storage.exists(f"{storage.output_dir(job.id)}/{SUCCESS_NAME}")
        recovery(
            "cancel (dead worker) -> cancelled",
            took,
            f"kept {len(rows)} rows, {len(kept_by_victim)} of them from {victim.name}",
        )

    def test_two_faults_in_one_job_a_worker_kill_and_a_redis_restart_lose_no_row(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        pair = instant_workers(pool, engine_pool, 2)
        workers = by_name(pair)
        source = workload(tmp_path, seed=17)
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=max(TOKENS))

        def mid_shard_with_tasks_queued():
            shard = running_shard(fault_env, job.id, pair)
            return shard if shard and fault_env.queue_length() >= 1 else None

        shard = wait_for(
            mid_shard_with_tasks_queued,
            timeout=240,
            interval=0.1,
            what="a shard part-way with tasks still queued",
        )
        victim = workers[shard.worker]
        killed_at = victim.kill_main()
        fault_env.redis.restart()

        job, shards = wait_until_final(fault_env, job.id, pair)
        took = time.monotonic() - killed_at
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        recovery(
            "worker kill + redis restart -> completed",
            took,
            f"{victim.name} killed on shard {shard.index}, then Redis lost its tasks",
        )

    def test_a_job_whose_worker_is_killed_while_finalizing_is_finalized_by_the_reconciler(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        """A worker killed between the job's move to `finalizing` and its completion.

        Made deterministic with a gate in the private PostgreSQL: a trigger on `jobs` holds any
        UPDATE that moves this job out of `finalizing` (in a pg_sleep loop) while the job's id
        is in the table `fault_gate`. The job runs normally; the worker that ends its last shard
        moves it to `finalizing` and then blocks in its completing UPDATE, inside its
        transaction. The test finds that waiting backend in pg_stat_activity, maps its client
        port to the worker process, and kills that process with SIGKILL. The server notices the
        dead client within a second (client_connection_check_interval), rolls back its
        transaction and drops its locks: the job is left `finalizing` with no worker finishing
        it, as after a crash mid-finalization. Then the gate opens: the other worker's
        reconciler must finalize the job (completed, _SUCCESS, a manifest counting every line).
        Whether the killed worker had already written `_SUCCESS` when it died depends on where
        its completing UPDATE is flushed; the test reports it in the recovery table.
        """
        pair = instant_workers(pool, engine_pool, 2)
        source = workload(tmp_path, seed=18, tokens=(8, 24))
        job = fault_env.submit(source, shard_size=SHARD_SIZE, max_tokens=24)
        with fault_env.postgres.connect() as conn:
            install_finalize_gate(conn)
            conn.execute("INSERT INTO fault_gate (job_id) VALUES (%s)", (job.id,))
            try:

                def held():
                    polled = poll_job(fault_env, job.id)
                    assert polled and not polled[0].status.is_final, (
                        "the job ended without passing the gate: "
                        + (describe(*polled) if polled else "?")
                    )
                    rows = conn.execute(
                        "SELECT pid, client_port FROM pg_stat_activity WHERE "
                        "wait_event = 'PgSleep' AND datname = current_database() "
                        "ORDER BY xact_start"
                    ).fetchall()
                    return rows if polled[0].status is JobStatus.FINALIZING and rows else None

                # The first to wait is the worker that ended the last shard (a reconciler
                # that came later waits behind it, on the job's row lock).
                backend, port = wait_for(
                    held, timeout=300, interval=0.2, what="a worker held in the job's completion"
                )[0]
                victim = worker_on_port(pair, port, fault_env.postgres.port)
                assert victim is not None, f"no worker owns the waiting connection :{port}"
                _, shards = load_job(fault_env, job.id)
                last_ender = max(shards, key=lambda s: s.finished_at).worker
                victim.kill_main()
                killed_at = time.monotonic()
                wait_for(
                    lambda: (
                        not conn.execute(
                            "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (backend,)
                        ).fetchone()
                    ),
                    timeout=15,
                    what="the killed worker's backend to end",
                )
                stuck, _ = load_job(fault_env, job.id)
                assert stuck.status is JobStatus.FINALIZING, stuck.status
                storage = Storage.of(fault_env.settings)
                early_success = storage.exists(f"{storage.output_dir(job.id)}/{SUCCESS_NAME}")
            finally:
                conn.execute("DELETE FROM fault_gate")
            opened_at = time.monotonic()
            try:
                job, shards = wait_until_final(fault_env, job.id, pair, timeout=120, stall=120)
            finally:
                conn.execute("DROP TRIGGER IF EXISTS fault_gate_hold ON jobs")
        took = time.monotonic() - opened_at
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        manifest = json.loads(storage.read_bytes(f"{storage.output_dir(job.id)}/{MANIFEST_NAME}"))
        assert manifest["status"] == "completed"
        assert manifest["rows"]["total"] == ROWS
        assert manifest["rows"]["ok"] + manifest["rows"]["error"] == ROWS
        recovery(
            "killed while finalizing -> completed",
            took,
            f"{victim.name} (ended the last shard: {last_ender}) killed "
            f"{opened_at - killed_at:.1f}s before the gate opened; _SUCCESS "
            f"{'already' if early_success else 'not yet'} written then",
        )


# -- gate and process helpers --------------------------------------------------------------


def install_finalize_gate(conn) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS fault_gate (job_id text PRIMARY KEY)")
    conn.execute("""
        CREATE OR REPLACE FUNCTION fault_gate_hold() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            WHILE EXISTS (SELECT 1 FROM fault_gate WHERE job_id = NEW.id) LOOP
                PERFORM pg_sleep(0.2);
            END LOOP;
            RETURN NEW;
        END $$""")
    conn.execute("DROP TRIGGER IF EXISTS fault_gate_hold ON jobs")
    conn.execute("""
        CREATE TRIGGER fault_gate_hold BEFORE UPDATE ON jobs FOR EACH ROW
        WHEN (OLD.status = 'finalizing' AND NEW.status IS DISTINCT FROM 'finalizing')
        EXECUTE FUNCTION fault_gate_hold()""")


def worker_on_port(workers: list[Worker], client_port: int, server_port: int) -> Worker | None:
    """The worker whose process holds the TCP connection from `client_port` to the server."""
    for conn in psutil.net_connections(kind="tcp"):
        if (
            conn.laddr
            and conn.laddr.port == client_port
            and conn.raddr
            and conn.raddr.port == server_port
        ):
            for worker in workers:
                if conn.pid == worker.pid or conn.pid in {
                    p.pid for p in psutil.Process(worker.pid).children(recursive=True)
                }:
                    return worker
    return None


def _ppid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


# -- the drain on SIGTERM (preemptible fleets) -------------------------------------------------

DRAIN_ENDED = re.compile(
    r"drain ended \((?P<why>[a-z ]+)\) after (?P<seconds>[\d.]+) s: (?P<saved>\d+) of "
    r"(?P<generating>\d+) rows generating finished and are committed, (?P<aborted>\d+) aborted; "
    r"with the (?P<unstarted>\d+) not started"
)


def drain_of(worker: Worker) -> dict[str, str]:
    found = list(DRAIN_ENDED.finditer(worker.log()))
    assert len(found) == 1, f"expected one drain in {worker.name}'s log:\n" + worker.tail()
    return found[0].groupdict()


def shard_of(env: FaultEnv, shard_id: int) -> Shard:
    with session_scope(env.settings) as session:
        shard = session.get(Shard, shard_id)
        session.expunge(shard)
        return shard


class TestDrain:
    """SIGTERM to a busy worker (a spot notice, a scale-down, a deploy): the rows generating
    finish within --drain-seconds (20 s, the pool's default) and are committed, the rows not
    started go back at once, the worker exits 0 and the other takes the shard over. Paced
    instant workers: at 50 ms a token, the LONG_TOKENS rows generate for 3-10 s each. That a
    vLLM worker's engine processes end with it on SIGTERM is test_serve_signals' subject (serve
    stops its worker with SIGTERM); the warm stop needs no engine of its own here."""

    def test_sigterm_mid_generation_commits_the_generating_rows_then_hands_back_and_exits(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        pair = instant_workers(pool, engine_pool, 2)
        # Two shards of 500, one a worker: the victim's has ~250 rows generating at a time.
        source = workload(tmp_path, seed=31, tokens=LONG_TOKENS, rows=1000)
        job = fault_env.submit(source, shard_size=500, max_tokens=max(LONG_TOKENS))
        shard = wait_mid_shard(fault_env, job.id, pair, min_left=250)
        victim = by_name(pair)[shard.worker]
        (survivor,) = [w for w in pair if w is not victim]
        before = committed_lines(fault_env, shard.id)

        stopped_at = time.monotonic()
        victim.terminate()
        code = victim.proc.wait(timeout=60)
        exited = time.monotonic() - stopped_at

        assert code == 0, victim.tail()
        assert exited < 30, f"exited {exited:.1f} s after SIGTERM:\n" + victim.tail()
        drain = drain_of(victim)
        saved, generating = int(drain["saved"]), int(drain["generating"])
        assert saved > 0 and generating > 0, drain
        assert saved + int(drain["aborted"]) == generating, drain
        after = committed_lines(fault_env, shard.id)
        assert before <= after and len(after) >= len(before) + saved, (len(before), len(after))
        left = shard_of(fault_env, shard.id)
        assert not (left.status is ShardStatus.RUNNING and left.worker == victim.name), (
            "the shard was left running on the stopped worker"
        )
        wait_for(
            lambda: shard_of(fault_env, shard.id).worker == survivor.name,
            timeout=240,
            what="the other worker to take the shard over",
        )
        resumed_after = time.monotonic() - stopped_at

        job, shards = wait_until_final(fault_env, job.id, pair)
        took = time.monotonic() - stopped_at
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        taken = next(s for s in shards if s.id == shard.id)
        assert taken.attempts >= 2 and taken.worker == survivor.name, (taken.attempts, taken.worker)
        note = (
            f"{saved} of {generating} generating rows saved by the drain ({drain['why']}) in "
            f"{drain['seconds']} s, {drain['unstarted']} not started handed back"
        )
        recovery("SIGTERM (drain) -> worker exited 0", exited, note)
        recovery("SIGTERM (drain) -> shard resumed elsewhere", resumed_after, survivor.name)
        recovery("SIGTERM (drain) -> completed", took, f"{victim.name} on shard {shard.index}")

    def test_a_second_sigterm_cuts_the_drain_short(
        self, pool, engine_pool, fault_env, tmp_path, recovery
    ):
        pair = instant_workers(pool, engine_pool, 2)
        # Rows of 5-15 s, a shard of 150 a worker (all generating at once): when the second
        # SIGTERM comes, 2 s into the drain, most of the victim's rows have seconds to go.
        tokens = (100, 300)
        source = workload(tmp_path, seed=32, tokens=tokens, rows=300)
        job = fault_env.submit(source, shard_size=150, max_tokens=max(tokens))
        shard = wait_mid_shard(fault_env, job.id, pair, min_done=1, min_left=50)
        victim = by_name(pair)[shard.worker]

        stopped_at = time.monotonic()
        victim.terminate()
        # A signal within a second of the first is taken for the same stop echoed (a terminal
        # signals the whole group; process/stopping.py): the second comes after that.
        wait_for(
            lambda: (
                "stop requested: draining" in victim.log() and time.monotonic() - stopped_at > 2
            ),
            timeout=30,
            what="the drain to begin",
        )
        second_at = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)  # terminate() sends one SIGTERM only
        code = victim.proc.wait(timeout=60)
        exited = time.monotonic() - stopped_at

        assert code == 0, victim.tail()
        # Well before the 20 s drain would have ended: commit, hand back, engine shutdown.
        assert time.monotonic() - second_at < 15, victim.tail()
        drain = drain_of(victim)
        assert drain["why"] == "cut short" and int(drain["aborted"]) > 0, drain
        job, shards = wait_until_final(fault_env, job.id, pair)
        assert_completed_exactly_once(fault_env, job, shards, source, pair)
        recovery(
            "second SIGTERM -> worker exited 0",
            exited,
            f"drain cut short after {drain['seconds']} s: {drain['saved']} saved, "
            f"{drain['aborted']} aborted",
        )
