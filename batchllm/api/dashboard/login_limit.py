"""A bound on failed dashboard logins: after BATCHLLM_API_LOGIN_MAX_FAILURES failures from one
client address within BATCHLLM_API_LOGIN_WINDOW seconds, its logins are answered 429 (without
looking at the key) until the oldest failure leaves the window. Without it a client could try
keys as fast as the server answered.

Counted in the process (each `serve` process keeps its own), by the address the connection comes
from: behind a proxy every client shares the proxy's, so a proxy should limit logins itself.
"""

from __future__ import annotations

import threading
import time
from collections import deque

# Addresses remembered at most: a flood from many addresses cannot grow the table without end.
MAX_CLIENTS = 10_000


class LoginLimit:
    def __init__(self, max_failures: int, window: float) -> None:
        self.max_failures, self.window = max_failures, window
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def retry_after(self, client: str) -> float | None:
        """Seconds until `client` may try again, or None when it may now."""
        now = time.monotonic()
        with self._lock:
            failures = self._recent(client, now)
            if failures is None or len(failures) < self.max_failures:
                return None
            return max(1.0, failures[0] + self.window - now)

    def failed(self, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            if client not in self._failures and len(self._failures) >= MAX_CLIENTS:
                self._forget_idle(now)
            self._failures.setdefault(client, deque(maxlen=self.max_failures)).append(now)

    def _recent(self, client: str, now: float) -> deque[float] | None:
        failures = self._failures.get(client)
        if failures is None:
            return None
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if not failures:
            del self._failures[client]
            return None
        return failures

    def _forget_idle(self, now: float) -> None:
        for client in list(self._failures):
            self._recent(client, now)
        while len(self._failures) >= MAX_CLIENTS:  # still full: the oldest entries go
            del self._failures[next(iter(self._failures))]
