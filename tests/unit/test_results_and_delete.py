"""Reading a job's rows as they are committed (Client.iter_results, `batchllm results
--partial/--follow`): every committed row once, never a part without its checkpoint, a job that
runs followed to its end, and memory bounded by a record batch, not by the output's size; and
`batchllm delete`'s prompt and refusal."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from batchllm import Client
from batchllm.cli import cli
from batchllm.errors import BatchLLMError
from batchllm.jobs.create import create_job
from batchllm.output.parts import OUTPUT_SCHEMA, list_parts, part_name, write_table
from batchllm.settings import get_settings
from batchllm.storage import Storage
from batchllm.store import service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard
from tests.support.fake_runs import FakeEngine, FakeEngines, write_items
from tests.support.file_jobs import create_from_file
from tests.support.follow import HeldForFollower
from tests.support.inputs import source_of
from tests.support.output_rows import OutputRow, record_part, write_part


def run_items(settings, tmp_path, rows: int, engine: FakeEngine | None = None):
    return Client(settings).run(
        write_items(tmp_path / "in.jsonl", rows),
        model="/models/fake",
        max_model_len=64,
        engines=FakeEngines(engine or FakeEngine()),
    )


@pytest.fixture
def many_parts(settings):
    settings.commit_rows = 3
    settings.shard_size = 25
    return settings


def test_a_job_of_many_parts_yields_each_row_exactly_once(many_parts, tmp_path):
    job = run_items(many_parts, tmp_path, 120)
    storage = Storage.of(many_parts)
    assert len(list_parts(storage, storage.output_dir(job.id))) >= 25

    rows = list(Client(many_parts).iter_results(job))

    ids = [row["custom_id"] for row in rows]
    assert sorted(ids) == sorted(f"item-{i}" for i in range(120))
    assert len(set(ids)) == 120
    assert sorted(row["line"] for row in rows) == list(range(1, 121))
    assert set(rows[0]) == set(OUTPUT_SCHEMA.names)
    assert all(row["status"] == "ok" and row["text"].startswith("echo") for row in rows)


def test_only_the_columns_asked_for_and_an_unknown_one_is_named(many_parts, tmp_path):
    job = run_items(many_parts, tmp_path, 10)
    client = Client(many_parts)
    rows = list(client.iter_results(job.id[:10], columns=["custom_id", "line"]))
    assert sorted(rows, key=lambda r: r["line"])[0] == {"custom_id": "item-0", "line": 1}
    with pytest.raises(BatchLLMError, match=r"no output column 'txt'.*custom_id, line"):
        list(client.iter_results(job, columns=["txt"]))


def test_a_part_without_its_checkpoint_is_not_read(many_parts, tmp_path):
    """A worker that wrote a file and has not recorded it (or died there): its rows may run
    again elsewhere, so showing them could show a row twice."""
    job_id, out_dir, storage = _running_job_with_one_part(many_parts, tmp_path)
    write_part(storage, out_dir, part_name(0, 1, 1), [OutputRow("late", 2, "ok", text="z")])

    ids = [row["custom_id"] for row in Client(many_parts).iter_results(job_id)]

    assert ids == ["first"]


def test_follow_hands_out_parts_as_they_are_committed_and_stops_when_the_job_ends(
    many_parts, tmp_path
):
    job_id, out_dir, storage = _running_job_with_one_part(many_parts, tmp_path)
    client = Client(many_parts)
    stream = client.iter_results(job_id, follow=True, poll=0.01)
    assert next(stream)["custom_id"] == "first"

    _commit(many_parts, storage, out_dir, job_id, seq=1, custom_id="second", line=2)
    assert next(stream)["custom_id"] == "second"

    # Committed, then the job ends before the stream looks again: still handed out, then stop.
    _commit(many_parts, storage, out_dir, job_id, seq=2, custom_id="third", line=3)
    with session_scope(many_parts) as session:
        service.cancel_job(session, job_id, lease_seconds=0.001)
    assert [row["custom_id"] for row in stream] == ["third"]


def test_follow_on_a_running_job_sees_rows_before_its_end_and_each_row_once(many_parts, tmp_path):
    """The job pauses once a part is committed until the follower has read a row, so rows are
    seen before the end whatever the machine's pace."""
    held = HeldForFollower(many_parts, wait_seconds=30)
    requests = write_items(tmp_path / "in.jsonl", 150)

    def run() -> None:
        Client(many_parts).run_spec(
            requests,
            _spec(),
            engines=FakeEngines(FakeEngine()),
            on_created=held.created,
            on_progress=held.progress,
        )

    runner = threading.Thread(target=run)
    runner.start()
    assert held.ready.wait(30)
    client = Client(many_parts)
    seen_while_running = 0
    ids = []
    try:
        for row in client.iter_results(held.job_id, follow=True, poll=0.02):
            ids.append(row["custom_id"])
            if not client.status(held.job_id).done:
                seen_while_running += 1
            held.follower_saw_a_row.set()
    finally:
        held.follower_saw_a_row.set()
        runner.join(30)

    assert seen_while_running > 0
    assert client.status(held.job_id).status == "completed"
    assert sorted(ids) == sorted(f"item-{i}" for i in range(150))


def test_the_cli_prints_json_lines_and_keeps_the_location_and_the_head_table(many_parts, tmp_path):
    job = run_items(many_parts, tmp_path, 20)
    runner = CliRunner()

    partial = runner.invoke(cli, ["results", job.id, "--partial", "--columns", "custom_id,line"])
    assert partial.exit_code == 0, partial.output
    lines = [json.loads(line) for line in partial.output.splitlines()]
    assert sorted(r["line"] for r in lines) == list(range(1, 21))
    assert all(set(r) == {"custom_id", "line"} for r in lines)

    follow = runner.invoke(cli, ["results", job.id, "--follow"])  # an ended job: all, then stop
    assert follow.exit_code == 0
    assert len(follow.output.splitlines()) == 20

    assert runner.invoke(cli, ["results", job.id]).output.strip() == job.output_dir
    head = runner.invoke(cli, ["results", job.id, "--head", "2"]).output
    assert "item-0" in head and "item-1" in head and "item-2 " not in head
    refused = runner.invoke(cli, ["results", job.id, "--columns", "text"])
    assert refused.exit_code == 2 and "--partial" in refused.output


def test_a_million_rows_stream_in_flat_memory(many_parts, tmp_path):
    """1M small rows in 50 parts: arrow's live allocations while streaming stay under a few
    MB, a small fraction of the output read whole."""
    parts, per_part = 50, 20_000
    job_id, out_dir, storage = _running_job_with_one_part(many_parts, tmp_path, first=False)
    for seq in range(parts):
        start = seq * per_part
        lines = pa.array(range(start + 1, start + per_part + 1), pa.int64())
        table = pa.Table.from_arrays(
            [
                pa.array([f"r{n}" for n in range(start, start + per_part)]),
                lines,
                pa.array(["ok"] * per_part),
                pa.array([f"answer {n}" for n in range(start, start + per_part)]),
                *[pa.nulls(per_part, f.type) for f in OUTPUT_SCHEMA][4:],
            ],
            schema=OUTPUT_SCHEMA,
        )
        path = write_table(storage, out_dir, part_name(0, seq, 1), table)
        _record(many_parts, job_id, seq, path, per_part)

    # Arrow's live allocations, sampled at every batch the stream hands out: what reading
    # holds (the open part's buffers and the batch) on top of what was there before.
    baseline = pa.total_allocated_bytes()
    peak = count = next_line = 0
    in_order = True
    for batch in Client(many_parts).iter_result_batches(job_id, columns=["custom_id", "line"]):
        peak = max(peak, pa.total_allocated_bytes() - baseline)
        lines = batch.column("line")
        in_order &= lines[0].as_py() == next_line + 1
        next_line = lines[-1].as_py()
        count += batch.num_rows

    assert count == parts * per_part and in_order
    whole = Client(many_parts).results(job_id).to_table(columns=["custom_id", "line"]).nbytes
    assert whole > 15_000_000
    assert peak < 4_000_000, f"peak {peak:,} bytes of arrow memory while streaming"


# -- helpers ------------------------------------------------------------------------------


def _spec():
    from batchllm.input.job_spec import build_job_spec

    return build_job_spec("/models/fake", max_model_len=64, settings=get_settings())


def _running_job_with_one_part(settings, tmp_path, *, first: bool = True):
    """A created job on one shard marked running, with (if `first`) one committed part of
    the row `first`."""
    created = create_from_file(
        write_items(tmp_path / "one.jsonl", 3), _spec(), settings, shard_size=100
    )
    job_id = created.job.id
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job_id)
    with session_scope(settings) as session:
        state_machine.start_job(session, job_id)
        assert session.get(Job, job_id).status is JobStatus.IN_PROGRESS
    if first:
        _commit(settings, storage, out_dir, job_id, seq=0, custom_id="first", line=1)
    return job_id, out_dir, storage


def _commit(settings, storage, out_dir, job_id, *, seq, custom_id, line) -> None:
    path = write_part(
        storage, out_dir, part_name(0, seq, 1), [OutputRow(custom_id, line, "ok", text="x")]
    )
    _record(settings, job_id, seq, path, 1)


def _record(settings, job_id, seq, path, rows) -> None:
    with session_scope(settings) as session:
        shard = session.query(Shard).filter_by(job_id=job_id).one()
        record_part(
            session, job_id, shard.id, seq, path, rows=(rows, 0), tokens=(0, 0), seconds=0.0
        )


def test_the_cli_deletes_after_asking_and_refuses_a_running_job(many_parts, tmp_path):
    job = run_items(many_parts, tmp_path, 5)
    job_dir = Storage.of(many_parts).job_dir(job.id)
    runner = CliRunner()

    kept = runner.invoke(cli, ["delete", job.id], input="n\n")
    assert kept.exit_code == 1 and "delete job" in kept.output
    assert Client(many_parts).status(job.id).status == "completed"

    deleted = runner.invoke(cli, ["delete", job.id, "--yes"])
    assert deleted.exit_code == 0, deleted.output
    assert f"{job.id}: deleted" in deleted.output
    assert not Path(job_dir).exists()
    assert runner.invoke(cli, ["status", job.id]).exit_code == 1

    running, _, _ = _running_job_with_one_part(many_parts, tmp_path)
    refused = runner.invoke(cli, ["delete", running, "--yes"])
    assert refused.exit_code == 1
    assert f"job {running} is in_progress" in refused.output and "cancel it first" in refused.output
    assert list(Client(many_parts).iter_results(running))
