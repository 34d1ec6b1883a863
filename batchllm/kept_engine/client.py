"""A run's side of a kept engine: `RemoteEngine` is the Engine the shard runner drives, over the
socket; `KeptEngines` is the EngineSource that finds the user's kept engine for a job's model
and engine settings, or starts one (kept afterwards), or, with keep-alive 0 and none up, builds
the run's own engine in this process as before.

The runner adds a request at a time; the remote engine sends them in one message with its next
step, so a run of thousands of rows costs a few messages a step, not one per row (the engine
thread takes requests between steps: a round trip per row would wait a step each). A request
the engine refuses comes back with the finished ones (finish reason REJECTED)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.engine.prompts import Prepared
from batchllm.engine.protocol import Adapter, EngineSource, Finished
from batchllm.errors import BatchLLMError, EngineDied, EngineUnavailable
from batchllm.execution.engines import EngineCache, context_free_key, with_min_lora_rank
from batchllm.execution.instant import InstantEngines
from batchllm.input.formats.rows import InputRow
from batchllm.kept_engine import early, registry, wire
from batchllm.kept_engine.registry import EngineRecord
from batchllm.settings import Settings
from batchllm.spec import JobSpec

log = logging.getLogger(__name__)

_STEP_WAIT = 0.25  # seconds a step waits on the engine for the first finished request
_START_DEADLINE = 3600.0  # a large model's first start on a cold disk takes many minutes
_POLL = 0.2


@dataclass(frozen=True, slots=True)
class RemoteParams:
    """Sampling parameters built in the kept engine, by their handle there."""

    handle: int
    dimensions: int | None = None  # an embedding request's, named in a refusal


class RemoteEngine:
    """A kept engine as the shard runner's Engine (engine/protocol.py)."""

    def __init__(self, record: EngineRecord, *, keep_alive: float | None) -> None:
        """`keep_alive`: the engine's new idle time (None leaves it as it is)."""
        self.record = record
        try:
            registry.check_owned(record.socket)
        except FileNotFoundError:  # it unloaded (or its socket was removed) as it was found
            raise EngineDied(
                f"the kept engine {record.id} cannot be reached: {record.socket} is gone"
            ) from None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lock = threading.Lock()
        self.broken = False
        try:
            self._sock.connect(record.socket)
        except OSError as exc:
            self._sock.close()
            raise EngineDied(f"the kept engine {record.id} cannot be reached: {exc}") from None
        info = self._call("hello", keep_alive)
        self.id: str = info["id"]
        self.pid: int = info["pid"]
        self.version: str = info["version"]
        self.hardware: str = info["hardware"]
        self.max_num_seqs: int = info["max_num_seqs"]
        self.max_model_len: int = info["max_model_len"]
        self._adds: list[tuple[str, Any, int, Adapter | None]] = []
        self._outstanding: set[str] = set()

    def _call(self, op: str, *args: Any) -> Any:
        if self.broken:
            raise EngineDied(f"the kept engine {self.record.id} is gone")
        with self._lock:
            try:
                try:
                    wire.send(self._sock, (op, *args))
                except OSError:
                    # The engine may have answered and closed before this was written (a
                    # refused connection: its reason is waiting to be read), or be gone.
                    pass
                status, value = wire.receive(self._sock)
            except (OSError, wire.ConnectionClosed) as exc:
                self.broken = True
                raise EngineDied(
                    f"the kept engine {self.record.id} (pid {self.record.pid}) is gone: {exc}"
                ) from None
        if status == "ok":
            return value
        if status == "died":
            self.broken = True
            raise EngineDied(value)
        raise BatchLLMError(value)

    def prepare(self, rows: list[InputRow], chat_template: str | None = None) -> list[Prepared]:
        return self._call("prepare", rows, chat_template)

    def sampling_params(self, merged: dict[str, Any]) -> RemoteParams:
        return RemoteParams(self._call("sampling", merged), merged.get("dimensions"))

    def add(
        self, request_id: str, token_ids: Any, params: Any, adapter: Adapter | None = None
    ) -> None:
        self._adds.append((request_id, token_ids, params.handle, adapter))
        self._outstanding.add(request_id)

    def step(self) -> list[Finished]:
        adds, self._adds = self._adds, []
        finished: list[Finished] = self._call("step", adds, _STEP_WAIT)
        for out in finished:
            self._outstanding.discard(out.request_id)
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._outstanding)

    def abort(self, request_ids: list[str]) -> None:
        dropped = set(request_ids)
        self._outstanding -= dropped
        unsent = {a[0] for a in self._adds} & dropped
        self._adds = [a for a in self._adds if a[0] not in dropped]
        sent = [r for r in request_ids if r not in unsent]
        if sent and not self.broken:
            self._call("abort", sent)

    def size(self, job: dict[str, Any]) -> int:
        return self._call("size", job)

    def status(self) -> dict[str, Any]:
        return self._call("status")

    def stop(self, *, force: bool) -> dict[str, Any]:
        return self._call("stop", force)

    def shutdown(self) -> None:
        """Leave the engine: it stays loaded for the next run until its keep-alive runs out."""
        self.broken = True
        self._sock.close()


def engine_log(home: Path, engine_id: str) -> Path:
    return registry.engines_dir(home) / f"{engine_id}.log"


def _new_record(
    settings: Settings,
    *,
    kind: str,
    spec: JobSpec,
    key: str,
    max_model_len: int | None,
    keep_alive: float,
) -> EngineRecord:
    engine_id = registry.new_engine_id()
    return EngineRecord(
        id=engine_id,
        key=key,
        model=spec.model,
        kind=kind,
        pid=0,
        uid=os.getuid(),
        socket=registry.socket_path(settings.home, engine_id),
        max_model_len=max_model_len,
        keep_alive=keep_alive,
        started_at=time.time(),
    )


def _config(record: EngineRecord, spec: JobSpec, step_seconds: float) -> dict[str, Any]:
    """What the kept engine's process is started with (kept_engine/server.py)."""
    keep_alive = record.keep_alive
    return {
        "id": record.id,
        "key": record.key,
        "model": spec.model,
        "kind": record.kind,
        "options": spec.engine.model_dump(mode="json"),
        "max_model_len": record.max_model_len,
        "keep_alive": -1 if keep_alive == float("inf") else keep_alive,
        "step_seconds": step_seconds,
        "socket": record.socket,
    }


def _adopt(
    settings: Settings, record: EngineRecord, spec: JobSpec
) -> subprocess.Popen[bytes] | None:
    """The early engine process the console script started (kept_engine/early.py), told it is
    this spare: None when there is none, or it ended."""
    process = early.take()
    if process is None or process.stdin is None:
        return None
    config = {
        **_config(record, spec, 0.0),
        "home": str(settings.home),
        "log": str(engine_log(settings.home, record.id)),
    }
    try:
        process.stdin.write(json.dumps(config).encode() + b"\n")
        process.stdin.flush()
    except OSError:  # it died: the spare is started the usual way
        return None
    threading.Thread(target=process.wait, name="kept-engine-reaper", daemon=True).start()
    record.pid = process.pid
    return process


def _spawn(
    settings: Settings, record: EngineRecord, spec: JobSpec, step_seconds: float
) -> subprocess.Popen[bytes]:
    """The kept engine's process for `record` (pid set). A spare (max_model_len None) reads
    its context from its stdin; the end of the pipe (this process gone, or the spare not
    needed) ends it."""
    config = _config(record, spec, step_seconds)
    env = {**os.environ, "BATCHLLM_HOME": str(settings.home)}
    with open(engine_log(settings.home, record.id), "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "batchllm.kept_engine.server", json.dumps(config)],
            stdin=subprocess.PIPE if record.max_model_len is None else subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            # Its own session: a terminal's Ctrl-C stops the run, not the engine others share.
            start_new_session=True,
            close_fds=True,
        )
    # Reaped when it exits, so a long-lived caller (a notebook's Client) keeps no zombie.
    threading.Thread(target=process.wait, name="kept-engine-reaper", daemon=True).start()
    record.pid = process.pid
    return process


def launch(
    settings: Settings,
    *,
    kind: str,
    spec: JobSpec,
    key: str,
    max_model_len: int,
    keep_alive: float,
    step_seconds: float = 0.0,
) -> EngineRecord:
    """Start a kept engine's process (call under registry.start_lock); it writes its own
    state once it is ready."""
    record = _new_record(
        settings, kind=kind, spec=spec, key=key, max_model_len=max_model_len, keep_alive=keep_alive
    )
    process = _spawn(settings, record, spec, step_seconds)
    registry.write_record(settings.home, record)
    log.info("starting kept engine %s (pid %d) for %s", record.id, process.pid, spec.model)
    return record


class Spare:
    """A kept vLLM engine's process started as a run begins, before its job's context is
    known: it imports vLLM (and torch) while the run validates and sizes the file (~7 s of a
    cold 8-line `run`'s ~20 here, issue 63), then builds once `start` gives it the context.
    Unlisted until then, so no other run waits on an engine whose context is not chosen."""

    def __init__(self, settings: Settings, *, spec: JobSpec, key: str, keep_alive: float):
        self.settings, self.key = settings, key
        self.record = _new_record(
            settings, kind="vllm", spec=spec, key=key, max_model_len=None, keep_alive=keep_alive
        )
        self._process = _adopt(settings, self.record, spec) or _spawn(
            settings, self.record, spec, 0.0
        )
        log.info("loading vLLM ahead in kept engine %s (pid %d)", self.record.id, self.record.pid)

    def start(self, max_model_len: int) -> EngineRecord:
        """Build with this context (under registry.start_lock): listed from now on."""
        self.record.max_model_len = max_model_len
        registry.write_record(self.settings.home, self.record)
        self._tell({"max_model_len": max_model_len})
        return self.record

    def discard(self) -> None:
        """Not needed (another engine fits, or the job was not created): it exits."""
        self._tell(None)

    def _tell(self, message: dict[str, int] | None) -> None:
        stdin, self._process.stdin = self._process.stdin, None
        if stdin is None:
            return
        try:
            if message is not None:
                stdin.write(json.dumps(message).encode() + b"\n")
            stdin.close()
        except OSError:  # it died while loading: wait_ready reports it with its log
            pass


def wait_ready(home: Path, record: EngineRecord) -> EngineRecord:
    """The record once its engine is ready; EngineUnavailable, with why, if it failed."""
    deadline = time.monotonic() + _START_DEADLINE
    path = registry.state_path(home, record.id)
    while time.monotonic() < deadline:
        current = registry.read_record(path)
        if current is not None and current.state == registry.READY:
            return current
        if current is not None and current.state == registry.FAILED:
            registry.remove_record(home, record.id)
            raise EngineUnavailable(
                f"the engine could not start: {current.error} "
                f"(its log: {engine_log(home, record.id)})"
            )
        if not registry.alive(record.pid):
            registry.remove_record(home, record.id)
            raise EngineUnavailable(
                f"the kept engine's process (pid {record.pid}) exited while starting; "
                f"its log: {engine_log(home, record.id)}{_log_tail(home, record.id)}"
            )
        time.sleep(_POLL)
    raise EngineUnavailable(f"the kept engine {record.id} did not start in {_START_DEADLINE:g} s")


def _log_tail(home: Path, engine_id: str, lines: int = 5) -> str:
    try:
        tail = engine_log(home, engine_id).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n  {line}" for line in tail)


class KeptEngines:
    """The EngineSource of local runs: the user's kept engine for a job's model and settings
    (found, or started and kept for `keep_alive` seconds after its last run; math.inf:
    until stopped). With keep_alive 0 a kept engine already up is used as it is, and
    otherwise the run builds its own engine in this process (`EngineCache`, or the instant
    engines), as before kept engines existed.

    Engines are told apart by model, settings and kind (vLLM or instant); one whose context
    is shorter than a job needs is not rebuilt: the job gets an engine of its own beside it."""

    def __init__(
        self,
        settings: Settings,
        *,
        keep_alive: float | None = None,
        kind: str = "vllm",
        step_seconds: float = 0.0,
        on_status: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.keep_alive = settings.keep_alive_seconds if keep_alive is None else keep_alive
        self.kind, self.step_seconds = kind, step_seconds
        self.on_status = on_status or (lambda text: None)
        self._remote: RemoteEngine | None = None
        self._remote_key: str | None = None
        self._gone: set[str] = set()  # engines that died under this source
        self._announced: set[str] = set()  # engines the run was told it uses or starts
        self._local: EngineSource = (
            InstantEngines(step_seconds=step_seconds)
            if kind == "instant"
            else EngineCache(settings)
        )
        self._local_used = False
        self._spare: Spare | None = None

    def prestart(self, spec: JobSpec) -> None:
        """Start loading vLLM for the spec's model before the job's context is known, when no
        kept engine for it is up or starting: `get` builds that process with the job's
        context (or lets it go, if another engine fits by then)."""
        if self.kind != "vllm" or self.keep_alive == 0 or self._spare is not None:
            return
        spec = self._normalized(spec)
        key = self.key(spec)
        with registry.start_lock(self.settings.home):
            if not self._candidates(key, None):
                self._spare = Spare(self.settings, spec=spec, key=key, keep_alive=self.keep_alive)

    def _take_spare(self, key: str) -> Spare | None:
        spare, self._spare = self._spare, None
        if spare is not None and spare.key != key:
            spare.discard()
            return None
        return spare

    @property
    def engine(self) -> Any:
        return self._remote if self._remote is not None else self._local.engine

    def key(self, spec: JobSpec) -> str:
        # Not max_loras: how many adapters one batch may mix, which a run sets to its adapter
        # count; an engine with fewer runs such a job's adapters in turn, not wrongly.
        spec = spec.model_copy(
            update={"engine": spec.engine.model_copy(update={"max_loras": None})}
        )
        key = f"{self.kind}|{context_free_key(spec)}"
        return f"{key}|step={self.step_seconds:g}" if self.kind == "instant" else key

    def _candidates(self, key: str, max_model_len: int | None) -> list[EngineRecord]:
        found = [
            r
            for r in registry.list_records(self.settings.home)
            if r.key == key
            and r.uid == os.getuid()
            and r.state != registry.FAILED
            and r.id not in self._gone
            and (max_model_len is None or r.fits(max_model_len))
        ]
        # Ready before starting; then the shortest context that fits (its KV cache is no larger
        # than the job needs, the others stay free for longer jobs).
        return sorted(found, key=lambda r: (r.state != registry.READY, r.max_model_len or 0))

    def _normalized(self, spec: JobSpec) -> JobSpec:
        """The spec as engines are told apart: the LoRA rank floor applied, and a model
        directory by its absolute path (`./model` from two folders is two models)."""
        spec = with_min_lora_rank(spec, self.settings.min_lora_rank)
        local = Path(spec.model).expanduser()
        if local.exists():
            spec = spec.model_copy(update={"model": str(local.resolve())})
        return spec

    def warm(self, spec: JobSpec) -> RemoteEngine | None:
        """A ready kept engine for the spec's model and settings (any context), connected: it
        sizes the job with its warm tokenizer. None when there is none."""
        spec = self._normalized(spec)
        for record in self._candidates(self.key(spec), None):
            if record.state != registry.READY:
                continue
            try:
                return self._connect(record, self.key(spec))
            except EngineDied as exc:
                log.info("%s", exc)
                self._gone.add(record.id)
        return None

    def get(self, spec: JobSpec, max_model_len: int) -> Any:
        spec = self._normalized(spec)
        key = self.key(spec)
        remote = self._remote
        if (
            remote is not None
            and not remote.broken
            and self._remote_key == key
            and remote.max_model_len >= max_model_len
        ):
            if remote.record.id not in self._announced:  # connected by warm(): say so now
                self._using(remote.record)
            return remote
        self._disconnect()
        for _ in range(3):  # a found engine may unload, or die, as it is reached
            record = self._find_or_start(spec, key, max_model_len)
            if record is None:
                self._local_used = True
                return self._local.get(spec, max_model_len)
            try:
                ready = wait_ready(self.settings.home, record)
                if not ready.fits(max_model_len):
                    continue  # an auto-sized engine came up shorter than this job needs
                return self._connect(ready, key)
            except EngineDied as exc:
                log.info("%s; looking again", exc)
                self._gone.add(record.id)
        raise EngineUnavailable(f"no kept engine for {spec.model} could be reached")

    def _find_or_start(self, spec: JobSpec, key: str, max_model_len: int) -> EngineRecord | None:
        with registry.start_lock(self.settings.home):
            found = self._candidates(key, max_model_len)
            spare = self._take_spare(key)
            if found and spare is not None:
                spare.discard()
            if found:
                record = found[0]
                if record.state == registry.READY:
                    self._using(record)
                else:
                    self._announced.add(record.id)
                    self.on_status(f"waiting for kept engine {record.id}, starting ...")
                return record
            if self.keep_alive == 0:
                return None
            if spare is not None:
                record = spare.start(max_model_len)
            else:
                record = launch(
                    self.settings,
                    kind=self.kind,
                    spec=spec,
                    key=key,
                    max_model_len=max_model_len,
                    keep_alive=self.keep_alive,
                    step_seconds=self.step_seconds,
                )
        self._announced.add(record.id)
        self.on_status(
            f"starting kept engine {record.id} for {spec.model} (kept "
            f"{_duration(self.keep_alive)} after the run; `batchllm engine stop` unloads it)"
        )
        return record

    def _using(self, record: EngineRecord) -> None:
        self._announced.add(record.id)
        up = time.time() - record.started_at
        self.on_status(
            f"using the kept engine {record.id} (pid {record.pid}, up {_minutes(up)}): "
            "no start needed"
        )

    def _connect(self, record: EngineRecord, key: str) -> RemoteEngine:
        self._disconnect()
        # Keep-alive 0 uses a kept engine as it is: it never shortens another run's choice.
        remote = RemoteEngine(record, keep_alive=self.keep_alive or None)
        self._remote, self._remote_key = remote, key
        return remote

    def _disconnect(self) -> None:
        remote, self._remote = self._remote, None
        if remote is not None:
            if remote.broken:
                self._gone.add(remote.record.id)
            remote.shutdown()

    def close(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:  # started, never needed
            spare.discard()
        self._disconnect()
        if self._local_used:
            self._local.close()


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _duration(seconds: float) -> str:
    return "until stopped" if seconds == float("inf") else _minutes(seconds)


def size_on(remote: RemoteEngine, spec: JobSpec, settings: Settings, paths: list[str]) -> int:
    """A new job's max_model_len, sized by a kept engine with its warm tokenizer (the job's
    storage is the one these settings name, as for every new job)."""
    return remote.size(
        {
            "spec": spec.model_dump_json(),
            "storage_root": settings.resolved_storage,
            "s3_endpoint": settings.resolved_s3_endpoint,
            "paths": paths,
        }
    )
