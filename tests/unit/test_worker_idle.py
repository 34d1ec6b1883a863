"""`worker --max-idle`: the idle clock starts when the engine is ready, stops while a task runs
and calls for the stop once, after the set time without a task."""

from __future__ import annotations

import threading

from batchllm.worker.idle import IdleWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_time_counts_from_the_reset_and_pauses_while_a_task_runs():
    clock = Clock()
    watch = IdleWatch(15, clock=clock)
    clock.now += 50  # the engine build is not idle time
    watch.reset()
    clock.now += 10
    assert watch.idle_for() == 10
    watch.started()
    clock.now += 60  # a long task
    assert watch.idle_for() == 0
    watch.ended()
    clock.now += 5
    assert watch.idle_for() == 5


def test_the_watch_calls_for_the_stop_once_after_the_idle_time():
    watch = IdleWatch(1)  # checks every 0.25 s
    called = threading.Event()
    calls = []

    def on_idle() -> None:
        calls.append(1)
        called.set()

    thread = watch.watch(threading.Event(), on_idle)
    assert called.wait(timeout=30)
    thread.join(timeout=10)
    assert calls == [1] and not thread.is_alive()


def test_a_stop_before_the_idle_time_ends_the_watch_without_calling():
    watch = IdleWatch(3600)
    stop = threading.Event()
    calls = []
    thread = watch.watch(stop, lambda: calls.append(1))
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive() and calls == []
