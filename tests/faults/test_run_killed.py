"""kill -9 of a `batchllm run` mid-job, then the next `batchllm run` in the same home: the
killed run's job ends `failed` through recovery (store/recovery.py fail_abandoned_local_runs),
its committed rows kept, and its output holds no part file that no checkpoint records - a
crash between writing a part and committing it leaves one, which the job's end removes
(output/commit.py's before-commit tidy), whoever ends the job.

The runs use the instant engine, paced (`--instant-step-seconds`): the subject is the job's
end and its files, not vLLM (tests/faults/test_run_interrupt.py kills real engines), and a
paced job lasts the same time on any machine, so the kill lands mid-job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from batchllm.demo.workload import write_workload
from batchllm.output.parts import part_name
from batchllm.settings import Settings
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import Checkpoint, Job, JobStatus, Shard, utcnow
from tests.support.cli import REPO, local_env
from tests.support.fleet import tail
from tests.support.job_checks import wait_for

pytestmark = pytest.mark.faults

# 8 requests at a time, 24 tokens each at 0.1 s a token: 8 rows every ~2.4 s, so 400 rows
# take ~2 minutes and the kill comes with most of them to go.
PACED = ("--engine", "instant", "--instant-step-seconds", "0.1", "--max-num-seqs", "8")
SETTINGS = {
    "BATCHLLM_COMMIT_ROWS": "8",
    "BATCHLLM_COMMIT_SECONDS": "1",
    # The next run takes a killed run's job for abandoned once its heartbeat is this old.
    "BATCHLLM_LEASE_SECONDS": "3",
}
LEASE_SECONDS = float(SETTINGS["BATCHLLM_LEASE_SECONDS"])


def _run(env: dict[str, str], source: Path, model: Path, log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "batchllm", "run", str(source), "--model", str(model)]
            + ["--max-tokens", "24", *PACED],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def test_a_killed_run_is_failed_by_the_next_run_and_leaves_no_unrecorded_part(
    tiny_model: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    env = local_env(home, **SETTINGS)
    settings = Settings(home=home)
    source = write_workload(tmp_path / "prompts.jsonl", requests=400, prompt_words=(4, 8))
    log = tmp_path / "run.log"
    first = _run(env, source, tiny_model, log)
    try:

        def some_rows_committed() -> str | None:
            assert first.poll() is None, "the run ended before the kill:\n" + tail(log)
            if not (home / "batchllm.db").exists():
                return None
            with session_scope(settings) as session:
                job = session.scalars(select(Job)).first()
                committed = session.scalars(select(Checkpoint.id)).first()
                return job.id if job is not None and committed is not None else None

        job_id = wait_for(some_rows_committed, timeout=180, what="a first checkpoint")
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        first.wait(timeout=30)

    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.status is JobStatus.IN_PROGRESS, job
        (shard,) = session.scalars(select(Shard).where(Shard.job_id == job_id)).all()
        kept_rows = sum(c.rows for c in session.scalars(select(Checkpoint)))
    assert 0 < kept_rows < 400, kept_rows
    # What a kill between writing a part and committing it leaves: a file no checkpoint names.
    storage = Storage.for_job(job, settings)
    stray = f"{storage.output_dir(job_id)}/{part_name(shard.id, 999, attempt=shard.attempts)}"
    storage.write_bytes(stray, b"written, never committed")
    assert storage.exists(stray)

    # The next run in this home, once the killed run's heartbeat is older than the lease.
    def heartbeat_stale() -> bool:
        with session_scope(settings) as session:
            beat = session.get(Shard, shard.id).heartbeat_at
        return beat is not None and (utcnow() - beat).total_seconds() > LEASE_SECONDS + 0.5

    wait_for(heartbeat_stale, timeout=60, what="the killed run's heartbeat to go stale")
    one_line = write_workload(tmp_path / "one.jsonl", requests=1, prompt_words=(4, 8))
    second = _run(env, one_line, tiny_model, log)
    assert second.wait(timeout=180) == 0, tail(log)

    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.FAILED, (job.status, job.error)
        assert "stopped without ending it" in (job.error or ""), job.error
        recorded = {
            Path(c.path).name
            for c in session.scalars(select(Checkpoint).where(Checkpoint.shard_id == shard.id))
        }
        assert sum(c.rows for c in session.scalars(select(Checkpoint))) >= kept_rows
        assert session.scalars(select(Job).where(Job.id != job_id)).one().status is (
            JobStatus.COMPLETED
        )
    assert not storage.exists(stray)
    on_disk = set(storage.listdir(storage.output_dir(job_id)))
    parts = {name for name in on_disk if name.endswith(".parquet")}
    assert parts and parts <= recorded, (sorted(parts - recorded), sorted(recorded))
    assert "marked failed" in log.read_text(errors="replace"), tail(log)
