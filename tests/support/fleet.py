"""What the integration and fault suites share about a fleet under test: the environment its
workers and the test process read their settings from, submitting a job and running the CLI
the way a user does, and one `batchllm worker` process with its log.

Each suite keeps what is its own: the integration suite uses the machine's Redis and
PostgreSQL (a private database in each), the fault suite private servers it stops and starts,
and kills workers in ways of its own (tests/faults/harness.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from batchllm.input.schemas import EngineOptions, JobSpec, SamplingDefaults
from batchllm.settings import Settings
from tests.support.cli import REPO, run_cli
from tests.support.worker_logs import named_log_tail

HOST = "127.0.0.1"
__all__ = ["REPO", "run_cli"]

# Every job of the fleet suites uses these engine options, and every worker is started with
# the matching engine flags: a worker owns its engine, and jobs whose requirements it meets
# (an explicit max_model_len up to its own) run on it as it is.
ENGINE = EngineOptions(enforce_eager=True, max_model_len=512)
WORKER_ENGINE_ARGS = ("--enforce-eager", "--max-model-len", "512")


def fleet_env_vars(
    *,
    root: Path,
    database_url: str,
    broker_url: str,
    worker_settings: dict[str, str],
) -> dict[str, str]:
    """The environment of the fleet's processes: this one's, without its BATCHLLM_ settings,
    with the fleet's database, broker and storage, offline, and a small KV cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    env.update(worker_settings)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
            "BATCHLLM_HOME": str(root / "home"),
            "BATCHLLM_DATABASE_URL": database_url,
            "BATCHLLM_BROKER_URL": broker_url,
            "BATCHLLM_STORAGE": str(root / "storage"),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def settings_of(env: dict[str, str]) -> Settings:
    """The settings the fleet's processes read from `env`: the test process reads and submits
    with the same ones."""
    return Settings(
        **{
            k.removeprefix("BATCHLLM_").lower(): v
            for k, v in env.items()
            if k.startswith("BATCHLLM_")
        }
    )


def submit(settings: Settings, source: Path, model: Path | str, *, shard_size: int, **sampling):
    """Submit a job to the fleet the way `batchllm submit` does; returns the Job row."""
    from batchllm.jobs.submit import submit_job

    spec = JobSpec(model=str(model), engine=ENGINE, sampling=SamplingDefaults(**sampling))
    return submit_job(source, spec, shard_size=shard_size, settings=settings)


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class WorkerProcess:
    """One `batchllm worker` process in its own process group (vLLM starts an EngineCore child
    and its workers, so one killpg reaches all of them), its output in a log file."""

    def __init__(
        self,
        name: str,
        *,
        model: Path | str,
        env: dict[str, str],
        log_path: Path,
        append: bool,
        engine_args: tuple[str, ...] = WORKER_ENGINE_ARGS,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("ab" if append else "wb")
        self._terminated = False
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchllm",
                "worker",
                "--model",
                str(model),
                "--name",
                name,
                "--loglevel",
                "INFO",
                *engine_args,
            ],
            env=env,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        try:
            named = named_log_tail(self.log())
        except FileNotFoundError:
            named = ""
        return tail(self.log_path, lines) + named

    def wait_ready(self, timeout: float = 420) -> None:
        """Until Celery says ready, which a worker does only once its engine is built."""
        deadline = time.monotonic() + timeout
        while f"{self.name} ready." not in self.log():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"worker {self.name} exited with {self.proc.returncode}:\n" + self.tail()
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"worker {self.name} not ready after {timeout}s:\n" + self.tail()
                )
            time.sleep(0.2)

    def terminate(self) -> None:
        """Ask for a warm shutdown (once: a second SIGTERM would make it a cold one)."""
        if self.alive() and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def close_log(self) -> None:
        self._log.close()
