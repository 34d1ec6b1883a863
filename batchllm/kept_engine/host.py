"""The kept engine's serving loop: one thread owns the engine and steps it for every connected
run, so two runs' rows share one continuous batch; each connection has a thread that hands its
requests to the engine thread and returns its own finished requests, never another run's.

Everything that touches the engine runs on the engine thread (vLLM's engine and its tokenizer
are not safe to share between threads); a connection's requests are named `<conn>:<id>` in the
engine, so two runs' request ids never collide."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from batchllm.engine.prompts import token_count
from batchllm.engine.protocol import REJECTED, Engine, Finished
from batchllm.errors import EngineDied
from batchllm.kept_engine import wire

log = logging.getLogger(__name__)

_IDLE_WAIT = 0.2  # seconds the engine thread waits for work while nothing runs
_ACCEPT_WAIT = 0.5  # how often the idle time and a stop are checked
# Idle this long first: a run that started the engine connects within a second of it being
# ready, and exits within one of leaving it (its output written then, not beside a new process).
_FIRST_IDLE = 2.0


@dataclass(eq=False)
class _Run:
    """One connected run: its finished requests not yet fetched, its sampling parameters."""

    number: int
    outbox: list[Finished] = field(default_factory=list)
    ready: threading.Condition = field(default_factory=threading.Condition)
    params: dict[int, Any] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)

    def deliver(self, finished: list[Finished]) -> None:
        with self.ready:
            self.outbox.extend(finished)
            self.ready.notify_all()

    def take(self, wait: float, dead: Callable[[], bool]) -> list[Finished]:
        with self.ready:
            if not self.outbox and not dead():
                self.ready.wait(wait)
            taken, self.outbox = self.outbox, []
        return taken


class EngineHost:
    """Serves one built engine on a listening socket until it is stopped, idle for its
    keep-alive, or the engine dies."""

    def __init__(
        self,
        engine: Engine,
        *,
        info: dict[str, Any],
        keep_alive: float,
        size: Callable[[dict[str, Any]], int],
        first_idle: Callable[[], None] | None = None,
    ) -> None:
        """`first_idle`: called once, from the accepting thread, when the engine is first
        idle: _FIRST_IDLE after its first run ended, or after it was ready if no run came
        (`batchllm engine start`). The warm runner starts then, not beside a cold run."""
        self.engine = engine
        self._first_idle = first_idle
        self.info = info
        self.keep_alive = keep_alive
        self._size = size
        self._commands: queue.Queue[tuple[Callable[[], Any], Future | None]] = queue.Queue()
        self._runs: dict[int, _Run] = {}
        self._owner: dict[str, _Run] = {}
        self._numbers = iter(range(1, 1 << 62))
        self._lock = threading.Lock()
        self.died: str | None = None
        self.stopping = threading.Event()
        self.last_active = time.monotonic()
        self.runs_served = 0
        # A GPU engine sleeps through its first idle keep-alive (vLLM's sleep level 1) and
        # unloads after a second one; an engine that cannot sleep unloads after the first.
        self.can_sleep = bool(getattr(engine, "can_sleep", False))
        self.asleep = False

    # -- the engine thread ----------------------------------------------------------------

    def _engine_loop(self) -> None:
        while not self.stopping.is_set():
            busy = self.engine.has_unfinished()
            try:
                first = self._commands.get(timeout=0 if busy else _IDLE_WAIT)
            except queue.Empty:
                first = None
            while first is not None:
                self._run_command(*first)
                try:
                    first = self._commands.get_nowait()
                except queue.Empty:
                    first = None
            if self.died is not None:
                return
            if not self.engine.has_unfinished():
                continue
            try:
                finished = self.engine.step()
            except Exception as exc:  # EngineDied, or vLLM raising from its step
                self._die(f"{type(exc).__name__}: {exc}")
                return
            self._route(finished)

    def _run_command(self, command: Callable[[], Any], future: Future | None) -> None:
        try:
            result = command()
        except EngineDied as exc:
            self._die(str(exc))
            if future is not None:
                future.set_exception(exc)
        except BaseException as exc:
            if future is None:
                log.warning("a request to the engine failed: %s", exc)
            else:
                future.set_exception(exc)
        else:
            if future is not None:
                future.set_result(result)

    def _route(self, finished: list[Finished]) -> None:
        per_run: dict[int, list[Finished]] = {}
        with self._lock:
            for out in finished:
                run = self._owner.pop(out.request_id, None)
                if run is None:  # aborted, or its run disconnected
                    continue
                run.in_flight.discard(out.request_id)
                out.request_id = out.request_id.split(":", 1)[1]
                per_run.setdefault(run.number, []).append(out)
            runs = {number: self._runs.get(number) for number in per_run}
        for number, outs in per_run.items():
            run = runs[number]
            if run is not None:
                run.deliver(outs)

    def _die(self, reason: str) -> None:
        log.error("the engine died: %s", reason)
        self.died = reason
        self.stopping.set()
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.deliver([])  # wakes a run waiting for results: it reads `died` next
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.set_exception(EngineDied(self._died_message()))

    def _died_message(self) -> str:
        return f"the kept engine {self.info['id']} (pid {os.getpid()}) died: {self.died}"

    def _call(self, command: Callable[[], Any]) -> Any:
        if self.died is not None:
            raise EngineDied(self._died_message())
        future: Future = Future()
        self._commands.put((command, future))
        return future.result()

    def _post(self, command: Callable[[], Any]) -> None:
        self._commands.put((command, None))

    # -- what a run asks ------------------------------------------------------------------

    def _add_all(self, run: _Run, adds: list[tuple[str, Any, int, Any]]) -> None:
        engine = self.engine
        rejected = []
        for request_id, ids, handle, adapter in adds:
            name = f"{run.number}:{request_id}"
            try:
                engine.add(name, ids, run.params[handle], adapter)
            except EngineDied:
                raise
            except Exception as exc:  # this request alone: its row becomes an error row
                rejected.append(Finished(request_id, str(exc), REJECTED, token_count(ids), 0))
                continue
            with self._lock:
                self._owner[name] = run
                run.in_flight.add(name)
        if rejected:
            run.deliver(rejected)

    def _abort(self, run: _Run, request_ids: list[str]) -> None:
        names = [f"{run.number}:{request_id}" for request_id in request_ids]
        with self._lock:
            live = [name for name in names if self._owner.pop(name, None) is not None]
            run.in_flight.difference_update(live)
        if live:
            self.engine.abort(live)

    def _forget(self, run: _Run) -> None:
        """A run disconnected (it ended, or died): its requests stop generating."""
        with self._lock:
            names = list(run.in_flight)
            for name in names:
                self._owner.pop(name, None)
            run.in_flight.clear()
        if names:
            log.info(
                "run %d left with %d requests in flight: aborting them", run.number, len(names)
            )
            self.engine.abort(names)

    def handle(self, run: _Run, op: str, args: tuple) -> Any:
        if op == "step":
            adds, wait = args
            if adds:
                self._post(lambda: self._add_all(run, adds))
            finished = run.take(wait, lambda: self.died is not None)
            if self.died is not None and not finished:
                raise EngineDied(self._died_message())
            return finished
        if op == "prepare":
            rows, chat_template = args
            return self._call(lambda: self.engine.prepare(rows, chat_template))
        if op == "sampling":
            (merged,) = args
            params = self._call(lambda: self.engine.sampling_params(merged))
            handle = len(run.params)
            run.params[handle] = params
            return handle
        if op == "abort":
            (request_ids,) = args
            self._post(lambda: self._abort(run, request_ids))
            return None
        if op == "hello":
            (keep_alive,) = args
            if keep_alive is not None:
                self.keep_alive = keep_alive
            self._wake()
            return dict(self.info)
        if op == "size":
            (job,) = args
            return self._size(job)
        if op == "status":
            return self.status()
        if op == "stop":
            (force,) = args
            with self._lock:
                others = len(self._runs) - 1
            if force or others == 0:
                self.stopping.set()
                return {"stopped": True, "runs": others}
            self.keep_alive = 0.0
            return {"stopped": False, "runs": others}
        raise ValueError(f"unknown request {op!r}")

    def _wake(self) -> None:
        """Wake a sleeping engine for a run (on the engine thread, after any sleep queued)."""

        def wake() -> None:
            if self.asleep:
                started = time.monotonic()
                self.engine.wake_up()  # type: ignore[attr-defined]
                self.asleep = False
                log.info("awake again in %.2f s", time.monotonic() - started)

        if self.can_sleep:
            self._call(wake)

    def _idle_past_keep_alive(self) -> bool:
        """What an idle keep-alive ends in: True to unload; a sleep where the engine can."""
        if not self.can_sleep or self.asleep:
            return True

        def sleep() -> bool:
            with self._lock:
                if self._runs:  # a run connected meanwhile: it wakes nothing, so stay up
                    return False
            self.engine.sleep()  # type: ignore[attr-defined]
            self.asleep = True
            return True

        if self._call(sleep):
            log.info(
                "asleep after %g s idle: the GPU is free, the weights wait in CPU memory; the "
                "next run wakes it, or it unloads after as long again",
                self.keep_alive,
            )
        self.last_active = time.monotonic()
        return False

    def status(self) -> dict[str, Any]:
        with self._lock:
            runs, in_flight = len(self._runs), len(self._owner)
        return {
            **self.info,
            "runs": runs,
            "in_flight": in_flight,
            "runs_served": self.runs_served,
            "idle_seconds": 0.0 if runs else time.monotonic() - self.last_active,
            "keep_alive": self.keep_alive,
            "asleep": self.asleep,
        }

    # -- connections ----------------------------------------------------------------------

    def _serve_connection(self, conn: socket.socket) -> None:
        with conn:
            uid = wire.peer_uid(conn)
            if uid != os.getuid():
                log.warning("refused a connection from user id %d", uid)
                wire.send(
                    conn,
                    ("refused", f"this kept engine serves user id {os.getuid()} only, not {uid}"),
                )
                return
            run = _Run(next(self._numbers))
            with self._lock:
                self._runs[run.number] = run
            try:
                while True:
                    op, *args = wire.receive(conn)
                    self.last_active = time.monotonic()
                    if op == "hello":
                        self.runs_served += 1
                    try:
                        reply: tuple = ("ok", self.handle(run, op, tuple(args)))
                    except EngineDied as exc:
                        reply = ("died", str(exc))
                    except Exception as exc:
                        reply = ("error", f"{exc}")
                    wire.send(conn, reply)
            except (wire.ConnectionClosed, OSError):
                pass
            finally:
                with self._lock:
                    self._runs.pop(run.number, None)
                if self.died is None:
                    self._post(lambda: self._forget(run))
                self.last_active = time.monotonic()

    def serve(self, listener: socket.socket) -> str:
        """Serve until stopped, idle past the keep-alive, or dead; returns why it ended."""
        engine_thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        engine_thread.start()
        listener.settimeout(_ACCEPT_WAIT)
        ready_at = time.monotonic()
        reason = "stopped"
        while not self.stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                with self._lock:
                    idle = not self._runs
                quiet = time.monotonic() - (self.last_active if self.runs_served else ready_at)
                if idle and self._first_idle is not None and quiet >= _FIRST_IDLE:
                    first_idle, self._first_idle = self._first_idle, None
                    first_idle()
                if (
                    idle
                    and time.monotonic() - self.last_active >= self.keep_alive
                    and self._idle_past_keep_alive()
                ):
                    reason = f"idle for {self.keep_alive:g} s (BATCHLLM_KEEP_ALIVE)"
                    break
                continue
            conn.settimeout(None)
            threading.Thread(
                target=self._serve_connection, args=(conn,), name="run", daemon=True
            ).start()
        self.stopping.set()
        engine_thread.join(timeout=30)
        if self.died is not None:
            reason = f"the engine died: {self.died}"
        return reason
