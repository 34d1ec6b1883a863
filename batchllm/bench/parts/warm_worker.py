"""The bench's `batchllm worker` (the warm part's, and each of the prefix-cache part's fleet):
a private Redis database for its broker, its environment and command line, and the process
itself, read back through its Prometheus metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.bench.processes import EngineLimits
from batchllm.process.ports import free_port
from batchllm.settings import Settings

_REDIS_HOST, _REDIS_PORT = "127.0.0.1", 6379
_MARK = "batchllm-bench-warm"
_ENGINE_STARTS = "batchllm_engine_starts_total"
_ENGINE_START_SECONDS = "batchllm_engine_start_seconds"
_ENGINE_INFO = "batchllm_engine_info"
# How often the worker's log and the database are read while waiting.
POLL_SECONDS = 0.1


@contextmanager
def private_redis() -> Iterator[str]:
    """An empty database of the local Redis, marked as ours so that nothing else running here
    picks it; flushed afterwards. Yields its URL."""
    import redis

    try:
        redis.Redis(host=_REDIS_HOST, port=_REDIS_PORT, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        raise BenchFailed(
            f"the warm part needs Redis at {_REDIS_HOST}:{_REDIS_PORT}: {exc}"
        ) from None
    token = uuid.uuid4().hex
    for index in range(15, 0, -1):
        client = redis.Redis(host=_REDIS_HOST, port=_REDIS_PORT, db=index)
        try:
            if client.dbsize() == 0 and client.set(_MARK, token, nx=True):
                break
        except redis.ResponseError:  # the server has fewer databases
            continue
    else:
        raise BenchFailed(f"no empty Redis database at {_REDIS_HOST}:{_REDIS_PORT}")
    try:
        yield f"redis://{_REDIS_HOST}:{_REDIS_PORT}/{index}"
    finally:
        client.flushdb()
        client.close()


def fleet_env(settings: Settings) -> dict[str, str]:
    """The environment of the worker and of `batchllm submit`: these settings only, so a
    user's BATCHLLM_DATABASE_URL or broker is never used."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    env.update(
        BATCHLLM_HOME=str(settings.home),
        BATCHLLM_DATABASE_URL=settings.resolved_database_url,
        BATCHLLM_STORAGE=settings.resolved_storage,
        BATCHLLM_BROKER_URL=settings.broker_url,
        PYTHONUNBUFFERED="1",
    )
    return env


def worker_command(
    model: str, limits: EngineLimits | Sequence[str], *, name: str, metrics_port: int
) -> list[str]:
    """`batchllm worker` with the engine flags it builds its engine from: the warm part's
    limits, or the flags themselves (the prefix-cache part's fleet)."""
    flags = limits.flags() if isinstance(limits, EngineLimits) else list(limits)
    return [
        *(sys.executable, "-m", "batchllm", "worker", "--model", model),
        *flags,
        *("--name", name, "--loglevel", "INFO", "--metrics-port", str(metrics_port)),
    ]


class WorkerProcess:
    """One `batchllm worker` in its own process group, with its metrics on a free port.
    `name`: unique among the workers started together [default: the warm part's];
    `env`: more environment (e.g. the cores its engine's threads take)."""

    def __init__(
        self,
        *,
        model: str,
        limits: EngineLimits | Sequence[str],
        settings: Settings,
        log_path: Path,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        from batchllm.process.stopping import PARENT_MARK

        self.model = model
        self.name = name or f"bench-warm-{os.getpid()}@{socket.gethostname()}"
        self.log_path = log_path
        self.metrics_port = free_port()
        self.command = worker_command(model, limits, name=self.name, metrics_port=self.metrics_port)
        # It stops by itself should this process die without stopping it.
        env = fleet_env(settings) | dict(env or {}) | {PARENT_MARK: str(os.getpid())}
        with log_path.open("wb") as log:
            self.started = time.monotonic()
            # Its own session: one signal reaches the worker, its EngineCore and engine workers.
            self.proc = subprocess.Popen(
                self.command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600) -> float:
        """Seconds from the process's start to Celery's `<name> ready.` line. The deadline is
        generous: on these 2 shared cores a build took 166 s under a load of 15."""
        deadline = self.started + timeout
        while f"{self.name} ready." not in self.log():
            if self.proc.poll() is not None:
                raise BenchFailed(f"the worker exited {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise BenchFailed(
                    f"the worker not ready after {timeout:.0f} s; see {self.log_path}"
                )
            time.sleep(POLL_SECONDS)
        return time.monotonic() - self.started

    def metrics(self) -> list[Any]:
        """The samples of the worker's Prometheus registry."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def _model_samples(self, name: str) -> list[Any]:
        return [s for s in self.metrics() if s.name == name and s.labels.get("model") == self.model]

    def total(self, name: str) -> float:
        """A counter of the worker's model, e.g. `batchllm_prompt_tokens_total`."""
        return sum(sample.value for sample in self._model_samples(name))

    def engine_starts(self) -> int:
        return int(self.total(_ENGINE_STARTS))

    def engine(self) -> dict[str, Any]:
        """The engine the worker built, as its metrics describe it: its profile (the
        context and dtype vLLM resolved) and how long the build took."""
        profiles = [s.labels for s in self._model_samples(_ENGINE_INFO) if s.value == 1]
        seconds = [s.value for s in self._model_samples(_ENGINE_START_SECONDS)]
        if len(profiles) != 1 or not seconds:
            raise BenchFailed(
                f"the worker's metrics show {len(profiles)} engine profiles and "
                f"{len(seconds)} start times for {self.model}; expected one of each"
            )
        (profile,) = profiles
        return {
            "max_model_len": int(profile["max_model_len"]),
            "dtype": profile["dtype"],
            "task": profile["task"],
            "start_seconds": seconds[0],
        }

    def cpu_seconds(self) -> float:
        """CPU time used so far by the worker and its engine processes."""
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            for proc in (root, *root.children(recursive=True)):
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
        return total

    def stop(self) -> list[int]:
        """Warm shutdown (the worker shuts its engine down), then make sure that nothing it
        started outlives it: an engine process left behind would hold its memory (a GPU).
        Returns the ids of the processes ended: the worker's and its children's."""
        import psutil

        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            # Not reaped yet, so its group is still ours: the worker and its engine at once.
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        _, alive = psutil.wait_procs(tree, timeout=30)
        for child in alive:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=30)
        return [self.proc.pid, *(child.pid for child in tree)]
