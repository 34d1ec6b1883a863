"""Keeping long-lived objects out of the garbage collector's way while millions of rows pass."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep what the process holds before a long pass over rows (modules, the tokenizer, the
    engine's objects) out of the garbage collector's oldest-generation scans while it runs.
    The rows in flight outlive the young generations, which starts such a scan every ~40k
    rows, and each walked the whole heap: 0.3 s beside the demo model's tokenizer, a third of
    the feed's CPU and a fifth of validation's. vLLM freezes its engine core's startup heap for
    the same reason; a heap frozen already is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # what became garbage meanwhile can be collected again
