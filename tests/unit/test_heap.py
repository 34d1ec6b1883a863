"""frozen_heap: the heap before a long pass is frozen and the young generation collected less
often while it runs; both are put back afterwards, also when the pass fails, and a heap the
caller froze stays frozen.

Each case runs in a fresh interpreter: in this one an in-process vLLM engine of an earlier test
may have frozen the heap already, and the count of frozen objects drifts as some of them die."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = """
import gc
from batchllm.heap import _YOUNG_THRESHOLD, frozen_heap
before = gc.get_threshold()
assert gc.get_freeze_count() == 0
"""


def run_checks(body: str) -> None:
    script = PRELUDE + textwrap.dedent(body) + "\nprint('checked')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "checked"


def test_the_heap_is_frozen_and_the_thresholds_raised_only_inside():
    run_checks(
        """
        with frozen_heap():
            assert gc.get_freeze_count() > 0
            assert gc.get_threshold() == (max(before[0], _YOUNG_THRESHOLD), *before[1:])
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before
        """
    )


def test_a_failing_pass_puts_everything_back():
    run_checks(
        """
        try:
            with frozen_heap():
                raise RuntimeError("the pass failed")
        except RuntimeError:
            pass
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before
        """
    )


def test_a_heap_frozen_by_the_caller_stays_frozen():
    run_checks(
        """
        gc.freeze()
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the caller's freeze is the caller's to undo
        assert gc.get_threshold() == before
        """
    )


def test_overlapping_passes_on_two_threads_put_the_settings_back():
    """serve validates several batches at once: B enters while A runs, A leaves first. Each
    pass saving and restoring the settings itself left the young threshold at 50,000 and,
    with the heap thawed by A while B ran, every create's objects in the oldest generation."""
    run_checks(
        """
        import threading
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        seen = {}

        def a():
            with frozen_heap():
                a_in.set()
                b_in.wait(10)
            a_out.set()

        def b():
            a_in.wait(10)
            with frozen_heap():
                b_in.set()
                a_out.wait(10)
                # A has left: B still runs, so the heap stays frozen and the threshold raised.
                seen["inside"] = (gc.get_freeze_count() > 0, gc.get_threshold())

        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        raised = (max(before[0], _YOUNG_THRESHOLD), *before[1:])
        assert seen["inside"] == (True, raised), seen
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() == 0
        """
    )


def test_a_serving_heap_is_frozen_once_and_no_pass_thaws_it():
    run_checks(
        """
        import platform
        from batchllm.heap import pin_mmap_threshold, serving_heap
        with serving_heap():
            frozen = gc.get_freeze_count()
            assert frozen > 0
            with frozen_heap():  # a create's validation
                pass
            assert gc.get_freeze_count() > 0  # still the server's freeze
            assert gc.get_threshold() == before
        assert gc.get_freeze_count() == 0
        assert pin_mmap_threshold() == (platform.libc_ver()[0] == "glibc")
        """
    )


def test_a_serving_heap_keeps_a_request_cycle_in_the_young_generations():
    """What grew serve's memory: a cycle alive when a pass froze the heap was in the oldest
    generation once it thawed, out of reach of the young collections."""
    run_checks(
        """
        import weakref
        from batchllm.heap import serving_heap

        class Node:
            pass

        def request() -> weakref.ref:
            node = Node()
            node.self = node  # a reference cycle, as SQLAlchemy's and kombu's objects make
            with frozen_heap():
                pass
            return weakref.ref(node)

        gc.disable()  # only the collections below
        thawed_cycle = request()
        gc.collect(1)
        assert thawed_cycle() is not None  # in the oldest generation: a young collection missed it
        gc.collect()
        with serving_heap():
            served_cycle = request()
            gc.collect(1)
            assert served_cycle() is None  # collected young
        """
    )
