"""Keeping long-lived objects out of the garbage collector's way while millions of rows pass."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_YOUNG_THRESHOLD = 50_000


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep what the process holds before a long pass over rows (modules, the tokenizer, the
    engine's objects) out of the garbage collector's oldest-generation scans while it runs.
    The rows in flight outlive the young generations, which starts such a scan every ~40k
    rows, and each walked the whole heap: 0.3 s beside the demo model's tokenizer, a third of
    the feed's CPU and a fifth of validation's. vLLM freezes its engine core's startup heap for
    the same reason; a heap frozen already is left as it is. The young generation is
    collected less often meanwhile. Also around a vLLM engine's build in this process
    (engine/vllm_engine.py), whose start walks the whole heap five times: the demo model's
    build took 3.2-3.3 s unfrozen, 2.0 s frozen (issue 63)."""
    thresholds = gc.get_threshold()
    # Rows, lines and requests come and go by the hundred thousand, nearly none in a cycle:
    # collecting the young generation every 700 allocations (the default) cost a twentieth of
    # validation. Every 50,000 still bounds what a cycle can hold on to.
    gc.set_threshold(max(thresholds[0], _YOUNG_THRESHOLD), *thresholds[1:])
    frozen = not gc.get_freeze_count()
    if frozen:
        gc.freeze()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if frozen:
            gc.unfreeze()  # what became garbage meanwhile can be collected again
