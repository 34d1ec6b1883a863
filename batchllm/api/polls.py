"""Polls on threads of their own: GET of a batch and of a page of batches, the requests a Batch
API server answers most, run on at most BATCHLLM_API_POLL_THREADS threads at once, apart from
the request threads (BATCHLLM_API_THREADS) that the other routes share.

Why apart: a poll is a millisecond of Python under one GIL, and the more threads hold polls
at once, the more they take turns and the longer the slowest waits (100 clients polling one
process here: p99 0.45-0.47 s on 40 threads, 0.29-0.31 s on 16, 0.21-0.27 s on 8, answered/s
alike). On the shared threads a burst of slow requests (uploads, the creates of big files)
would also hold the polls behind them, and a few threads for everything would hold the slow
requests behind each other."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from anyio import CapacityLimiter, to_thread
from fastapi import Request

T = TypeVar("T")

# One limiter per event loop: a limiter belongs to the loop it was made on (a test client
# may run each request on a loop of its own).
_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


async def on_poll_threads(request: Request, function: Callable[..., T], *args: object) -> T:
    """`function(*args)` on a poll thread: at most the app's poll threads at once."""
    loop = asyncio.get_running_loop()
    limiter = _LIMITERS.get(loop)
    if limiter is None:
        limiter = _LIMITERS[loop] = CapacityLimiter(request.app.state.settings.api_poll_threads)
    return await to_thread.run_sync(partial(function, *args), limiter=limiter)
