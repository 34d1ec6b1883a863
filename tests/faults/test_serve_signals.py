"""A signal to `batchllm serve --worker` ends everything it started.

SIGTERM is what systemd, Docker and Kubernetes send, SIGINT a terminal's Ctrl-C, SIGHUP a closed
terminal or SSH session. After any of them the server, its worker and the worker's vLLM engine
processes must all be gone: a worker left under PID 1 keeps taking tasks, and its EngineCore
keeps gigabytes of memory (a whole GPU on a GPU node).

Each case starts a real server with a worker on a private Redis (its own port) and SQLite (its
own BATCHLLM_HOME), submits a small job so that the worker builds its engine, and signals the
server once the engine processes exist: no need to wait the 20-90 s until the engine is ready,
what matters is that none of them outlives the server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from batchllm.demo.workload import write_workload
from tests.support.faults import (
    RedisServer,
    alive_of,
    descendants,
    engine_processes,
    kill_recorded,
    wait_all_gone,
)
from tests.support.fleet import REPO, tail
from tests.support.job_checks import wait_for
from tests.support.ports import free_port
from tests.support.skips import require

pytestmark = pytest.mark.faults

ENGINE_STARTS_WITHIN = 240  # worker start, task pickup, engine process spawn; two busy cores
# serve gives its worker 120 s for a warm shutdown before SIGKILL; the engine processes follow
# their parent within seconds of its end.
ALL_GONE_WITHIN = 180


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    import shutil

    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    server = RedisServer(work_dir=tmp_path_factory.mktemp("serve-redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _env(home: Path, broker: RedisServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    env["BATCHLLM_KEEP_ALIVE"] = "0"  # no engine kept after the test
    env.update(
        {
            "BATCHLLM_HOME": str(home),
            "BATCHLLM_BROKER_URL": broker.url,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
            # vLLM's engine processes, as a several-device engine always has them (a one-device
            # engine's core runs in the worker by default, engine/start_settings.py): what must
            # not outlive the server is what these cases are about.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        }
    )
    return env


def _answers(port: int, serve: subprocess.Popen, log_path: Path) -> bool:
    assert serve.poll() is None, "serve exited early:\n" + tail(log_path)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def _start_serve(env: dict[str, str], port: int, model: Path, log_path: Path) -> subprocess.Popen:
    """`serve --no-auth --worker MODEL` in its own session: a signal reaches the server alone,
    as `kill PID` or systemd sends it."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "batchllm", "serve", "--no-auth", "--port", str(port)]
            + ["--worker", str(model)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name
)
def test_a_signal_to_serve_with_a_worker_leaves_none_of_its_processes(
    sig: signal.Signals, broker: RedisServer, tiny_model: Path, tmp_path: Path
) -> None:
    env = _env(tmp_path / "home", broker)
    log_path = tmp_path / "serve.log"
    port = free_port()
    command = [sys.executable, "-m", "batchllm"]
    serve = _start_serve(env, port, tiny_model, log_path)
    recorded = {serve.pid: psutil.Process(serve.pid).create_time()}
    try:
        # Submit once the server answers: both would otherwise create the fresh SQLite
        # database at once.
        wait_for(lambda: _answers(port, serve, log_path), timeout=120, what="serve to answer")
        source = write_workload(tmp_path / "j.jsonl", requests=20)
        submitted = subprocess.run(
            [*command, "submit", str(source), "--model", str(tiny_model)]
            + ["--max-tokens", "8", "--max-model-len", "512", "--enforce-eager"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert submitted.returncode == 0, submitted.stderr

        def engine_up() -> bool:
            recorded.update(descendants(serve.pid))
            assert serve.poll() is None, "serve exited early:\n" + tail(log_path)
            return bool(engine_processes(serve.pid))

        wait_for(engine_up, timeout=ENGINE_STARTS_WITHIN, what="the worker's engine processes")
        recorded.update(descendants(serve.pid))
        assert len(recorded) >= 3, recorded  # serve, its worker, at least one engine process

        serve.send_signal(sig)

        def all_gone() -> bool:
            serve.poll()  # reap it, so that it does not count as alive
            return not alive_of(recorded)

        wait_all_gone(
            all_gone,
            recorded,
            within=ALL_GONE_WITHIN,
            after=sig.name,
            what="serve and all its processes to end",
            log_path=log_path,
        )
        serve.wait(timeout=30)  # it may have ended between all_gone's poll and its check
        # SIGTERM and SIGHUP end it by SIGTERM once its worker is stopped, as systemd expects;
        # uvicorn.run ends Ctrl-C's KeyboardInterrupt itself.
        assert serve.returncode == (0 if sig == signal.SIGINT else -signal.SIGTERM), tail(log_path)
    finally:
        kill_recorded(recorded)
        serve.poll()


def test_a_worker_started_by_serve_stops_when_serve_is_killed(
    broker: RedisServer, tiny_model: Path, tmp_path: Path
) -> None:
    """SIGKILL (an OOM kill, `kill -9`) leaves serve no chance to stop its worker: the worker
    watches serve and stops itself."""
    env = _env(tmp_path / "home", broker)
    log_path = tmp_path / "serve.log"
    port = free_port()
    serve = _start_serve(env, port, tiny_model, log_path)
    recorded = {serve.pid: psutil.Process(serve.pid).create_time()}
    try:
        wait_for(lambda: _answers(port, serve, log_path), timeout=120, what="serve to answer")

        def worker_started() -> bool:
            recorded.update(descendants(serve.pid))
            return len(recorded) >= 2

        wait_for(worker_started, timeout=60, what="serve's worker process")
        serve.kill()
        serve.wait(timeout=30)

        def all_gone() -> bool:
            for pid in list(recorded):  # the worker may still be starting children
                recorded.update(descendants(pid))
            return not alive_of(recorded)

        wait_all_gone(
            all_gone,
            recorded,
            within=ALL_GONE_WITHIN,
            after="serve's SIGKILL",
            what="the worker to stop after serve",
            log_path=log_path,
        )
        assert "is gone: stopping" in log_path.read_text(errors="replace"), tail(log_path)
    finally:
        kill_recorded(recorded)
        serve.poll()
