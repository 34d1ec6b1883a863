"""The shard runner on a deterministic fake engine: every line exactly once, across commits,
crashes, resumes and cancellation, without vLLM."""

from __future__ import annotations

import collections
import json
import posixpath
import shutil
import threading
from datetime import timedelta

import pytest
from sqlalchemy import update

from batchllm.errors import EngineUnavailable, InputError
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.execution.stand_in_engines import FakeEngine, FakeEngines
from batchllm.jobs.create import create_job
from batchllm.jobs.local import run_job
from batchllm.output import commit
from batchllm.output.parts import MANIFEST_NAME, SUCCESS_NAME
from batchllm.process.stopping import StopRequest
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store import leases, service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus, utcnow
from tests.support.fake_runs import (
    DEFAULT_MAX_TOKENS,
    MAX_MODEL_LEN,
    crash_on_checkpoint,
    item_of,
    make_spec,
    output_rows,
    part_files,
    read_output_file,
    small_commits,
    write_items,
)
from tests.support.file_jobs import create_from_file, run_file
from tests.support.inputs import source_of

# -- a whole job ------------------------------------------------------------------------------


def test_every_input_line_gets_one_output_row_including_invalid_and_too_long_prompts(
    small_commits, tmp_path
):
    settings = small_commits
    too_long = " ".join(["long"] * (MAX_MODEL_LEN + 3))
    source = write_items(
        tmp_path / "in.jsonl",
        30,
        extra=[
            "{broken json",
            json.dumps({"custom_id": "blank", "prompt": "   "}),
            json.dumps({"custom_id": "too-long", "prompt": too_long}),
            "",
            json.dumps({"custom_id": "item-0", "prompt": "a duplicate id"}),
            json.dumps(
                {"custom_id": "too-long-chat", "messages": [{"role": "user", "content": too_long}]}
            ),
        ],
    )
    engine = FakeEngine()

    job = run_job(
        source_of(source, settings), make_spec(), settings=settings, engines=FakeEngines(engine)
    )

    rows = output_rows(settings, job.id)
    assert [r["line"] for r in rows] == list(range(1, 34)) + [35, 36]
    assert [r["custom_id"] for r in rows[:30]] == [f"item-{i}" for i in range(30)]
    by_id = {r["custom_id"]: r for r in rows}
    errors = {r["line"]: r["error"] for r in rows if r["status"] == "error"}
    assert sorted(errors) == [31, 32, 33, 35, 36]
    assert "malformed JSON" in errors[31]
    assert errors[32] == "field 'prompt': prompt is blank"
    assert "prompt is 28 tokens; the engine's max_model_len is 24" in errors[33]
    assert "duplicate custom_id 'item-0' (first on line 1)" in errors[35]
    assert "the engine's max_model_len is 24" in errors[36]
    assert by_id["too-long"]["prompt_tokens"] is None
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 30
    assert all(r["error"] is None and r["finish_reason"] == "length" for r in ok)
    assert len(engine.prompts_added) == 30
    # Token counts are the engine's: a BOS plus one token per word for a plain prompt.
    assert by_id["item-3"]["prompt_tokens"] == 1 + 1 + 3
    assert by_id["item-3"]["completion_tokens"] == 2  # the line's own max_tokens
    assert by_id["item-5"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert by_id["item-7"]["text"] == "echo word assistant:"  # chat template applied
    assert by_id["item-6"]["text"] == "echo word word"


class WarmEngines(FakeEngines):
    """Hands out an engine that keeps its own longer context, as a worker's warm engine does
    for a job that fits in it (execution/engines.py EngineCache)."""

    def get(self, spec: JobSpec, max_model_len: int) -> FakeEngine:
        assert max_model_len <= self.engine.max_model_len
        return self.engine


def test_a_warm_engine_with_a_longer_context_still_refuses_rows_over_the_jobs_max_model_len(
    small_commits, tmp_path
):
    settings = small_commits
    too_long = " ".join(["long"] * (MAX_MODEL_LEN + 3))  # fits the engine, not the job
    source = write_items(
        tmp_path / "in.jsonl", 6, extra=[json.dumps({"custom_id": "too-long", "prompt": too_long})]
    )
    engine = FakeEngine(max_model_len=4 * MAX_MODEL_LEN)

    job = run_job(
        source_of(source, settings), make_spec(), settings=settings, engines=WarmEngines(engine)
    )

    by_id = {r["custom_id"]: r for r in output_rows(settings, job.id)}
    assert len(by_id) == 7
    assert by_id["too-long"]["status"] == "error"
    assert by_id["too-long"]["error"] == (
        "prompt is 28 tokens; the job's --max-model-len is 24 "
        "(prompt plus at least one output token must fit)"
    )
    assert [r["status"] for i, r in by_id.items() if i != "too-long"] == ["ok"] * 6
    assert sorted(item_of(p) for p in engine.prompts_added) == [f"item-{i}" for i in range(6)]


def test_a_finished_job_is_completed_with_throughput_counts_and_a_manifest(small_commits, tmp_path):
    settings = small_commits
    source = write_items(tmp_path / "in.jsonl", 30, extra=["[1, 2]"])

    job = run_file(source, make_spec(), settings, engines=FakeEngines(FakeEngine()))

    assert job.status is JobStatus.COMPLETED
    assert (job.request_total, job.request_completed, job.request_failed) == (31, 30, 1)
    assert (job.shards_total, job.shards_done) == (3, 3)
    rows = output_rows(settings, job.id)
    assert job.completion_tokens == sum(r["completion_tokens"] or 0 for r in rows) > 0
    assert job.prompt_tokens == sum(r["prompt_tokens"] or 0 for r in rows) > 0
    assert job.requests_per_s > 0
    assert job.output_tokens_per_s > 0
    assert job.total_tokens_per_s > job.output_tokens_per_s
    assert job.wall_seconds > 0
    assert job.engine_seconds > 0
    assert (job.hardware, job.vllm_version) == (FakeEngine.hardware, FakeEngine.version)
    assert len(part_files(settings, job.id)) >= 6  # commit_rows=5 over 31 rows
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job.id)
    manifest = json.loads(storage.read_bytes(posixpath.join(out_dir, MANIFEST_NAME)))
    assert manifest["job_id"] == job.id
    assert manifest["status"] == "completed"
    assert manifest["rows"] == {"total": 31, "ok": 30, "error": 1}
    assert manifest["tokens"]["completion"] == job.completion_tokens
    assert manifest["throughput"]["requests_per_s"] == pytest.approx(job.requests_per_s)
    assert manifest["engine"]["max_model_len"] == MAX_MODEL_LEN
    assert manifest["vllm_version"] == "fake-1.0"
    assert storage.exists(posixpath.join(out_dir, SUCCESS_NAME))
    with session_scope(settings) as session:
        shards = session.get(Job, job.id).shards
        assert [s.status for s in shards] == [ShardStatus.COMPLETED] * 3
        assert [s.rows_ok + s.rows_failed for s in shards] == [12, 12, 7]


class StartingEngines(FakeEngines):
    """An engine start that signals when it begins and can fail."""

    def __init__(self, engine: FakeEngine, *, fail: str | None = None) -> None:
        super().__init__(engine)
        self.starting = threading.Event()
        self.fail = fail

    def get(self, spec: JobSpec, max_model_len: int) -> FakeEngine:
        self.starting.set()
        if self.fail:
            raise EngineUnavailable(self.fail)
        return super().get(spec, max_model_len)


def test_with_a_given_context_length_the_engine_starts_while_the_file_is_validated(
    small_commits, tmp_path
):
    source = write_items(tmp_path / "in.jsonl", 20)
    engines = StartingEngines(FakeEngine())
    engine_started_before_job_was_stored = []

    def created(job) -> None:
        engine_started_before_job_was_stored.append(engines.starting.wait(timeout=10))

    job = run_job(
        source_of(source, small_commits),
        make_spec(),
        settings=small_commits,
        engines=engines,
        on_created=created,
    )

    assert engine_started_before_job_was_stored == [True]
    assert job.status is JobStatus.COMPLETED
    assert len(output_rows(small_commits, job.id)) == 20


def test_under_strict_a_refused_file_is_reported_without_starting_the_engine(
    small_commits, tmp_path
):
    source = write_items(tmp_path / "in.jsonl", 3, extra=["{broken json"])
    engines = StartingEngines(FakeEngine())

    with pytest.raises(InputError, match=r"in.jsonl:4: malformed JSON"):
        run_job(
            source_of(source, small_commits),
            make_spec(),
            strict=True,
            settings=small_commits,
            engines=engines,
        )

    assert not engines.starting.is_set()


def test_an_engine_that_fails_to_start_fails_the_job_created_meanwhile(small_commits, tmp_path):
    source = write_items(tmp_path / "in.jsonl", 5)
    engines = StartingEngines(FakeEngine(), fail="no such model")

    with pytest.raises(EngineUnavailable, match="no such model"):
        run_job(
            source_of(source, small_commits), make_spec(), settings=small_commits, engines=engines
        )

    with session_scope(small_commits) as session:
        (job,) = service.list_jobs(session, limit=5)
        assert job.status is JobStatus.FAILED
        assert "no such model" in job.error
        assert job.request_total == 5


def test_rows_run_in_file_order_when_prefix_grouping_is_off(small_commits, tmp_path):
    settings = small_commits
    source = write_items(tmp_path / "in.jsonl", 9)
    spec = make_spec()
    spec.engine.group_prefixes = False
    engine = FakeEngine()

    run_job(source_of(source, settings), spec, settings=settings, engines=FakeEngines(engine))

    assert [item_of(p) for p in engine.prompts_added] == [f"item-{i}" for i in range(9)]


# -- crash and resume -------------------------------------------------------------------------


def test_resume_after_a_crash_deletes_orphan_parts_and_runs_every_line_exactly_once(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    settings.shard_size = 20
    source = write_items(tmp_path / "in.jsonl", 36, extra=["not json"])
    created = create_job(
        source_of(source, settings), make_spec(), shard_size=settings.shard_size, settings=settings
    )
    job_id = created.job.id
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job_id)
    with session_scope(settings) as session:
        shard_ids = [s.id for s in session.get(Job, job_id).shards]
    assert len(shard_ids) == 2

    crash_on_checkpoint(monkeypatch, crash_at=3)
    with pytest.raises(KeyboardInterrupt):
        ShardRunner(FakeEngine(), worker="dead", settings=settings).run(shard_ids)
    monkeypatch.undo()

    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        committed_paths = [
            c.path for shard in job.shards for c in commit.checkpoints_of(session, shard.id)
        ]
        assert job.status is JobStatus.IN_PROGRESS
    assert len(committed_paths) == 2
    committed = {r["custom_id"] for p in committed_paths for r in read_output_file(storage, p)}
    on_disk = part_files(settings, job_id)
    orphans = [n for n in on_disk if posixpath.join(out_dir, n) not in committed_paths]
    assert orphans, on_disk  # written, then the worker died before the checkpoint
    # A second orphan with a sequence number the resumed run will not reuse.
    planted = posixpath.join(out_dir, "part-s00000-00099.parquet")
    shutil.copyfile(posixpath.join(out_dir, orphans[0]), planted)
    # The dead worker's heartbeat goes stale, so its redelivered shards may be taken over.
    with session_scope(settings) as session:
        session.execute(
            update(Shard)
            .where(Shard.job_id == job_id)
            .values(heartbeat_at=utcnow() - timedelta(hours=1))
        )

    resumed = FakeEngine()
    outcomes = ShardRunner(resumed, worker="alive", settings=settings).run(shard_ids)

    assert outcomes == {shard_ids[0]: Outcome.COMPLETED, shard_ids[1]: Outcome.COMPLETED}
    assert not storage.exists(planted)
    rows = output_rows(settings, job_id)
    assert collections.Counter(r["line"] for r in rows) == collections.Counter(range(1, 38))
    redone = {item_of(p) for p in resumed.prompts_added}
    assert redone.isdisjoint(committed)
    items = {f"item-{i}" for i in range(36)}
    assert redone | committed >= items
    assert len(resumed.prompts_added) == len(items - committed) < len(items)
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED
        assert (job.request_completed, job.request_failed) == (36, 1)
        assert job.completion_tokens == sum(r["completion_tokens"] or 0 for r in rows)
        assert job.vllm_version == "fake-1.0"
        assert [s.worker for s in job.shards] == ["alive", "alive"]


def test_a_shard_running_on_a_live_worker_is_not_taken_over(small_commits, tmp_path):
    settings = small_commits
    created = create_from_file(
        write_items(tmp_path / "in.jsonl", 4), make_spec(), settings, shard_size=10
    )
    with session_scope(settings) as session:
        (shard,) = session.get(Job, created.job.id).shards
        leases.claim_shard(session, shard.id, "first", settings.lease_seconds)
        shard_id = shard.id

    engine = FakeEngine()
    outcomes = ShardRunner(engine, worker="second", settings=settings).run([shard_id])

    assert outcomes == {shard_id: Outcome.BUSY}
    assert engine.prompts_added == []
    assert output_rows(settings, created.job.id) == []


# -- cancellation -----------------------------------------------------------------------------


def test_cancelling_mid_run_aborts_in_flight_requests_and_keeps_committed_rows(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", 0.0)
    source = write_items(tmp_path / "in.jsonl", 40)
    seen: dict[str, int] = {}

    def cancel_at_step(step: int) -> None:
        if step == 6:
            with session_scope(settings) as session:
                job = service.list_jobs(session, limit=1)[0]
                seen["committed"] = job.request_completed + job.request_failed
                service.cancel_job(session, job.id)

    engine = FakeEngine(on_step=cancel_at_step)

    job = run_job(
        source_of(source, settings), make_spec(), settings=settings, engines=FakeEngines(engine)
    )

    assert job.status is JobStatus.CANCELLED
    assert engine.aborted
    assert not engine.has_unfinished()
    rows = output_rows(settings, job.id)
    done = job.request_completed + job.request_failed
    assert 0 < seen["committed"] <= done == len(rows) < 40
    assert len({r["line"] for r in rows}) == len(rows)
    assert all(r["status"] == "ok" for r in rows)
    # Every request fed either finished into a committed row or was aborted.
    assert len(rows) + len(engine.aborted) == len(engine.prompts_added)
    storage = Storage.of(settings)
    assert not storage.exists(posixpath.join(storage.output_dir(job.id), SUCCESS_NAME))
    with session_scope(settings) as session:
        shards = session.get(Job, job.id).shards
        assert {s.status for s in shards} == {ShardStatus.CANCELLED}


def test_a_warm_shutdown_commits_finished_rows_and_a_later_run_finishes_the_shard_exactly_once(
    small_commits, tmp_path, monkeypatch
):
    """The worker path (process_shard): a stop request mid-shard aborts in-flight requests,
    keeps the committed rows and leaves the shard to the next delivery, which runs the rest."""
    from batchllm.worker.delivery import process_shard

    settings = small_commits
    settings.shard_size = 40
    monkeypatch.setattr("batchllm.execution.runner._CONTROL_INTERVAL", 0.0)
    source = write_items(tmp_path / "in.jsonl", 40)
    created = create_job(source_of(source, settings), make_spec(), shard_size=40, settings=settings)
    with session_scope(settings) as session:
        shard_id = session.get(Job, created.job.id).shards[0].id
        session.execute(update(Job).where(Job.id == created.job.id).values(max_model_len=64))
    stop_request = StopRequest()
    first = FakeEngine(on_step=lambda n: stop_request.request() if n == 8 else None)

    outcome = process_shard(
        shard_id,
        worker="w1",
        engines=FakeEngines(first),
        stop=stop_request,
        settings=settings,
    )

    assert outcome is Outcome.INTERRUPTED
    assert first.aborted and not first.has_unfinished()
    kept = output_rows(settings, created.job.id)
    assert 0 < len(kept) < 40
    with session_scope(settings) as session:
        # Handed back, not held: the re-queued task can run at once on another worker.
        assert session.get(Shard, shard_id).status is ShardStatus.QUEUED
        assert session.get(Job, created.job.id).status is JobStatus.IN_PROGRESS

    second = FakeEngine()
    assert (
        process_shard(shard_id, worker="w2", engines=FakeEngines(second), settings=settings)
        is Outcome.COMPLETED
    )

    rows = output_rows(settings, created.job.id)
    assert sorted(r["line"] for r in rows) == list(range(1, 41))
    assert len(second.prompts_added) == 40 - len(kept)
    with session_scope(settings) as session:
        job = session.get(Job, created.job.id)
        assert job.status is JobStatus.COMPLETED
        assert job.request_completed == 40
