"""The kept engine's process: `python -m batchllm.kept_engine.server CONFIG_JSON`, started by
`batchllm run` or `batchllm engine start` in a session of its own (a terminal's Ctrl-C stops the
run, never the engine). It builds the engine, says so in its state file, serves runs over its
socket, and unloads when idle for its keep-alive, when stopped, or when the engine dies."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from batchllm.engine.protocol import Engine
from batchllm.kept_engine import registry
from batchllm.kept_engine.early import CONFIG_ON_STDIN
from batchllm.kept_engine.host import EngineHost
from batchllm.settings import Settings, get_settings
from batchllm.spec import EngineOptions, JobSpec
from batchllm.storage import Storage

log = logging.getLogger("batchllm.kept_engine")


def build(config: dict[str, Any], settings: Settings) -> Engine:
    """The engine the config names: vLLM, or the instant engine that simulates one."""
    options = EngineOptions.model_validate(config["options"])
    max_model_len = config["max_model_len"]
    if config["kind"] == "instant":
        from batchllm.engine.sizing import light_tokenizer
        from batchllm.execution.instant import DEFAULT_MAX_MODEL_LEN
        from batchllm.execution.stand_in_engines import InstantEngine

        return InstantEngine(
            tokenizer=light_tokenizer(config["model"]),
            max_model_len=max_model_len if max_model_len > 0 else DEFAULT_MAX_MODEL_LEN,
            max_num_seqs=options.max_num_seqs or 256,
            step_seconds=config.get("step_seconds", 0.0),
        )
    from batchllm.execution.engines import build_vllm_engine

    engine, _ = build_vllm_engine(
        config["model"], options, max_model_len, settings, sleep_mode=True
    )
    return engine


def size_job(job: dict[str, Any], settings: Settings) -> int:
    """A job's max_model_len, sized here with this process's warm tokenizer (loading one
    takes the run seconds); the prompts' ids are stored beside the shards, as a run's own
    pass stores them."""
    from batchllm.execution.context.passes import size_shards

    storage = Storage(job["storage_root"], s3_endpoint=job["s3_endpoint"])
    spec = JobSpec.model_validate_json(job["spec"])
    return size_shards(spec, storage, job["paths"], settings)


def _warm_tokenizer(model: str) -> None:
    """Load the sizing pass's tokenizer now, not in the first run that needs it."""
    try:
        from batchllm.engine.sizing import light_tokenizer

        light_tokenizer(model)  # the one the sizing pass takes (execution/context/passes.py)
    except Exception as exc:  # the first job's sizing reports it, if it matters
        log.info("could not load %s's tokenizer ahead of the first job: %s", model, exc)


def serve(config: dict[str, Any]) -> int:
    settings = get_settings()
    home = settings.home
    record = registry.EngineRecord(
        id=config["id"],
        key=config["key"],
        model=config["model"],
        kind=config["kind"],
        pid=os.getpid(),
        uid=os.getuid(),
        socket=config["socket"],
        max_model_len=config["max_model_len"],
        keep_alive=config["keep_alive"],
        started_at=time.time(),
    )
    registry.write_record(home, record)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        engine = build(config, settings)
    except BaseException as exc:
        log.exception("the engine could not start")
        record.state, record.error = registry.FAILED, f"{type(exc).__name__}: {exc}"
        registry.write_record(home, record)  # the run waiting for it reads why, then removes it
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    reason = "stopped"
    runner: RunnerProcess | None = None
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(record.socket)
        old_umask = os.umask(0o077)  # the socket is its user's alone
        try:
            listener.bind(record.socket)
        finally:
            os.umask(old_umask)
        listener.listen(64)
        info = {
            "id": record.id,
            "model": record.model,
            "kind": record.kind,
            "pid": record.pid,
            "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.max_num_seqs,
            "version": engine.version,
            "hardware": engine.hardware,
        }
        if settings.warm_runs:
            runner = RunnerProcess(home, record.id)
        host = EngineHost(
            engine,
            info=info,
            keep_alive=config["keep_alive"],
            size=lambda job: size_job(job, settings),
            first_idle=runner.start if runner is not None else None,
        )
        signal.signal(signal.SIGTERM, lambda *_: host.stopping.set())
        if stop.is_set():  # asked to stop while the engine was being built
            host.stopping.set()
        threading.Thread(target=_warm_tokenizer, args=(record.model,), daemon=True).start()
        record.state, record.max_model_len = registry.READY, engine.max_model_len
        registry.write_record(home, record)
        log.info(
            "kept engine %s ready: %s, max_model_len %d",
            record.id,
            record.model,
            engine.max_model_len,
        )
        reason = host.serve(listener)
    finally:
        listener.close()
        if runner is not None:
            runner.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(record.socket)
        registry.remove_record(home, record.id)
        log.info("kept engine %s unloading: %s", record.id, reason)
        engine.shutdown()
    return 0


class RunnerProcess:
    """The engine's warm runner (batchllm/warm_runner.py): started once, ended with it."""

    def __init__(self, home: Path, engine_id: str) -> None:
        self.state, self.socket = registry.runner_files(home, engine_id)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        config = {"socket": self.socket, "state": str(self.state), "parent": os.getpid()}
        try:  # its log goes where the engine's goes (the engine's log file)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "batchllm.warm_runner", json.dumps(config)],
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        except OSError as exc:  # runs go on in their own processes, as without a runner
            log.warning("could not start a warm runner: %s", exc)
        if self.process is not None:
            log.info("warm runner starting (pid %d)", self.process.pid)

    def stop(self) -> None:
        """End the runner (its children, users' runs, go on) and remove its files."""
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for path in (self.state, Path(self.socket)):  # a runner killed mid-way leaves them
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _await_context(config: dict[str, Any]) -> bool:
    """A spare (kept_engine/client.Spare): load vLLM, then read the job's context from stdin.
    False when the run ended the pipe instead (the spare was not needed)."""
    started = time.monotonic()
    from batchllm.engine.vllm_engine import import_vllm
    from batchllm.execution.engines import build_vllm_engine  # noqa: F401  (the engine's own)

    import_vllm()  # vLLM's engine, config and executor modules, the collector paused

    log.info(
        "vLLM loaded ahead in %.1f s; waiting for the job's context", time.monotonic() - started
    )
    line = sys.stdin.readline()
    if not line.strip():
        log.info("not needed: exiting")
        return False
    config["max_model_len"] = json.loads(line)["max_model_len"]
    return True


def _await_adoption(early_log: Path) -> dict[str, Any] | None:
    """An early engine process (kept_engine/early.py): load vLLM while the run starts, then
    take the config the run's spare writes on stdin and the job's context after it. The end of
    stdin before the config ends the process at once (the run did not need it: no import to
    finish); after it, as a spare's (`not needed`). None when not needed."""
    started = time.monotonic()
    lines: queue.Queue[str | None] = queue.Queue()

    adopted = threading.Event()

    def read() -> None:
        for line in sys.stdin:
            adopted.set()
            lines.put(line)
        if not adopted.is_set():  # the run ended without adopting it: stop importing now
            early_log.unlink(missing_ok=True)
            os._exit(0)
        lines.put(None)

    threading.Thread(target=read, name="stdin", daemon=True).start()
    from batchllm.engine.vllm_engine import import_vllm
    from batchllm.execution.engines import build_vllm_engine  # noqa: F401  (the engine's own)

    import_vllm()
    line = lines.get()
    if line is None:
        early_log.unlink(missing_ok=True)
        return None
    config = json.loads(line)
    _move_output(early_log, Path(config.pop("log")))
    os.environ["BATCHLLM_HOME"] = config.pop("home")  # the run's home, as a spare's
    log.info(
        "vLLM loaded ahead in %.1f s (started with the command); waiting for the job's context",
        time.monotonic() - started,
    )
    line = lines.get()
    if not line or not line.strip():
        log.info("not needed: exiting")
        return None
    config["max_model_len"] = json.loads(line)["max_model_len"]
    return config


def _move_output(early_log: Path, engine_log: Path) -> None:
    """This process's output (the import's, so far in early_log) into the engine's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(engine_log, "ab") as out:
        with contextlib.suppress(OSError):
            out.write(early_log.read_bytes())
            out.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    early_log.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if argv[1] == CONFIG_ON_STDIN:
        adopted = _await_adoption(Path(argv[2]))
        if adopted is None:
            return 0
        config = adopted
    else:
        config = json.loads(argv[1])
    if config["max_model_len"] is None and not _await_context(config):
        return 0
    if config["keep_alive"] < 0:
        config["keep_alive"] = float("inf")
    return serve(config)


if __name__ == "__main__":  # vLLM starts its EngineCore with spawn: the guard is required
    sys.exit(main(sys.argv))
