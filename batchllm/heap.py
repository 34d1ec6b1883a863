"""Keeping long-lived objects out of the garbage collector's way while millions of rows pass,
and while a server answers requests."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_YOUNG_THRESHOLD = 50_000

# The collector's settings are the process's, and `serve` validates several batches at once on
# its request threads: the passes running now are counted, the first one in changes the
# settings and the last one out puts them back. Each pass saving and restoring them itself left
# the young threshold at 50,000 for good after two overlapping passes (A saves 700, B saves
# A's 50,000, A restores 700, B restores 50,000): measured after 900 creates from 8 clients.
_lock = threading.Lock()
_passes = 0
_saved_thresholds: tuple[int, int, int] = gc.get_threshold()
_froze = False


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep what the process holds before a long pass over rows (modules, the tokenizer, the
    engine's objects) out of the garbage collector's oldest-generation scans while it runs.
    The rows in flight outlive the young generations, which starts such a scan every ~40k
    rows, and each walked the whole heap: 0.3 s beside the demo model's tokenizer, a third of
    the feed's CPU and a fifth of validation's. vLLM freezes its engine core's startup heap for
    the same reason; a heap frozen already is left as it is (`serve` freezes its own, see
    serving_heap). The young generation is collected less often meanwhile. Also around
    a vLLM engine's build in this process (engine/vllm_engine.py), whose start walks the whole
    heap five times: the demo model's build took 3.2-3.3 s unfrozen, 2.0 s frozen (issue 63).
    Passes on several threads at once share one freeze: the first in freezes, the last out
    thaws."""
    global _passes, _saved_thresholds, _froze
    with _lock:
        if _passes == 0:
            _saved_thresholds = gc.get_threshold()
            # Rows, lines and requests come and go by the hundred thousand, nearly none in a
            # cycle: collecting the young generation every 700 allocations (the default) cost
            # a twentieth of validation. Every 50,000 still bounds what a cycle can hold on to.
            gc.set_threshold(max(_saved_thresholds[0], _YOUNG_THRESHOLD), *_saved_thresholds[1:])
            _froze = not gc.get_freeze_count()
            if _froze:
                gc.freeze()
        _passes += 1
    try:
        yield
    finally:
        with _lock:
            _passes -= 1
            if _passes == 0:
                gc.set_threshold(*_saved_thresholds)
                if _froze:
                    gc.unfreeze()  # what became garbage meanwhile can be collected again


@contextlib.contextmanager
def uncollected_imports() -> Iterator[None]:
    """Import vLLM (torch, transformers, its config and engine modules) with the collector
    paused. The import creates millions of objects that live as long as the process, and a
    young collection every 700 allocations walked them again and again as they aged: `from
    vllm import LLM` took 6.6-7.4 s with the collector on, 5.2-5.3 s with it off (2 cores, two
    runs each; issue 63).

    Afterwards they go straight to the oldest generation (a freeze and a thaw move them there
    without a walk, and without counting them towards its next collection), as if they had
    aged through the young ones. Inside a frozen pass (frozen_heap) they join its freeze."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        already_frozen = gc.get_freeze_count() > 0
        gc.freeze()
        if not already_frozen:
            gc.unfreeze()
        if enabled:
            gc.enable()


# glibc's own starting value, pinned: see serving_heap.
_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # malloc.h


def pin_mmap_threshold() -> bool:
    """Keep glibc's malloc from raising its mmap threshold (whether it did: False off glibc).

    Each block of 128 KiB or more that is freed raises glibc's threshold to its size (up to 32
    MiB), after which such blocks come from the per-thread arenas instead of mmap, where the
    small ones allocated between them keep the arenas' free space from going back: `serve`'s
    threads took 30 -> 40 MiB of such free space over 1,000 creates. Setting the threshold
    turns that adjustment off for the rest of the process; it cannot be read back, so it is
    not undone."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))


@contextlib.contextmanager
def serving_heap() -> Iterator[None]:
    """The heap of a server process while it serves: glibc's mmap threshold pinned
    (pin_mmap_threshold) and the heap it holds when it starts (modules, the app, its routes)
    frozen, so that no request's frozen_heap freezes and thaws it.

    A freeze takes every object alive at that moment, the young garbage and the other
    requests' objects included, and a thaw puts them all in the oldest generation without
    counting them towards its next collection. Each POST /v1/batches validates its file
    inside frozen_heap, so each one moved the objects its request held in reference cycles
    (SQLAlchemy statements, kombu's transport, the request's own; ~360 objects a create
    through HTTP) to where only a rare full collection found them: `serve`'s memory grew
    33-59 KiB a create, without a plateau, over 1,500 creates (benchmarks/serve_load.py).
    Frozen once here, a request's garbage is the young generations' to collect as it dies.

    No collection first: the garbage of the imports is small and frozen once, and a full
    collection would cost every app a test suite enters. Left as it is when the heap is
    frozen already (a vLLM engine's core, an enclosing pass)."""
    pin_mmap_threshold()
    froze = not gc.get_freeze_count()
    if froze:
        gc.freeze()
    try:
        yield
    finally:
        if froze:
            gc.unfreeze()
