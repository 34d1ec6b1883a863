"""A kept engine on a GPU sleeps through its first idle keep-alive and unloads after the second;
a run that connects while it sleeps wakes it first. No GPU here: the host is driven over a real
Unix socket with the fake engine, told it can sleep, counting its sleeps and wakes."""

from __future__ import annotations

import socket
import threading
import time

from batchllm.execution.stand_in_engines import FakeEngine
from batchllm.kept_engine import wire
from batchllm.kept_engine.host import EngineHost

KEEP_ALIVE = 0.5
DEADLINE = 30.0


class SleepyEngine(FakeEngine):
    can_sleep = True

    def __init__(self) -> None:
        super().__init__()
        self.sleeps = self.wakes = 0

    def sleep(self) -> None:
        self.sleeps += 1

    def wake_up(self) -> None:
        self.wakes += 1


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {DEADLINE} s"
        time.sleep(0.02)


def serve(tmp_path, engine) -> tuple[EngineHost, threading.Thread, str, list[str]]:
    path = str(tmp_path / "engine.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    info = {
        "id": "eng_test",
        "max_model_len": 64,
        "max_num_seqs": 4,
        "version": "fake",
        "hardware": "fake",
        "pid": 0,
        "model": "fake",
        "kind": "fake",
    }
    host = EngineHost(engine, info=info, keep_alive=KEEP_ALIVE, size=lambda job: 64)
    ended: list[str] = []
    thread = threading.Thread(target=lambda: ended.append(host.serve(listener)), daemon=True)
    thread.start()
    return host, thread, path, ended


def test_an_idle_engine_that_can_sleep_sleeps_is_woken_by_a_run_and_unloads_later(tmp_path):
    engine = SleepyEngine()
    host, thread, path, ended = serve(tmp_path, engine)

    wait_for(lambda: host.asleep, "asleep after one keep-alive")
    assert (engine.sleeps, engine.wakes, ended) == (1, 0, [])

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as run:
        run.connect(path)
        wire.send(run, ("hello", None))
        status, info = wire.receive(run)
        assert (status, info["id"]) == ("ok", "eng_test")
        assert (engine.wakes, host.asleep) == (1, False)
        time.sleep(2 * KEEP_ALIVE)  # a connected run keeps it awake, however long
        assert (engine.sleeps, host.asleep, ended) == (1, False, [])

    wait_for(lambda: host.asleep, "asleep again once the run left")
    thread.join(timeout=DEADLINE)
    assert ended == [f"idle for {KEEP_ALIVE:g} s (BATCHLLM_KEEP_ALIVE)"]
    assert (engine.sleeps, engine.wakes) == (2, 1)


def test_an_engine_that_cannot_sleep_unloads_after_one_keep_alive(tmp_path):
    engine = FakeEngine()
    host, thread, _, ended = serve(tmp_path, engine)

    thread.join(timeout=DEADLINE)

    assert ended == [f"idle for {KEEP_ALIVE:g} s (BATCHLLM_KEEP_ALIVE)"]
    assert host.asleep is False
