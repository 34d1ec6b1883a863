"""Shards released to the fleet while the file is still being validated (store/shard_recording.py):
when, in which states, and what ends the job when its shards all ran during the validation.
On SQLite with a fake engine run in place of a fleet worker; the real worker process, Redis and
PostgreSQL: tests/integration/test_streaming_submit.py."""

from __future__ import annotations

import pytest

from batchllm.errors import InputError
from batchllm.execution.runner import ShardRunner
from batchllm.jobs import submit as dispatch
from batchllm.jobs.create import create_job
from batchllm.spec import EngineOptions
from batchllm.store import service, shard_recording, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, ShardStatus, utcnow
from tests.support.fake_runs import FakeEngine, make_spec, output_rows, write_items
from tests.support.file_jobs import create_from_file
from tests.support.inputs import source_of


class Releases:
    """A release callback that records what the job looked like at each call."""

    def __init__(self, settings, run_them: bool = False) -> None:
        self.settings, self.run_them = settings, run_them
        self.calls: list[tuple[list[int], JobStatus, int, int]] = []

    def __call__(self, job_id: str, shard_ids: list[int]) -> None:
        with session_scope(self.settings) as session:
            job = session.get(Job, job_id)
            self.calls.append((shard_ids, job.status, job.shards_total, job.request_total))
            # Released shards are committed: a worker can read them.
            found = {s.id: s.status for s in session.query(Shard).filter(Shard.id.in_(shard_ids))}
        assert found == dict.fromkeys(shard_ids, ShardStatus.QUEUED)
        if self.run_them:  # what a fleet worker does with the tasks, in place of one
            ShardRunner(FakeEngine(), worker="w1", settings=self.settings).run(shard_ids)

    @property
    def released(self) -> list[int]:
        return [shard_id for ids, *_ in self.calls for shard_id in ids]


@pytest.fixture
def every_shard_at_once(monkeypatch):
    """Release each shard as it is stored (the half-second batching is for big files)."""
    monkeypatch.setattr(shard_recording, "RELEASE_EVERY_SECONDS", 0.0)


def _create(settings, tmp_path, lines: int, releases: Releases, spec=None, **options):
    """A job of `lines` items in 10-line shards, its shards released to `releases`."""
    return create_job(
        source_of(write_items(tmp_path / "in.jsonl", lines), settings),
        spec or make_spec(),
        shard_size=10,
        settings=settings,
        release=releases,
        **options,
    )


def _shard_ids(settings, job_id: str) -> list[int]:
    with session_scope(settings) as session:
        return [s.id for s in sorted(session.get(Job, job_id).shards, key=lambda s: s.index)]


def test_shards_are_released_while_the_job_is_still_validating(
    settings, tmp_path, every_shard_at_once
):
    releases = Releases(settings)
    created = _create(settings, tmp_path, 50, releases)

    shard_ids = _shard_ids(settings, created.job.id)
    assert len(shard_ids) == 5
    assert releases.released == shard_ids  # each once, in order
    # Each went out during the validation (the last when the file's end closed it), the job
    # counting the lines stored so far; the end of the validation then queued the job.
    assert [call[1:] for call in releases.calls] == [
        (JobStatus.VALIDATING, shards, shards * 10) for shards in range(1, 6)
    ]
    assert created.ended is None
    assert (created.job.status, created.job.shards_total, created.job.request_total) == (
        JobStatus.QUEUED,
        5,
        50,
    )


def test_shards_released_half_a_second_apart_go_in_batches(settings, tmp_path, monkeypatch):
    clock = iter(range(0, 10_000))  # each reading of the clock: 0.2 s later
    monkeypatch.setattr(shard_recording.time, "monotonic", lambda: next(clock) * 0.2)
    releases = Releases(settings)
    created = _create(settings, tmp_path, 100, releases)
    # The first shard at once, then one release every third shard (0.6 s >= 0.5 s).
    assert [len(ids) for ids, *_ in releases.calls] == [1, 3, 3, 3]
    assert releases.released == _shard_ids(settings, created.job.id)


@pytest.mark.parametrize(
    "why", ["strict", "context sized from the rows"], ids=["strict", "no-max-model-len"]
)
def test_nothing_is_released_before_the_whole_file_is_stored_when_it_must_be(
    settings, tmp_path, every_shard_at_once, why
):
    spec = make_spec()
    if why != "strict":
        spec = spec.model_copy(update={"engine": EngineOptions()})
    releases = Releases(settings)
    created = _create(settings, tmp_path, 30, releases, spec, strict=why == "strict")
    assert len(releases.calls) == 1
    ids, status, shards_total, lines = releases.calls[0]
    assert (ids, status, shards_total, lines) == (
        _shard_ids(settings, created.job.id),
        JobStatus.QUEUED,
        3,
        30,
    )


def test_a_strict_refusal_releases_nothing(settings, tmp_path, every_shard_at_once):
    releases = Releases(settings)
    source = write_items(tmp_path / "in.jsonl", 30, extra=['{"custom_id": "bad"}'])
    with pytest.raises(InputError, match="--strict refuses the file"):
        create_job(
            source_of(source, settings),
            make_spec(),
            shard_size=10,
            settings=settings,
            strict=True,
            release=releases,
        )
    assert releases.calls == []


def test_no_shard_end_finishes_a_job_that_is_still_validating(
    settings, tmp_path, every_shard_at_once
):
    """Its shards all ran during the validation: their ends leave it validating (more shards may
    come), and the end of the validation moves it to finalizing for its caller to complete."""
    releases = Releases(settings, run_them=True)
    created = _create(settings, tmp_path, 25, releases)
    # Each shard was released, and ran to its end, while the job was validating.
    assert [call[1:] for call in releases.calls] == [
        (JobStatus.VALIDATING, 1, 10),
        (JobStatus.VALIDATING, 2, 20),
        (JobStatus.VALIDATING, 3, 25),
    ]
    assert created.ended is JobStatus.FINALIZING
    with session_scope(settings) as session:
        job = session.get(Job, created.job.id)
        assert job.status is JobStatus.FINALIZING
        assert (job.request_completed, job.shards_done, job.shards_total) == (25, 3, 3)


def test_a_job_whose_shards_all_ended_during_validation_is_finalized_by_the_submit(
    settings, tmp_path, every_shard_at_once, monkeypatch
):
    """The race the design must not lose: the last shard ends before the validation does, so
    neither a shard's end (the job was validating) nor a later one can finish the job; the
    submit does, after end_validation returned FINALIZING."""
    sent: list[list[int]] = []

    def run_in_place(job_id, spec, shard_ids, *, settings, app=None):  # the fleet, in this process
        sent.append(shard_ids)
        ShardRunner(FakeEngine(), worker="w1", settings=settings).run(shard_ids)

    monkeypatch.setattr(dispatch, "send_shards", run_in_place)
    real_record_rest = shard_recording.ShardRecorder.record_rest

    def check_then_record_rest(self, session):
        # Every shard has ended by the time the validation ends, and the job still validates.
        assert session.get(Job, self.job_id).status is JobStatus.VALIDATING
        assert session.get(Job, self.job_id).shards_done == 3
        return real_record_rest(self, session)

    monkeypatch.setattr(shard_recording.ShardRecorder, "record_rest", check_then_record_rest)
    source = write_items(tmp_path / "in.jsonl", 30)
    job = dispatch.submit_job(
        source_of(source, settings), make_spec(), shard_size=10, settings=settings
    )

    assert sent == [[shard_id] for shard_id in _shard_ids(settings, job.id)]
    assert job.status is JobStatus.COMPLETED
    assert (job.request_completed, job.request_total, job.shards_done) == (30, 30, 3)
    rows = output_rows(settings, job.id)
    assert [r["custom_id"] for r in rows] == [f"item-{i}" for i in range(30)]


def test_end_validation_moves_the_job_on_as_its_shards_say(settings, tmp_path):
    created = create_from_file(
        write_items(tmp_path / "in.jsonl", 20), make_spec(), settings, shard_size=10
    )
    job_id = created.job.id
    with session_scope(settings) as session:
        session.get(Job, job_id).status = JobStatus.VALIDATING
    shard_ids = _shard_ids(settings, job_id)
    # One shard ended while validating: the job is in progress, not finished.
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_ids[0])
        shard.started_at = utcnow()
        assert state_machine.end_shard(session, shard.id, ShardStatus.COMPLETED) is None
    with session_scope(settings) as session:
        ended = state_machine.end_validation(session, job_id, shards_total=2, request_total=20)
        assert ended is None
        assert session.get(Job, job_id).status is JobStatus.IN_PROGRESS
    # A cancel during validation: the end of validation leaves it cancelling.
    with session_scope(settings) as session:
        session.get(Job, job_id).status = JobStatus.CANCELLING
        assert (
            state_machine.end_validation(session, job_id, shards_total=2, request_total=20) is None
        )
        assert session.get(Job, job_id).status is JobStatus.CANCELLING
