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
