"""Jobs with their storage in object storage: a real S3-compatible server (moto's server mode,
started on 127.0.0.1 for this module) holds the inputs, the part files, `_manifest.json` and
`_SUCCESS` of a `batchllm run` job, of a fleet job and of a fleet job whose
worker is killed mid-shard (paced instant-engine workers). Each output is read back from the
bucket, independently of batchllm's own reader, with pyarrow and with DuckDB: exactly one row
per input line.

DuckDB reads the bucket through pyarrow: its own S3 reader, the httpfs extension, is downloaded
by DuckDB on first use (no network here, and the extension builds on PyPI are for older DuckDB
releases), so DuckDB scans a pyarrow dataset over the same objects instead.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from batchllm.demo.workload import write_workload
from batchllm.output.parts import MANIFEST_NAME, SUCCESS_NAME, part_name
from batchllm.settings import Settings, get_settings
from batchllm.storage import Storage
from batchllm.store.models import JobStatus, ShardStatus
from tests.support.cli import run_cli
from tests.support.fleet import (
    REPO,
    FleetEnv,
    tails,
    warm_workers,
)
from tests.support.job_checks import (
    assert_exactly_once,
    checkpoints_of,
    expected_rows,
    load_job,
    wait_for,
    wait_until_final,
)
from tests.support.output_rows import OutputRow, write_part
from tests.support.s3server import S3Server, moto_server
from tests.support.skips import require

pytestmark = pytest.mark.integration

PREFIX = "jobs"
PART = re.compile(r"part-s\d{5}-a\d{3}-\d{5}\.parquet")
# The same engine options as the fleet tests' jobs (conftest.ENGINE), so a warm engine serves all.
ENGINE_FLAGS = ("--enforce-eager", "--max-model-len", "512")
# Checkpoints every 50 rows; a killed worker's shard taken over within seconds (its lease runs
# out after 10 s, the survivor's reconciler looks every 5 s).
S3_WORKER_SETTINGS = {"BATCHLLM_COMMIT_ROWS": "50", "BATCHLLM_RECONCILE_SECONDS": "5"}


# -- the server, the bucket, the settings --------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory) -> S3Server:
    with moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    """One bucket for the module; every job has its own prefix in it."""
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def s3_env(s3_server: S3Server, bucket: str) -> dict[str, str]:
    """The S3 variables, also set in this test process (which submits jobs and reads their
    rows the way the workers see them)."""
    env = s3_server.env(bucket, PREFIX)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        get_settings.cache_clear()
        yield env
    get_settings.cache_clear()


def upload(s3_server: S3Server, key: str, source: Path) -> str:
    """Put a local file into the bucket (as a user would with `aws s3 cp`); its s3:// URI."""
    with s3_server.filesystem().open_output_stream(key) as out:
        out.write(source.read_bytes())
    return f"s3://{key}"


def run_env(s3_env: dict[str, str], home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    env["BATCHLLM_KEEP_ALIVE"] = "0"  # no engine kept after the test
    env.update(s3_env)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
            "BATCHLLM_HOME": str(home),  # the database: SQLite there; the storage: the bucket
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    return env


def batchllm(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return run_cli(env, *args, timeout=timeout)


# -- reading a job's output from the bucket, without batchllm ------------------------------------


def read_back(s3_server: S3Server, bucket: str, job_id: str, expected: dict) -> dict[str, int]:
    """The job's output objects read with pyarrow and DuckDB straight from the bucket:
    part files only, `_manifest.json` and `_SUCCESS` beside them, exactly one row per line.
    Returns the DuckDB status counts."""
    import duckdb

    fs = s3_server.filesystem()
    out_dir = f"{bucket}/{PREFIX}/{job_id}/output"
    objects = {
        posixpath.basename(i.path): i
        for i in fs.get_file_info(pafs.FileSelector(out_dir, recursive=True))
        if i.type == pafs.FileType.File
    }
    assert objects[SUCCESS_NAME].size == 0
    manifest = json.loads(fs.open_input_stream(f"{out_dir}/{MANIFEST_NAME}").read())
    assert manifest["job_id"] == job_id and manifest["status"] == "completed"
    assert manifest["rows"]["total"] == len(expected)
    parts = sorted(n for n in objects if n not in (SUCCESS_NAME, MANIFEST_NAME))
    assert parts and all(PART.fullmatch(n) for n in parts), parts  # no temporary objects

    # pyarrow's dataset over the prefix skips `_`-names: the part files are the table.
    dataset = ds.dataset(out_dir + "/", filesystem=fs, format="parquet")
    assert sorted(posixpath.basename(f) for f in dataset.files) == parts
    rows = dataset.to_table().to_pylist()
    assert_exactly_once(rows, expected)
    assert len(rows) == len(expected)

    con = duckdb.connect()
    con.register("output", dataset)
    total, distinct, first, last = con.execute(
        "SELECT count(*), count(DISTINCT line), min(line), max(line) FROM output"
    ).fetchone()
    assert (total, distinct, first, last) == (len(expected), len(expected), 1, len(expected))
    by_status = dict(con.execute("SELECT status, count(*) FROM output GROUP BY status").fetchall())
    want = Counter(status for _, status in expected.values())
    assert by_status == dict(want)
    assert manifest["rows"] == {"total": len(expected), "ok": want["ok"], "error": want["error"]}
    return by_status


# -- `batchllm run`: one process, no fleet --------------------------------------------------------


def test_batchllm_run_of_an_s3_input_writes_its_output_to_the_bucket(
    s3_server, bucket, s3_env, tiny_model, tmp_path
):
    """One `batchllm run` reads its input from the bucket, stores its job there, and
    `--output` copies the dataset out. The instant engine: the storage is the subject (a real
    engine's `batchllm run` is tests/engine/test_run_real_vllm.py's)."""
    local = write_workload(
        tmp_path / "prompts.jsonl",
        requests=60,
        prompt_words=(4, 16),
        forms=("prompt", "chat", "openai_chat"),
        bad_lines=3,
        seed=11,
    )
    expected = expected_rows(local)
    uri = upload(s3_server, f"{bucket}/in/run-prompts.jsonl", local)
    env = run_env(s3_env, tmp_path / "home")

    missing = batchllm("run", uri + ".nope", "--model", str(tiny_model), env=env, timeout=120)
    assert missing.returncode == 2, missing.stderr
    assert "no such file" in missing.stderr, missing.stderr

    copy = tmp_path / "copy"
    started = time.monotonic()
    ran = batchllm(
        "run",
        uri,
        "--model",
        str(tiny_model),
        "--max-tokens",
        "8",
        *ENGINE_FLAGS,
        "--engine",
        "instant",
        "--output",
        str(copy),
        env=env,
        timeout=300,
    )
    took = time.monotonic() - started

    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "status     completed" in ran.stdout, ran.stdout
    assert "requests   60/60 done: 57 ok, 3 error" in ran.stdout, ran.stdout
    job_id = ran.stdout.split("job        ", 1)[1].split()[0]
    assert f"s3://{bucket}/{PREFIX}/{job_id}/output" in ran.stdout  # where the results are
    status = batchllm("status", job_id, "--json", env=env, timeout=120)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["input_file"] == uri
    counts = read_back(s3_server, bucket, job_id, expected)
    # `--output` copied the dataset out of the bucket.
    copied = ds.dataset(str(copy), format="parquet").to_table()
    assert sorted(copied.column("line").to_pylist()) == list(range(1, 61))
    assert (copy / MANIFEST_NAME).is_file() and (copy / SUCCESS_NAME).is_file()
    assert "hardware   none (instant engine)" in ran.stdout, ran.stdout
    print(f"\nbatchllm run {uri}: {counts}, {took:.0f} s")


# -- the fleet: workers storing into the bucket --------------------------------------------------


@pytest.fixture(scope="module")
def s3_fleet_env(fleet_env: FleetEnv, s3_env: dict[str, str]) -> FleetEnv:
    """The fleet tests' PostgreSQL and Redis databases, with the job storage in the bucket."""
    env = {**fleet_env.env, **S3_WORKER_SETTINGS, **s3_env}
    settings = Settings(
        **{
            k.removeprefix("BATCHLLM_").lower(): v
            for k, v in env.items()
            if k.startswith("BATCHLLM_")
        }
    )
    assert settings.resolved_storage == s3_env["BATCHLLM_STORAGE"]
    return FleetEnv(settings=settings, env=env, redis=fleet_env.redis)


@pytest.fixture(scope="module")
def s3_pair(s3_fleet_env: FleetEnv, tiny_model: Path, tmp_path_factory):
    """Two workers (paced instant engines: the storage is the subject) whose storage is the
    bucket, proven by a first job (which also runs with its storage in the bucket)."""
    work_dir = tmp_path_factory.mktemp("s3-workers")
    with warm_workers(
        ["s3w1@test", "s3w2@test"], fleet_env=s3_fleet_env, model=tiny_model, work_dir=work_dir
    ) as workers:
        yield workers


def test_batchllm_submit_of_an_s3_input_runs_on_the_fleet_into_the_bucket(
    s3_pair, s3_fleet_env, s3_server, bucket, tiny_model, tmp_path
):
    local = write_workload(
        tmp_path / "prompts.jsonl",
        requests=400,
        prompt_words=(4, 24),
        max_tokens=(4, 24),
        forms=("prompt", "chat", "openai_chat"),
        bad_lines=4,
        seed=13,
    )
    expected = expected_rows(local)
    uri = upload(s3_server, f"{bucket}/in/fleet-prompts.jsonl", local)
    started = time.monotonic()

    submitted = batchllm(
        "submit",
        uri,
        "--model",
        str(tiny_model),
        "--max-tokens",
        "24",
        *ENGINE_FLAGS,
        "--shard-size",
        "100",
        env=s3_fleet_env.env,
        timeout=180,
    )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job_id = submitted.stdout.strip()
    assert "400 requests: 396 valid, 4 invalid" in submitted.stderr
    assert "in 4 shard(s), queued" in submitted.stderr
    waited = batchllm("wait", job_id, "--timeout", "300", env=s3_fleet_env.env, timeout=330)
    took = time.monotonic() - started

    assert waited.returncode == 0, waited.stderr[-2000:] + tails(s3_pair)
    job, shards = load_job(s3_fleet_env, job_id)
    assert job.status is JobStatus.COMPLETED, job.error
    assert job.input_file == uri
    assert job.output_dir == f"s3://{bucket}/{PREFIX}/{job_id}/output"
    assert [s.status for s in shards] == [ShardStatus.COMPLETED] * 4
    assert all(s.input_path.startswith(f"{bucket}/{PREFIX}/{job_id}/input/") for s in shards)
    counts = read_back(s3_server, bucket, job_id, expected)
    head = batchllm("results", job_id, "--head", "3", env=s3_fleet_env.env, timeout=120)
    assert head.returncode == 0, head.stderr
    assert [line.split()[0] for line in head.stdout.splitlines()[-3:]] == ["1", "2", "3"]
    print(
        f"\nfleet job from {uri}: {counts} in {len(shards)} shards on "
        f"{sorted({s.worker for s in shards})}, submit to completed {took:.0f} s"
    )


def test_a_worker_killed_mid_shard_leaves_exactly_one_row_per_line_in_the_bucket(
    s3_pair, s3_fleet_env, s3_server, bucket, tiny_model, tmp_path
):
    source = write_workload(tmp_path / "prompts.jsonl", requests=1200, max_tokens=(32, 96), seed=14)
    expected = expected_rows(source)
    job = s3_fleet_env.submit(source, tiny_model, shard_size=600, max_tokens=96)
    workers = {w.name: w for w in s3_pair}

    def shard_mid_way():
        # Running, a few checkpoints in, plenty left to lose.
        for shard in load_job(s3_fleet_env, job.id)[1]:
            done = shard.rows_ok + shard.rows_failed
            running = shard.status is ShardStatus.RUNNING and shard.worker in workers
            if running and 100 <= done <= shard.rows - 200:
                return shard
        return None

    victim_shard = wait_for(
        shard_mid_way, timeout=240, what="a shard past its checkpoints", interval=0.1
    )
    victim = workers[victim_shard.worker]
    victim.kill()  # SIGKILL to its process group, by PID
    killed_at = time.monotonic()
    survivor = next(w for w in s3_pair if w is not victim)
    committed = checkpoints_of(s3_fleet_env, victim_shard.id)
    committed_rows = sum(c.rows for c in committed)
    assert committed and committed_rows < victim_shard.rows
    # What a worker killed between a part's upload and its checkpoint leaves behind: an object
    # no checkpoint records, here with a row for every line of the shard.
    storage = Storage.of(s3_fleet_env.settings)
    _, shards = load_job(s3_fleet_env, job.id)
    dead = next(s for s in shards if s.id == victim_shard.id)
    stray = part_name(dead.index, dead.next_seq, dead.attempts)
    write_part(
        storage,
        storage.output_dir(job.id),
        stray,
        [
            OutputRow(f"stray-{n}", n, "ok", text="stray")
            for n in _lines_of(storage, dead.input_path)
        ],
    )

    def taken_over():
        shard = next(s for s in load_job(s3_fleet_env, job.id)[1] if s.id == victim_shard.id)
        return shard.attempts > dead.attempts

    wait_for(taken_over, timeout=240, what="the killed worker's shard to be taken over")
    recovered = time.monotonic() - killed_at
    job = wait_until_final(s3_fleet_env, job.id, timeout=300)
    finished = time.monotonic() - killed_at
    job, shards = load_job(s3_fleet_env, job.id)

    assert job.status is JobStatus.COMPLETED, job.error + tails(s3_pair)
    assert not storage.exists(posixpath.join(storage.output_dir(job.id), stray))
    counts = read_back(s3_server, bucket, job.id, expected)
    assert counts == {"ok": 1200}
    shard = next(s for s in shards if s.id == victim_shard.id)
    assert shard.worker == survivor.name and shard.rows_ok == shard.rows
    after = checkpoints_of(s3_fleet_env, shard.id)
    assert [c.path for c in after[: len(committed)]] == [c.path for c in committed]
    assert sum(c.rows for c in after) == shard.rows
    assert survivor.proc.poll() is None
    print(
        f"\nkill -9 on s3 storage: {victim.name} killed on shard {shard.index} after "
        f"{committed_rows} of {shard.rows} rows committed ({len(committed)} parts); a stray "
        f"part planted; {survivor.name} took it over {recovered:.0f} s later and the job "
        f"completed {finished:.0f} s after the kill: {counts}"
    )


def _lines_of(storage: Storage, input_path: str) -> list[int]:
    """A stored input shard's lines (placed by prompt: not a range of the file)."""
    with storage.fs.open_input_file(input_path) as handle:
        return pq.read_table(handle, columns=["line"]).column("line").to_pylist()
