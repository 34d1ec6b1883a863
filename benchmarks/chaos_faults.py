"""The chaos run's workers and faults: `batchllm worker --engine instant` processes the harness
starts, replaces and ends by PID (never by name), and the fault kinds it injects into them and
into its private Redis and PostgreSQL (batchllm/process/services.py, benchmarks/private_postgres.py).

Fault kinds (one at a time; each is over, its service back or its victim replaced, before the
next begins):
- kill9: SIGKILL of a worker's main process, as an OOM killer would; a replacement starts.
- sigterm: a warm shutdown (the worker drains: generating rows may finish, the rest go back);
  a replacement starts at once, as in a rolling restart.
- sigstop: SIGSTOP for longer than a lease (its shard is taken over meanwhile), then SIGCONT:
  the paused worker comes back to a shard that is no longer its own.
- redis-restart: the broker restarted without persistence: every queued and unacknowledged
  task is lost.
- pg-outage: the database stopped (`pg_ctl stop -m fast`: every session ends) for a few
  seconds, then started.
- net-delay: every chunk between the workers and a service (Redis, PostgreSQL, or all of them,
  the S3 server too; drawn) waits 200-500 ms each way, for a while (benchmarks/chaos_proxy.py).
- net-partition: the workers cut off from a service (drawn as for net-delay) for a while: new
  connections are reset, open ones stall; then it heals and the stalled bytes flow on.
- s3-errors: the S3 endpoint fails for a while (S3 output only): open connections are reset,
  new requests reset or answered `503 Slow Down`, commits included.
- disk-full: the run's output disk (`--storage dir`: a tmpfs of its own, benchmarks/chaos_disk.py)
  filled to the last byte for a while, then freed: every part file write fails with ENOSPC.
- clock-step: a busy instant worker's wall clock jumps 3 leases ahead or behind (drawn) and
  stays there (a clock set wrong, an NTP step): every instant worker runs with
  benchmarks/chaos_clock/sitecustomize.py, which steps Python's time.time and batchllm's
  utcnow by the offset in the worker's clock file. Leases read the database's clock
  (batchllm/store/clock.py), so the stepped worker must neither take over live shards nor
  lose its own.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from batchllm.process.ports import free_port
from batchllm.process.services import RedisServer, ServiceFailed, tail
from benchmarks.chaos_disk import SmallDisk, can_mount
from benchmarks.chaos_proxy import TcpProxy
from benchmarks.private_postgres import PostgresCluster

FAULT_KINDS = (
    "kill9",
    "sigterm",
    "sigstop",
    "redis-restart",
    "pg-outage",
    "net-delay",
    "net-partition",
    "s3-errors",
    "clock-step",
    "engine-kill",
    "disk-full",
)
WORKER_FAULTS = ("kill9", "sigterm", "sigstop", "clock-step", "engine-kill")
NET_FAULTS = ("net-delay", "net-partition")
S3_ONLY = ("s3-errors",)  # kinds that need the S3 output (--storage s3)
DIR_ONLY = ("disk-full",)  # kinds that need the output on the run's small disk (--storage dir)
CLOCK_SITE = Path(__file__).resolve().parent / "chaos_clock"  # its sitecustomize steps clocks


def available_kinds(storage: str, vllm_workers: int = 0) -> list[str]:
    """The fault kinds a run with this storage (and this many vLLM workers) can inject on this
    machine."""
    return [
        kind
        for kind in FAULT_KINDS
        if (storage == "s3" or kind not in S3_ONLY)
        and (kind not in DIR_ONLY or (storage == "dir" and can_mount()))
        and (kind != "engine-kill" or vllm_workers > 0)
    ]


READY_TIMEOUT = 180
VLLM_READY_TIMEOUT = 900


class NoVictim(ServiceFailed):
    """No worker can take this fault now (engine-kill while the vLLM worker rebuilds its
    engine): the fault loop tries the kind again later."""


class ChaosWorker:
    """One `batchllm worker` in its own session, its output in a log file; the processes
    under it are recorded (pid, start time) so none can outlive the run unseen."""

    def __init__(
        self, name: str, *, model: str, env: dict[str, str], log_path: Path, engine_args: list[str]
    ) -> None:
        self.name, self.log_path, self.engine_args = name, log_path, engine_args
        self.real_engine = "instant" not in engine_args  # a vLLM worker (engine-kill's victim)
        self.started = time.monotonic()
        self.ended: float | None = None
        self.how_ended = ""
        self.paused = False
        self.terminated = False  # SIGTERM sent once: a second one would cut its drain short
        self.recorded: dict[int, float] = {}
        self.metrics_port = free_port()
        # Its wall clock's offset in seconds (clock-step), read by benchmarks/chaos_clock's
        # sitecustomize at most once a second. Not under a vLLM worker (its engine's processes).
        self.clock_file = log_path.with_suffix(".clock")
        self.clock_ahead = 0.0
        self.clock_file.write_text("0\n")
        if self.real_engine:
            # engine-kill kills the engine core's own process: vLLM's multiprocess engine (a
            # one-device CPU engine's core runs in its worker by default, engine/start_settings.py).
            env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        else:
            path = os.pathsep.join(filter(None, [str(CLOCK_SITE), env.get("PYTHONPATH")]))
            env = {**env, "PYTHONPATH": path, "BATCHLLM_CHAOS_CLOCK_FILE": str(self.clock_file)}
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "batchllm", "worker", "--model", model, "--name", name]
                + ["--loglevel", "INFO", "--metrics-port", str(self.metrics_port), *engine_args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._remember(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _remember(self, pid: int) -> None:
        try:
            self.recorded[pid] = psutil.Process(pid).create_time()
        except psutil.Error:
            pass

    def record_descendants(self) -> None:
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            self._remember(child.pid)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> float:
        """Until Celery says ready; returns the seconds since the start."""
        deadline = time.monotonic() + timeout
        while f"{self.name} ready." not in self.log_path.read_text(errors="replace"):
            if not self.alive():
                raise ServiceFailed(
                    f"worker {self.name} exited with {self.proc.returncode}:\n"
                    + tail(self.log_path, 30)
                )
            if time.monotonic() > deadline:
                raise ServiceFailed(f"worker {self.name} not ready after {timeout:.0f} s")
            time.sleep(0.2)
        self.record_descendants()
        return time.monotonic() - self.started

    def engine_core(self) -> psutil.Process | None:
        """Its vLLM EngineCore process (titled `VLLM::EngineCore`), once its engine is up."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return None
        for child in children:
            try:
                if "EngineCore" in " ".join(child.cmdline()) or "EngineCor" in child.name():
                    return child
            except psutil.Error:
                continue
        return None

    def step_clock(self, seconds: float) -> None:
        """Its wall clock jumps by `seconds` (back when negative), seen within a second."""
        self.clock_ahead += seconds
        self.clock_file.write_text(f"{self.clock_ahead:.0f}\n")

    def send(self, sig: signal.Signals) -> None:
        self.record_descendants()
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        """A warm shutdown, asked once; SIGCONT first, in case it is paused."""
        if self.alive() and not self.terminated:
            self.send(signal.SIGCONT)
            self.send(signal.SIGTERM)
            self.terminated = True

    def stop(self, grace: float = 30) -> None:
        """Warm shutdown, then SIGKILL of its process group if it does not go."""
        if self.alive():
            self.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                self.proc.wait(timeout=30)
                self.how_ended = self.how_ended or "killed at the end"
        self.note_end()

    def note_end(self) -> None:
        if self.ended is None and not self.alive():
            self.ended = time.monotonic()

    def leftovers(self) -> dict[int, str]:
        """The recorded processes (the worker and its children) still alive."""
        alive = {}
        for pid, created in self.recorded.items():
            try:
                proc = psutil.Process(pid)
                if (
                    abs(proc.create_time() - created) < 0.01
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    alive[pid] = " ".join(proc.cmdline())[:100]
            except psutil.Error:
                continue
        return alive

    def last_complaint(self) -> str | None:
        """The worker's last CRITICAL or ERROR log line."""
        found = [
            line
            for line in self.log_path.read_text(errors="replace").splitlines()
            if " CRITICAL " in line or " ERROR " in line
        ]
        return found[-1][:300] if found else None

    def errors_logged(self) -> int:
        text = self.log_path.read_text(errors="replace")
        return text.count("Traceback") + text.count(" ERROR ")


class Workers:
    """The run's workers: started, replaced and ended here; named `wN@TAG`."""

    def __init__(
        self, *, model: str, env: dict[str, str], log_dir: Path, engine_args: list[str], tag: str
    ) -> None:
        self.model, self.env, self.log_dir = model, env, log_dir
        self.engine_args, self.tag = engine_args, tag
        self.all: list[ChaosWorker] = []
        self.serial = 0
        # Workers that exited without a fault or a stop: name, exit code, their last complaint.
        self.unplanned: list[dict[str, Any]] = []

    def start(self, count: int, engine_args: list[str] | None = None) -> list[ChaosWorker]:
        started = []
        for _ in range(count):
            self.serial += 1
            name = f"w{self.serial}@{self.tag}"
            worker = ChaosWorker(
                name,
                model=self.model,
                env=self.env,
                log_path=self.log_dir / f"{name}.log",
                engine_args=engine_args or self.engine_args,
            )
            self.all.append(worker)
            started.append(worker)
        for worker in started:
            # A vLLM worker builds its engine before it is ready: 20-90 s here, longer on a
            # machine the other workers keep busy.
            worker.wait_ready(VLLM_READY_TIMEOUT if worker.real_engine else READY_TIMEOUT)
        return started

    def active(self) -> list[ChaosWorker]:
        """Workers alive, not paused, not draining: the ones taking work."""
        return [w for w in self.all if w.alive() and not w.paused and not w.how_ended]

    def replace_unplanned(self) -> list[str]:
        """Workers that exited on their own since the last look: noted, and replaced (what a
        supervisor does). Returns their names."""
        gone = [w for w in self.all if not w.alive() and not w.how_ended]
        for worker in gone:
            worker.how_ended = f"exited on its own with {worker.proc.returncode}"
            worker.note_end()
            self.unplanned.append(
                {
                    "name": worker.name,
                    "exit": worker.proc.returncode,
                    "last_complaint": worker.last_complaint(),
                    "log": str(worker.log_path),
                }
            )
        for worker in gone:
            self.start(1, worker.engine_args)
        return [w.name for w in gone]

    def stop_all(self) -> None:
        for worker in self.all:
            worker.terminate()
        for worker in self.all:
            worker.stop()

    def leftovers(self) -> dict[int, str]:
        """Processes of the run still alive: any recorded one, and any whose command line
        carries the run's tag (a worker's name)."""
        found: dict[int, str] = {}
        for worker in self.all:
            found.update(worker.leftovers())
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info.get("cmdline") or [])
            if f"@{self.tag}" in cmdline and proc.pid != os.getpid():
                found[proc.pid] = cmdline[:100]
        return found

    def records(self, t0: float) -> list[dict[str, Any]]:
        def since(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 2)

        return [
            {
                "name": w.name,
                "pid": w.pid,
                "started": since(w.started),
                "ended": since(w.ended),
                "exit": w.proc.returncode,
                "how_ended": w.how_ended,
                "errors_logged": w.errors_logged(),
                "log": str(w.log_path),
            }
            for w in self.all
        ]


class Schedule:
    """The fault kinds in a seeded random order, each kind once per round (a shuffled bag): a
    run of len(kinds) faults injects every kind."""

    def __init__(self, kinds: list[str], rng: random.Random) -> None:
        self.kinds, self.rng = list(kinds), rng
        self.bag: list[str] = []

    def next(self) -> str:
        if not self.bag:
            self.bag = self.rng.sample(self.kinds, len(self.kinds))
        return self.bag.pop(0)


class Injector:
    """Injects one fault of a kind and returns its record (times are time.monotonic()).
    `held(worker)`: the shards that worker runs now ([{id, done}]), None while the database
    cannot say."""

    def __init__(
        self,
        *,
        workers: Workers,
        redis: RedisServer,
        postgres: PostgresCluster,
        rng: random.Random,
        held: Callable[[str], list[dict[str, Any]] | None],
        stop_seconds: float,
        outage_seconds: float,
        proxies: dict[str, TcpProxy] | None = None,
        net_seconds: float = 6.0,
        net_delay: tuple[float, float] = (0.2, 0.5),
        s3_seconds: float = 6.0,
        lease_seconds: float = 10.0,
        disk: SmallDisk | None = None,
        disk_seconds: float = 6.0,
    ) -> None:
        self.workers, self.redis, self.postgres = workers, redis, postgres
        self.rng, self.held = rng, held
        self.stop_seconds, self.outage_seconds = stop_seconds, outage_seconds
        # The proxies between the workers and each service, by service ("redis", "postgres",
        # "s3"): the network faults act on them.
        self.proxies = proxies or {}
        self.net_seconds, self.net_delay, self.s3_seconds = net_seconds, net_delay, s3_seconds
        self.lease_seconds = lease_seconds
        self.disk, self.disk_seconds = disk, disk_seconds

    def _victim(self, kind: str) -> tuple[ChaosWorker, list[dict[str, Any]]]:
        """A worker that runs a shard now, if any does (so the fault bites), else any; for
        engine-kill a vLLM worker whose engine is up, for clock-step an instant one."""
        active = self.workers.active()
        if kind == "engine-kill":
            active = [w for w in active if w.real_engine and w.engine_core() is not None]
        elif kind == "clock-step":
            active = [w for w in active if not w.real_engine]
        if not active:
            raise NoVictim(f"no active worker to inject {kind} into")
        holding = [(w, self.held(w.name) or []) for w in active]
        busy = [(w, shards) for w, shards in holding if shards]
        return self.rng.choice(busy or holding)

    def inject(self, kind: str) -> dict[str, Any]:
        record: dict[str, Any] = {"kind": kind, "began": time.monotonic(), "victim": None}
        if kind in WORKER_FAULTS:
            victim, shards = self._victim(kind)
            record.update(victim=victim.name, held_shards=shards)
            record["began"] = time.monotonic()
            getattr(self, "_" + kind.replace("-", "_"))(victim, record)
        elif kind == "redis-restart":
            self.redis.restart()
        elif kind == "pg-outage":
            self.postgres.stop()
            time.sleep(self.outage_seconds)
            self.postgres.start()
        elif kind in NET_FAULTS:
            self._net(kind, record)
        elif kind == "s3-errors":
            self._s3_errors(record)
        elif kind == "disk-full":
            self._disk_full(record)
        else:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        record["restored"] = time.monotonic()
        return record

    def _kill9(self, victim: ChaosWorker, record: dict[str, Any]) -> None:
        victim.how_ended = "kill -9"
        victim.send(signal.SIGKILL)
        victim.proc.wait(timeout=30)
        victim.note_end()
        (new,) = self.workers.start(1, victim.engine_args)
        record["note"] = f"replaced by {new.name}"

    def _sigterm(self, victim: ChaosWorker, record: dict[str, Any]) -> None:
        victim.how_ended = "SIGTERM (drain)"
        victim.terminate()
        (new,) = self.workers.start(1, victim.engine_args)
        record["note"] = f"draining; replaced by {new.name}"

    def _sigstop(self, victim: ChaosWorker, record: dict[str, Any]) -> None:
        victim.paused = True
        victim.send(signal.SIGSTOP)
        time.sleep(self.stop_seconds)
        victim.send(signal.SIGCONT)
        victim.paused = False
        record["note"] = f"paused {self.stop_seconds:.0f} s"

    def _engine_kill(self, victim: ChaosWorker, record: dict[str, Any]) -> None:
        """kill -9 of the vLLM worker's EngineCore; the worker rebuilds its engine or exits
        with an error (then it is replaced, as its supervisor would). An exit within 20 s is
        this fault's; a later one is the harness's unplanned-exit watch's."""
        core = victim.engine_core()
        if core is None:
            raise ServiceFailed(f"{victim.name}'s EngineCore is gone before the kill")
        victim.record_descendants()
        core.kill()
        deadline = time.monotonic() + 20
        while victim.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        if victim.alive():
            record["note"] = f"EngineCore {core.pid} killed; the worker lives on"
            return
        victim.how_ended = f"exited with {victim.proc.returncode} after its engine was killed"
        victim.note_end()
        (new,) = self.workers.start(1, victim.engine_args)
        record["note"] = f"EngineCore {core.pid} killed; the worker exited; replaced by {new.name}"

    def _clock_step(self, victim: ChaosWorker, record: dict[str, Any]) -> None:
        step = self.rng.choice([1, -1]) * 3 * self.lease_seconds
        victim.step_clock(step)
        time.sleep(2)  # the worker reads its clock file at most once a second
        record["note"] = f"wall clock {step:+.0f} s (now {victim.clock_ahead:+.0f} s off)"

    def _targets(self) -> tuple[str, list[TcpProxy]]:
        """One service's proxy, or all of them, drawn."""
        if not self.proxies:
            raise ValueError("network faults need the workers behind the harness's proxies")
        target = self.rng.choice([*sorted(self.proxies), "all"])
        chosen = list(self.proxies.values()) if target == "all" else [self.proxies[target]]
        return target, chosen

    def _net(self, kind: str, record: dict[str, Any]) -> None:
        target, proxies = self._targets()
        record["target"] = target
        record["began"] = time.monotonic()
        try:
            for proxy in proxies:
                if kind == "net-delay":
                    low, high = self.net_delay
                    proxy.delay(low, high, seed=self.rng.randrange(1 << 30))
                else:
                    proxy.partition()
            time.sleep(self.net_seconds)
        finally:
            for proxy in proxies:
                proxy.heal()
        if kind == "net-delay":
            low, high = self.net_delay
            what = f"{low * 1000:.0f}-{high * 1000:.0f} ms a chunk"
        else:
            what = "cut off"
        record["note"] = f"{target}: {what} for {self.net_seconds:.0f} s"

    def _disk_full(self, record: dict[str, Any]) -> None:
        if self.disk is None:
            raise ValueError("disk-full needs the output on the run's small disk (--storage dir)")
        record["began"] = time.monotonic()
        try:
            taken = self.disk.fill()
            record["free_bytes"] = self.disk.free_bytes()
            time.sleep(self.disk_seconds)
        finally:
            self.disk.free()
        record.update(target="disk", ballast_bytes=taken)
        record["note"] = f"{taken / 1e6:.0f} MB of ballast: full for {self.disk_seconds:.0f} s"

    def _s3_errors(self, record: dict[str, Any]) -> None:
        proxy = self.proxies.get("s3")
        if proxy is None:
            raise ValueError("s3-errors needs the S3 output (--storage s3)")
        before = (proxy.stats.reset, proxy.stats.answered_503)
        record["began"] = time.monotonic()
        try:
            proxy.fail_http(seed=self.rng.randrange(1 << 30))
            time.sleep(self.s3_seconds)
        finally:
            proxy.heal()
        resets, answered = (proxy.stats.reset - before[0], proxy.stats.answered_503 - before[1])
        record.update(target="s3", resets=resets, answered_503=answered)
        record["note"] = f"{self.s3_seconds:.0f} s: {resets} resets, {answered} answered 503"
