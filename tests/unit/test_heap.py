"""frozen_heap: the heap before a long pass is frozen and the young generation collected less
often while it runs; both are put back afterwards, also when the pass fails. (An in-process
vLLM engine of an earlier test may have frozen this process's heap already: the tests hold
either way.)"""

from __future__ import annotations

import gc

import pytest

from batchllm.heap import _YOUNG_THRESHOLD, frozen_heap


def test_the_heap_is_frozen_and_the_thresholds_raised_only_inside():
    before, already = gc.get_threshold(), gc.get_freeze_count()
    with frozen_heap():
        assert gc.get_freeze_count() >= max(already, 1)
        assert gc.get_threshold()[0] == max(before[0], _YOUNG_THRESHOLD)
        assert gc.get_threshold()[1:] == before[1:]
    assert gc.get_freeze_count() == already
    assert gc.get_threshold() == before


def test_a_failing_pass_puts_everything_back():
    before, already = gc.get_threshold(), gc.get_freeze_count()
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("the pass failed")
    assert gc.get_freeze_count() == already
    assert gc.get_threshold() == before


def test_a_heap_frozen_by_the_caller_stays_frozen():
    already = gc.get_freeze_count()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen  # the caller's freeze is the caller's to undo
    finally:
        if not already:
            gc.unfreeze()
