"""`batchllm worker --engine instant` (the fleet simulation's worker) runs a real job through the
real Redis, PostgreSQL and Celery worker process, without vLLM, and says everywhere that it is
a simulation; and the fleet bench part measures a small fleet of them end to end."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchllm.demo.workload import write_workload
from batchllm.input.token_store import token_path
from batchllm.storage import Storage
from batchllm.store.models import JobStatus, ShardStatus
from batchllm.worker.registry import live_workers
from tests.support.fleet import INSTANT_ARGS, Worker, start_workers, stop_workers
from tests.support.inputs import source_of
from tests.support.job_checks import (
    assert_exactly_once,
    expected_rows,
    load_job,
    output_rows,
    wait_until_final,
)
from tests.support.skips import require

pytestmark = pytest.mark.integration


def _instant_workers(
    names: list[str], fleet_env, tiny_model: Path, tmp_path: Path, *flags: str
) -> list[Worker]:
    """Instant-engine workers on the tiny model (`flags`: more worker options), ready."""
    return start_workers(
        names,
        fleet_env=fleet_env,
        model=tiny_model,
        log_dir=tmp_path,
        engine_args=(*INSTANT_ARGS, *flags),
        ready_timeout=120,
    )


def _mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_an_instant_worker_runs_a_job_exactly_once_through_celery_and_labels_it_instant(
    fleet_env, tiny_model, tmp_path
):
    (worker,) = _instant_workers(["instant1"], fleet_env, tiny_model, tmp_path)
    try:
        source = write_workload(
            tmp_path / "prompts.jsonl",
            requests=600,
            max_tokens=(4, 16),
            forms=("prompt", "chat", "openai_chat"),
            bad_lines=3,
            seed=5,
        )
        expected = expected_rows(source)
        job = fleet_env.submit(source, tiny_model, shard_size=200, max_tokens=16)
        assert job.shards_total == 3

        job = wait_until_final(fleet_env, job.id, timeout=120)
        job, shards = load_job(fleet_env, job.id)
        assert job.status is JobStatus.COMPLETED, job.error
        assert_exactly_once(output_rows(fleet_env, job.id), expected)
        assert {s.status for s in shards} == {ShardStatus.COMPLETED}
        worker_node = "celery@instant1"
        assert {s.worker for s in shards} == {worker_node}
        # Labelled: the job's hardware, `status`, the worker's log and its announced profile.
        assert job.hardware == "none (instant engine)"
        status = fleet_env.cli("status", job.id)
        assert status.returncode == 0, status.stderr
        assert "none (instant engine)" in status.stdout
        assert "INSTANT ENGINE (simulation)" in worker.log()
        # This worker's entry: a worker an earlier test killed stays listed until its key expires.
        (announced,) = [
            w for w in live_workers(fleet_env.settings.broker_url) if w["node"] == worker_node
        ]
        assert announced["engine"]["dtype"] == "instant"
        # No vLLM and no torch in the worker: a simulated fleet costs no GPU stack.
        libraries = _mapped_libraries(worker.pid)
        assert "libtorch" not in libraries and "vllm" not in libraries
    finally:
        stop_workers([worker])


def test_the_fleet_bench_measures_two_instant_workers_on_private_services(tiny_model, tmp_path):
    from benchmarks.fleet import measure_fleet
    from benchmarks.private_postgres import postgres_bin

    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    require(postgres_bin() is not None, "PostgreSQL's server binaries (initdb, pg_ctl) are missing")
    figures = measure_fleet(
        tmp_path,
        model=str(tiny_model),
        workers=[2],
        lines=2000,
        shard_size=250,
        concurrent_jobs=2,
        max_connections=100,
        unsized=True,
        submit_modes=["never", "always"],
        say=lambda _text: None,
    )
    (run,) = figures["runs"]
    # The same jobs with the submit tokenizing never and always: a worker sizes the unsized
    # job only when the submit did not (by default, `auto`, a job of 2,000 lines is too small
    # for the submit to size: AUTO_MIN_ROWS).
    modes = run["submit_modes"]
    assert modes["never"]["one_job_unsized"]["sizing_passes"] == 1
    assert modes["always"]["one_job_unsized"]["sizing_passes"] == 0
    assert run["one_job_unsized"]["sizing_passes"] == 1
    for mode in modes.values():
        assert mode["one_job"]["rows"] == mode["one_job_unsized"]["rows"] == 2000
    one, several = run["one_job"], run["concurrent_jobs"]
    assert (one["rows"], one["shards"], one["checkpoints"]) == (2000, 8, 8)
    assert (several["jobs"], several["rows"]) == (2, 2000)
    assert one["task_outcomes"]["completed"] == 8
    assert 0 < one["first_row_s"] <= one["completed_s"]
    assert 0 < one["pg_connections_peak"] <= 100
    assert one["redis_commands_per_shard"] > 0
    # Where a row's CPU went, submit included, and the share of the workers' time between shards.
    assert set(one["cpu_us_per_row"]) == {"submit", "workers", "postgres", "redis"}
    assert one["cpu_us_per_row"]["submit"] > 0 and one["cpu_us_per_row"]["workers"] > 0
    assert 0 <= one["worker_idle_share"] < 1
    assert run["reconciler_pass"]["resent"] == 0


def test_the_idle_share_counts_each_workers_time_between_its_shards():
    from benchmarks.fleet import idle_share

    # w1 runs 0-1 and 1.5-2.5 (0.5 s idle of 2.5); w2 runs 0-2 (no gap): 0.5 / 4.5.
    runs = [("w1", 1.5, 2.5), ("w1", 0.0, 1.0), ("w2", 0.0, 2.0)]
    assert idle_share(runs) == round(0.5 / 4.5, 3)
    assert idle_share([]) is None


def test_the_first_shard_bench_times_a_streamed_and_a_whole_file_submit(tmp_path, monkeypatch):
    """benchmarks/first_shard.py on a private Redis: both submits leave one task per shard there
    (the bench refuses its figures otherwise); the streamed one queued its first shard before
    the rest of the file was stored, the other only after."""
    from benchmarks import first_shard

    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    monkeypatch.setattr(first_shard, "SHARD_SIZE", 5_000)
    figures = first_shard.measure(30_000, tmp_path)

    streamed, whole = figures["streamed"], figures["queued_after_validation"]
    assert (
        (streamed["lines"], streamed["shards"])
        == (whole["lines"], whole["shards"])
        == (
            30_000,
            6,
        )
    )
    assert streamed["status_when_submit_returned"] == whole["status_when_submit_returned"]
    assert streamed["status_when_submit_returned"] == JobStatus.QUEUED.value
    # The streamed submit sent its first task with one shard stored, the other with all six.
    assert streamed["shards_stored_when_first_queued"] == 1
    assert whole["shards_stored_when_first_queued"] == 6
    assert 0 < streamed["first_shard_queued_s"] < streamed["whole_file_stored_s"]
    assert 0 < whole["first_shard_queued_s"] < whole["whole_file_stored_s"]
    # Placed: every line read before the first shard is written, then queued as stored.
    placed = figures["placed"]
    assert (placed["lines"], placed["shards"], placed["shards_stored_when_first_queued"]) == (
        30_000,
        6,
        1,
    )
    assert not (tmp_path / "input.jsonl").exists()


def test_a_worker_runs_a_jobs_shards_while_the_submit_is_still_validating_its_file(
    fleet_env, tiny_model, tmp_path, monkeypatch
):
    """Shards go to the fleet as validation stores them (store/shard_recording.py): a worker
    process completes the first shard before the second is even stored, and when the last shard
    ends before the validation does (no shard's end may finish a validating job), the submit
    itself finalizes the job."""
    from batchllm.store import shard_recording
    from batchllm.store.db import session_scope
    from batchllm.store.models import Job, Shard
    from tests.support.job_checks import wait_for

    (worker,) = _instant_workers(["stream1"], fleet_env, tiny_model, tmp_path)
    settings = fleet_env.settings
    seen: dict[str, object] = {}

    def shard_states(job_id: str) -> tuple[JobStatus, int, list[ShardStatus]]:
        with session_scope(settings) as session:
            job = session.get(Job, job_id)
            shards = session.query(Shard).filter(Shard.job_id == job_id).order_by(Shard.index)
            return job.status, job.shards_total, [s.status for s in shards]

    def all_done(job_id: str, count: int):
        def check():
            state = shard_states(job_id)
            return state if state[2].count(ShardStatus.COMPLETED) >= count else None

        return wait_for(check, timeout=120, what=lambda: f"{count} shard(s) done\n{worker.log()}")

    real_add, real_record_rest = (
        shard_recording.ShardRecorder.add,
        shard_recording.ShardRecorder.record_rest,
    )

    def add(self, shard):
        if shard.index == 1:  # shard 0 is out: let the worker finish it before storing more
            seen["first_done"] = all_done(self.job_id, 1)
        return real_add(self, shard)

    def record_rest(self, session):
        seen["all_done"] = all_done(self.job_id, 3)
        return real_record_rest(self, session)

    monkeypatch.setattr(shard_recording, "RELEASE_EVERY_SECONDS", 0.0)
    monkeypatch.setattr(shard_recording.ShardRecorder, "add", add)
    monkeypatch.setattr(shard_recording.ShardRecorder, "record_rest", record_rest)
    try:
        source = write_workload(
            tmp_path / "prompts.jsonl", requests=600, max_tokens=(4, 16), bad_lines=2, seed=8
        )
        expected = expected_rows(source)
        job = fleet_env.submit(source, tiny_model, shard_size=200, max_tokens=16)

        # The first shard was done while the file was still being validated, one shard stored.
        assert seen["first_done"] == (JobStatus.VALIDATING, 1, [ShardStatus.COMPLETED])
        assert seen["all_done"] == (JobStatus.VALIDATING, 3, [ShardStatus.COMPLETED] * 3)
        # No worker could finish it (it was validating): the submit did, before returning.
        assert job.status is JobStatus.COMPLETED, job.error
        job, shards = load_job(fleet_env, job.id)
        assert (job.shards_total, job.shards_done, job.request_total) == (3, 3, len(expected))
        assert_exactly_once(output_rows(fleet_env, job.id), expected)
        assert {s.worker for s in shards} == {"celery@stream1"}
    finally:
        stop_workers([worker])


def test_max_idle_stops_a_worker_with_nothing_to_do_with_exit_0_after_the_set_time(
    fleet_env, tiny_model, tmp_path
):
    """`worker --max-idle 5`: a job first (a task resets the clock), then nothing: the worker
    stops warmly about 5 s after its last task and exits 0, so a Kubernetes Job or a spot
    instance can end."""
    (worker,) = _instant_workers(["idle1"], fleet_env, tiny_model, tmp_path, "--max-idle", "5")
    try:
        source = write_workload(tmp_path / "prompts.jsonl", requests=20, prompt_words=(4, 8))
        job = fleet_env.submit(source, tiny_model, shard_size=10, max_tokens=4)
        job = wait_until_final(fleet_env, job.id, timeout=120)
        assert job.status is JobStatus.COMPLETED, job.error
        ended_at = time.monotonic()
        code = worker.proc.wait(timeout=120)
        stopped_after = time.monotonic() - ended_at
        assert code == 0, worker.tail()
        log = worker.log()
        assert "no task for" in log and "(--max-idle 5)" in log, worker.tail()
        # Not before its 5 s without a task: the job's last task ended before `ended_at`.
        idle = float(log.split("no task for ", 1)[1].split(" s", 1)[0])
        assert idle >= 5, log
        print(f"\n--max-idle 5: exited 0 {stopped_after:.1f} s after the job ended")
    finally:
        stop_workers([worker])


def test_a_job_without_a_context_length_is_sized_by_one_worker_while_the_others_wait(
    fleet_env, tiny_model, tmp_path
):
    """No max_model_len on the job: the first worker to pick up a shard runs the sizing pass
    over all of its rows; three others, handed shards at the same moment, wait on the job's
    sizing lock and read the size it stored instead of each running the pass (issue 37), when
    the submit leaves it to them. Then the same file submitted with `always` and as by default
    (`auto`): sized at submit, and no worker sizes it."""
    from batchllm.jobs.submit import submit_job
    from batchllm.spec import JobSpec, SamplingDefaults

    names = ["size1", "size2", "size3", "size4"]
    workers = _instant_workers(names, fleet_env, tiny_model, tmp_path)
    try:
        # Enough rows that the pass lasts seconds: every worker's task lands during it.
        source = write_workload(tmp_path / "unsized.jsonl", requests=20_000, max_tokens=(4, 8))
        spec = JobSpec(
            model=str(tiny_model),
            engine={"enforce_eager": True},
            sampling=SamplingDefaults(max_tokens=8),
        )
        # `never`: the submit leaves the sizing to the workers (by default it sizes the job).
        never = fleet_env.settings.model_copy(update={"tokenize_at_submit": "never"})
        job = submit_job(source_of(source, never), spec, shard_size=2_000, settings=never)
        assert job.max_model_len is None and job.shards_total == 10

        job = wait_until_final(fleet_env, job.id, timeout=240)
        job, shards = load_job(fleet_env, job.id)
        assert job.status is JobStatus.COMPLETED, job.error
        assert {s.status for s in shards} == {ShardStatus.COMPLETED}
        assert_exactly_once(output_rows(fleet_env, job.id), expected_rows(source))
        logs = {w.name: w.log() for w in workers}
        sized = [name for name, log in logs.items() if "max_model_len sized to" in log]
        waited = [name for name, log in logs.items() if "sized by another worker" in log]
        assert len(sized) == 1, {name: log[-2000:] for name, log in logs.items()}
        assert sum(log.count("max_model_len sized to") for log in logs.values()) == 1
        assert waited and set(waited).isdisjoint(sized), (sized, waited)
        assert job.max_model_len and job.max_model_len <= 512

        # The same job submitted with `always`: sized and its ids stored at submit, so no
        # worker sizes it and none tokenizes a row again.
        always = fleet_env.settings.model_copy(update={"tokenize_at_submit": "always"})
        again = submit_job(source_of(source, always), spec, shard_size=2_000, settings=always)
        assert again.max_model_len == job.max_model_len
        storage = Storage.of(fleet_env.settings)
        _, queued = load_job(fleet_env, again.id)
        for shard in queued:
            ids = pq.read_table(storage.fs.open_input_file(token_path(shard.input_path)))
            assert ids.num_rows == shard.rows and ids.column("token_ids").null_count == 0
        again = wait_until_final(fleet_env, again.id, timeout=240)
        assert again.status is JobStatus.COMPLETED, again.error
        rows = output_rows(fleet_env, again.id)
        assert_exactly_once(rows, expected_rows(source))
        logs = {w.name: w.log() for w in workers}
        assert sum(log.count("max_model_len sized to") for log in logs.values()) == 1, logs
        assert not [name for name, log in logs.items() if "differ from this engine" in log]
        # Each row's prompt tokens are the stored ids' (the rows of the first job: the same
        # lines, tokenized by the worker that sized it).
        first = {r["custom_id"]: r["prompt_tokens"] for r in output_rows(fleet_env, job.id)}
        assert {r["custom_id"]: r["prompt_tokens"] for r in rows} == first

        # And as by default (`auto`): sized at submit from the prompts' bytes, an upper bound
        # (engine/token_bound.py), with no ids stored: the workers tokenize, none sizes it.
        bounded = submit_job(
            source_of(source, fleet_env.settings),
            spec,
            shard_size=2_000,
            settings=fleet_env.settings,
        )
        assert bounded.max_model_len is not None
        assert job.max_model_len <= bounded.max_model_len <= 1024
        _, queued = load_job(fleet_env, bounded.id)
        assert not [s for s in queued if storage.exists(token_path(s.input_path))]
        bounded = wait_until_final(fleet_env, bounded.id, timeout=240)
        assert bounded.status is JobStatus.COMPLETED, bounded.error
        rows = output_rows(fleet_env, bounded.id)
        assert_exactly_once(rows, expected_rows(source))
        assert {r["custom_id"]: r["prompt_tokens"] for r in rows} == first
        logs = {w.name: w.log() for w in workers}
        assert sum(log.count("max_model_len sized to") for log in logs.values()) == 1, logs
    finally:
        stop_workers(workers)
