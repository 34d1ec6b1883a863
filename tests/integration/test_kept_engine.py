"""Kept engines end to end (batchllm/kept_engine/): real `batchllm run` and `batchllm engine`
processes in a test's own SQLite home, and the background kept engine they find or start,
reached over its Unix socket. The instant engine only (no vLLM: tests/engine/
test_kept_engine_vllm.py has the real one), paced with --instant-step-seconds where a job must
last long enough to be killed or interrupted part-way; no Redis or PostgreSQL.

Every test ends the kept engines of its home at teardown and checks none is left (the `kept`
fixture: tests/support/kept_engines.py)."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchllm.client import Client
from batchllm.errors import BatchLLMError
from batchllm.kept_engine import registry, wire
from batchllm.kept_engine.client import KeptEngines, RemoteEngine
from batchllm.output.parts import SUCCESS_NAME
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus
from tests.support.homes import seed_home
from tests.support.kept_engines import (
    START_DEADLINE,
    KeptHome,
    engine_ids_started,
    engine_ids_used,
    job_id_of,
    pid_alive,
    sigkill,
    wait_for,
    write_prompts,
)

pytestmark = pytest.mark.integration

INSTANT = ("--engine", "instant")
KEEP = ("--keep-alive", "5m")
# A job's rows committed often, so the tests see its progress in the database as it goes.
COMMITS = {"BATCHLLM_COMMIT_ROWS": "8", "BATCHLLM_COMMIT_SECONDS": "1"}
RUN_DEADLINE = 180.0
NOBODY = 65534


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's tokenizer and config, no weights: all the instant engine loads."""
    from batchllm.engine.models.demo_model import build_demo_tokenizer

    return build_demo_tokenizer(tmp_path_factory.mktemp("model") / "tiny-tokenizer")


@pytest.fixture
def kept(settings: Settings, tmp_path: Path) -> Iterator[KeptHome]:
    """The test's home for `batchllm` processes; its kept engines are ended at teardown."""
    home = KeptHome.of(settings, tmp_path / "logs", **COMMITS)
    try:
        yield home
    finally:
        home.stop_all()


def job_of(settings: Settings, job_id: str) -> Job:
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job is not None, job_id
        session.expunge(job)
        return job


def rows_of(settings: Settings, job_id: str) -> list[dict]:
    return Client(settings).results(job_id).to_table().to_pylist()


def latest_job(settings: Settings) -> Job | None:
    with session_scope(settings) as session:
        job = session.query(Job).order_by(Job.created_at.desc()).first()
        if job is not None:
            session.expunge(job)
        return job


def assert_exactly_once(rows: list[dict], prefix: str, count: int, max_tokens: int) -> None:
    """Every line of the file write_prompts(prefix, count) once, ok, at its max_tokens."""
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a line came out more than once"
    assert sorted(ids) == sorted(f"{prefix}-{i}" for i in range(count))
    assert sorted(r["line"] for r in rows) == list(range(1, count + 1))
    bad = [r for r in rows if r["status"] != "ok" or r["completion_tokens"] != max_tokens]
    assert not bad, f"{len(bad)} rows not ok at {max_tokens} tokens, e.g. {bad[0]}"


def run_args(source: Path, model: Path, *extra: str) -> tuple[str, ...]:
    return ("run", str(source), "--model", str(model), *INSTANT, *extra)


# -- a. two runs at once on one kept engine ------------------------------------------------------


@pytest.mark.timeout(300)
def test_two_runs_at_once_share_one_kept_engine_and_each_gets_only_its_own_rows(
    kept: KeptHome, settings: Settings, model: Path, tmp_path: Path
) -> None:
    pace = ("--instant-step-seconds", "0.02")
    started = kept.cli("engine", "start", "--model", str(model), *INSTANT, *pace, *KEEP)
    assert started.returncode == 0, str(started)
    assert "kept engine eng_" in started.stdout and " ready in " in started.stdout, str(started)
    (record,) = kept.records()
    engine_id = record["id"]
    assert engine_id in started.stdout
    assert (record["state"], record["kind"], record["uid"]) == ("ready", "instant", os.getuid())
    assert record["keep_alive"] == 300 and pid_alive(record["pid"])
    assert Path(record["socket"]).is_socket()
    (before,) = kept.status()
    assert (before["id"], before["runs"], before["in_flight"]) == (engine_id, 0, 0)

    # 300 lines each at 100 tokens, 256 at a time at 0.02 s a token: ~4 s of engine time
    # alone, so the second run connects while the first is still generating.
    max_tokens = 100
    sources = {p: write_prompts(tmp_path / f"{p}.jsonl", p, 300) for p in ("a", "b")}
    # A connection of the test's own watches how many runs the engine serves at once.
    watched = registry.read_record(registry.state_path(kept.home, engine_id))
    assert watched is not None
    watcher = RemoteEngine(watched, keep_alive=None)
    try:
        runs = {
            p: kept.start(*run_args(src, model, "--max-tokens", str(max_tokens), *pace, *KEEP))
            for p, src in sources.items()
        }
        most_at_once = 0
        deadline = time.monotonic() + RUN_DEADLINE
        while any(r.proc.poll() is None for r in runs.values()):
            most_at_once = max(most_at_once, watcher.status()["runs"] - 1)  # not the watcher
            assert time.monotonic() < deadline, "\n".join(str(r.ran()) for r in runs.values())
            time.sleep(0.05)
    finally:
        watcher.shutdown()
    ran = {p: r.wait(timeout=10) for p, r in runs.items()}

    for prefix, result in ran.items():
        assert result.returncode == 0, str(result)
        assert engine_ids_used(result.stderr) == [engine_id], str(result)
        assert engine_ids_started(result.stderr) == [], str(result)
        job_id = job_id_of(result.stderr)
        job = job_of(settings, job_id)
        assert job.status is JobStatus.COMPLETED, (job.status, job.error)
        assert job.request_completed == 300
        assert_exactly_once(rows_of(settings, job_id), prefix, 300, max_tokens)
    assert most_at_once == 2, f"the engine served {most_at_once} runs at once, not both"

    (after,) = kept.status()
    assert (after["id"], after["pid"], after["state"]) == (engine_id, record["pid"], "ready")
    # `engine start`'s connection, the watcher's, and each run's
    assert after["runs_served"] >= before["runs_served"] + 3, (before, after)
    assert (after["runs"], after["in_flight"]) == (0, 0)
    assert [r["id"] for r in kept.records()] == [engine_id]


# -- b. idle unload ------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_kept_engine_unloads_once_idle_for_its_keep_alive(
    kept: KeptHome, settings: Settings, model: Path, tmp_path: Path
) -> None:
    source = write_prompts(tmp_path / "idle.jsonl", "idle", 20)
    run = kept.start(*run_args(source, model, "--max-tokens", "4", "--keep-alive", "3s"))
    # Its state file exists from its start until it unloads, at least 3 s after the run.
    record = wait_for(
        lambda: next(iter(kept.records()), None),
        timeout=START_DEADLINE,
        what=lambda: f"a kept engine's state file\n{run.ran()}",
    )
    ran = run.wait(timeout=RUN_DEADLINE)
    assert ran.returncode == 0, str(ran)
    assert engine_ids_started(ran.stderr) == [record["id"]], str(ran)
    assert record["keep_alive"] == 3
    assert job_of(settings, job_id_of(ran.stderr)).status is JobStatus.COMPLETED

    def unloaded() -> bool:
        return not pid_alive(record["pid"]) and not kept.leftovers()

    wait_for(
        unloaded,
        timeout=90,
        what=lambda: (
            f"{record['id']} to unload: left {kept.leftovers()}\n{kept.tail(record['id'])}"
        ),
    )
    assert not list(kept.engines_dir.glob("eng_*.json"))
    assert not Path(record["socket"]).exists()
    log = (kept.engines_dir / f"{record['id']}.log").read_text()
    assert f"kept engine {record['id']} unloading: idle for 3 s" in log, log
    assert kept.status() == []


# -- c. the kept engine killed mid-job -----------------------------------------------------------


@pytest.mark.timeout(360)
def test_a_run_whose_kept_engine_is_killed_goes_on_on_a_new_one_and_writes_each_line_once(
    kept: KeptHome, settings: Settings, model: Path, tmp_path: Path
) -> None:
    # 8 requests at a time, 16 tokens at 0.02 s each: 8 rows every ~0.35 s, ~9 s for 200.
    lines, max_tokens = 200, 16
    source = write_prompts(tmp_path / "c.jsonl", "c", lines)
    pace = ("--instant-step-seconds", "0.02", "--max-num-seqs", "8")
    run = kept.start(*run_args(source, model, "--max-tokens", str(max_tokens), *pace, *KEEP))

    def some_rows_committed() -> tuple[str, int] | None:
        assert run.proc.poll() is None, f"the run ended before the kill:\n{run.ran()}"
        job = latest_job(settings)
        return (job.id, job.request_completed) if job and job.request_completed else None

    job_id, committed = wait_for(
        some_rows_committed, timeout=RUN_DEADLINE, what=lambda: f"committed rows\n{run.ran()}"
    )
    (first,) = kept.ready()
    sigkill(first["pid"])
    assert committed < lines, "the job had finished before the kill"

    ran = run.wait(timeout=RUN_DEADLINE)
    assert ran.returncode == 0, str(ran)
    job = job_of(settings, job_id)
    assert job.status is JobStatus.COMPLETED, (job.status, job.error)
    assert (job.request_completed, job.request_failed) == (lines, 0)
    assert_exactly_once(rows_of(settings, job_id), "c", lines, max_tokens)

    started = engine_ids_started(ran.stderr)
    assert len(started) == 2 and started[0] == first["id"], str(ran)
    (second,) = kept.ready()
    assert second["id"] == started[1] != first["id"]
    assert second["pid"] != first["pid"] and not pid_alive(first["pid"])
    assert [s["id"] for s in kept.status()] == [second["id"]]


# -- d. a second user is refused -----------------------------------------------------------------


def test_a_run_refuses_a_kept_engine_socket_of_another_user(
    kept: KeptHome, settings: Settings, model: Path, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a socket owned by another user needs root (chown)")
    engine_id = registry.new_engine_id()
    path = registry.socket_path(settings.home, engine_id)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    os.chown(path, NOBODY, NOBODY)
    # A live process for its pid, so the state file is not forgotten as a dead engine's.
    holder = subprocess.Popen(["sleep", "300"])
    engines = KeptEngines(settings, keep_alive=300.0, kind="instant")
    spec = JobSpec(model=str(model))
    record = registry.EngineRecord(
        id=engine_id,
        key=engines.key(spec),
        model=str(model),
        kind="instant",
        pid=holder.pid,
        uid=os.getuid(),  # a state file can claim anything: the socket's owner decides
        socket=path,
        state=registry.READY,
        max_model_len=4096,
        started_at=time.time(),
    )
    registry.write_record(settings.home, record)
    try:
        with pytest.raises(BatchLLMError, match=f"belongs to user id {NOBODY}"):
            engines.get(spec, 512)
        engines.close()

        source = write_prompts(tmp_path / "d.jsonl", "d", 3)
        ran = kept.cli(*run_args(source, model, "--max-tokens", "4", *KEEP))
        assert ran.returncode != 0, str(ran)
        assert f"belongs to user id {NOBODY}" in ran.stdout + ran.stderr, str(ran)
        # Nothing was started in its place, and the other user's socket is left alone.
        assert [r["id"] for r in kept.records()] == [engine_id]
        assert Path(path).is_socket() and os.stat(path).st_uid == NOBODY
    finally:
        holder.kill()
        holder.wait(timeout=30)
        listener.close()
        registry.remove_record(settings.home, engine_id)
        Path(path).unlink(missing_ok=True)


def _hello_as(uid: int, path: str) -> tuple:
    """What the kept engine at `path` answers ("hello", None) from a process of user `uid`
    (a forked child that drops to it): its reply, or ("error", why)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no logging; it always leaves through os._exit
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(path)
                try:
                    wire.send(conn, ("hello", None))
                except BrokenPipeError:
                    pass  # the engine may have closed after its answer: read it anyway
                reply = wire.receive(conn)
        except BaseException as exc:
            reply, code = ("error", f"{type(exc).__name__}: {exc}"), 1
        try:
            with os.fdopen(write_end, "wb") as out:
                out.write(repr(reply).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        text = answer.read().decode()
    os.waitpid(pid, 0)
    return ast.literal_eval(text)


@pytest.mark.timeout(300)
def test_a_kept_engine_refuses_a_peer_of_another_user(
    tmp_path_factory: pytest.TempPathFactory, migrated_database: Path, model: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("connecting as another user needs root (setuid in a forked child)")
    # A home whose folders another user may pass through (pytest's own are its user's alone).
    top = Path(tempfile.mkdtemp(prefix="kept-uid-", dir="/tmp"))
    top.chmod(0o711)
    home = seed_home(top / "home", migrated_database)
    kept = KeptHome.of(Settings(home=home), tmp_path_factory.mktemp("uid-logs"))
    try:
        started = kept.cli("engine", "start", "--model", str(model), *INSTANT, *KEEP)
        assert started.returncode == 0, str(started)
        (record,) = kept.ready()
        path = record["socket"]
        assert Path(path).parent == home / "engines"
        assert (Path(path).stat().st_mode & 0o777, kept.engines_dir.stat().st_mode & 0o777) == (
            0o700,
            0o700,
        ), "the socket and its folder must be their user's alone"
        # Open the way for the other user (the client's and the folder's own checks aside):
        # what is left to refuse it is the engine's SO_PEERCRED check.
        home.chmod(0o711)
        kept.engines_dir.chmod(0o711)
        os.chmod(path, 0o777)

        reply = _hello_as(NOBODY, path)
        assert reply[0] == "refused", reply
        assert f"serves user id {os.getuid()} only, not {NOBODY}" in reply[1], reply

        # Its own user is still served, and the refused peer was never counted as a run.
        (status,) = kept.status()
        assert (status["id"], status["state"]) == (record["id"], "ready")
        assert status["runs_served"] == 1, status  # `engine start`'s connection alone
        log = (kept.engines_dir / f"{record['id']}.log").read_text()
        assert f"refused a connection from user id {NOBODY}" in log, log
        assert _hello_as(os.getuid(), path)[0] == "ok"
    finally:
        kept.stop_all()
        shutil.rmtree(top, ignore_errors=True)


# -- e. other engine options, another engine ----------------------------------------------------


@pytest.mark.timeout(300)
def test_runs_with_other_engine_options_get_their_own_kept_engine(
    kept: KeptHome, settings: Settings, model: Path, tmp_path: Path
) -> None:
    source = write_prompts(tmp_path / "e.jsonl", "e", 20)

    def run(max_num_seqs: int):
        ran = kept.cli(
            *run_args(
                source, model, "--max-tokens", "4", "--max-num-seqs", str(max_num_seqs), *KEEP
            ),
            timeout=RUN_DEADLINE,
        )
        assert ran.returncode == 0, str(ran)
        job = job_of(settings, job_id_of(ran.stderr))
        assert job.status is JobStatus.COMPLETED, (job.status, job.error)
        assert_exactly_once(rows_of(settings, job.id), "e", 20, 4)
        return ran

    eight = run(8)
    (first,) = engine_ids_started(eight.stderr)
    sixteen = run(16)
    (second,) = engine_ids_started(sixteen.stderr)
    assert second != first
    assert engine_ids_used(sixteen.stderr) == [], str(sixteen)

    ready = {r["id"]: r for r in kept.ready()}
    assert set(ready) == {first, second}
    assert ready[first]["pid"] != ready[second]["pid"]
    assert '"max_num_seqs":8,' in ready[first]["key"], ready[first]["key"]
    assert '"max_num_seqs":16,' in ready[second]["key"], ready[second]["key"]

    again = run(8)
    assert engine_ids_used(again.stderr) == [first], str(again)
    assert engine_ids_started(again.stderr) == [], str(again)
    served = {s["id"]: s["runs_served"] for s in kept.status()}
    assert served.keys() == {first, second}
    assert served[first] > served[second] >= 1, served


# -- f. Ctrl-C -----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_ctrl_c_fails_the_run_s_job_with_its_rows_and_leaves_the_kept_engine_up(
    kept: KeptHome, settings: Settings, model: Path, tmp_path: Path
) -> None:
    # 8 requests at a time, 20 tokens at 0.05 s each: 8 rows a second, 25 s for 200.
    lines, max_tokens = 200, 20
    source = write_prompts(tmp_path / "f.jsonl", "f", lines)
    pace = ("--instant-step-seconds", "0.05", "--max-num-seqs", "8")
    flags = ("--max-tokens", str(max_tokens), *pace, *KEEP)
    run = kept.start(*run_args(source, model, *flags))

    def progressed() -> str | None:
        assert run.proc.poll() is None, f"the run ended before Ctrl-C:\n{run.ran()}"
        job = latest_job(settings)
        return job.id if job and job.request_completed else None

    job_id = wait_for(progressed, timeout=RUN_DEADLINE, what=lambda: f"progress\n{run.ran()}")
    (engine,) = kept.ready()
    # A terminal's Ctrl-C: SIGINT to the run's whole process group. The kept engine has a
    # session of its own, so it is not in that group.
    assert os.getsid(engine["pid"]) == engine["pid"] != os.getsid(run.proc.pid)
    os.killpg(run.proc.pid, signal.SIGINT)
    ran = run.wait(timeout=60)

    assert ran.returncode == 130, str(ran)
    job = job_of(settings, job_id)
    assert job.status is JobStatus.FAILED and job.error == "interrupted", (job.status, job.error)
    rows = rows_of(settings, job_id)
    assert 0 < len(rows) < lines, len(rows)
    assert len(rows) == job.request_completed + job.request_failed
    ids = [r["custom_id"] for r in rows]
    assert len(set(ids)) == len(ids) and set(ids) <= {f"f-{i}" for i in range(lines)}
    assert all(r["status"] == "ok" and r["completion_tokens"] == max_tokens for r in rows)
    storage = Storage.for_job(job, settings)
    assert not storage.exists(f"{storage.output_dir(job_id)}/{SUCCESS_NAME}")

    assert pid_alive(engine["pid"])
    (status,) = kept.status()
    assert (status["id"], status["state"], status["pid"]) == (
        engine["id"],
        "ready",
        engine["pid"],
    )
    # The interrupted run left: its requests in flight were dropped with it.
    wait_for(
        lambda: kept.status()[0]["in_flight"] == 0,
        timeout=30,
        what="the interrupted run's requests to leave the engine",
    )

    small = write_prompts(tmp_path / "after.jsonl", "after", 10)
    after = kept.cli(*run_args(small, model, *flags), timeout=RUN_DEADLINE)
    assert after.returncode == 0, str(after)
    assert engine_ids_used(after.stderr) == [engine["id"]], str(after)
    assert engine_ids_started(after.stderr) == []
    assert_exactly_once(rows_of(settings, job_id_of(after.stderr)), "after", 10, max_tokens)
