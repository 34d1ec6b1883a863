"""The HTTP/1.1 protocol `batchllm serve` runs uvicorn with: h11, the request head bounded in
size and in time.

uvicorn with httptools bounds neither (a 64 MB header was read whole); with h11 the head's size
is bounded (h11_max_incomplete_event_size) but its time is not: a connection that sends a byte
every few seconds, or nothing at all, is kept open forever (each byte cancels uvicorn's only
timer, the keep-alive one, and a new connection has none). One such client per socket the
process may open would take the server down. This protocol gives each request head a deadline
from the moment the server starts waiting for it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from batchllm.settings import Settings, get_settings

_TOO_LARGE_TEXT = b"Request header fields too large."
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_TOO_LARGE_TEXT), _TOO_LARGE_TEXT)
)


class BoundedH11Protocol(H11Protocol):
    """H11Protocol whose connections are closed when a request head does not arrive within
    `head_timeout` seconds, or is over `max_head_bytes` (answered 431)."""

    head_timeout: float = 15.0
    max_head_bytes: int = 16 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._head_arrived()

    def on_response_complete(self) -> None:
        # Armed before the next head is looked for: a pipelined one found at once disarms it.
        if not self.transport.is_closing():
            self._await_head()
        super().on_response_complete()

    def data_received(self, data: bytes) -> None:
        # h11 bounds only a head still incomplete after a read: one that arrives whole in a
        # few reads of 64 KB is parsed whatever its size. Measured here before h11 sees it.
        if self.conn.their_state is h11.IDLE and self._head_size(data) > self.max_head_bytes:
            self.transport.write(_HEAD_TOO_LARGE)
            self.transport.close()
            return
        super().data_received(data)

    def _head_size(self, data: bytes) -> int:
        unparsed = self.conn.trailing_data[0] + data
        end = unparsed.find(b"\r\n\r\n")
        return len(unparsed) if end < 0 else end + 4

    def _await_head(self) -> None:
        self._head_arrived()
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def _head_arrived(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class EnvBoundedH11Protocol(BoundedH11Protocol):
    """BoundedH11Protocol with the environment's limits: the class `serve --workers N` hands
    uvicorn, whose worker processes are spawned and so take the class by its import path (a
    class made at run time for the settings cannot be sent to them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.head_timeout, self.max_head_bytes = _environment_limits()
        super().__init__(*args, **kwargs)


@functools.cache
def _environment_limits() -> tuple[float, int]:
    settings = get_settings()
    return settings.api_header_timeout, settings.api_max_header_bytes


def server_options(settings: Settings, *, processes: int = 1) -> dict[str, Any]:
    """uvicorn.run's keyword arguments for these limits; with several `processes`, the limits
    are the environment's (`serve` takes them from there)."""
    protocol: type[BoundedH11Protocol] = EnvBoundedH11Protocol
    if processes == 1:
        protocol = type(
            "BoundedH11Protocol",
            (BoundedH11Protocol,),
            {
                "head_timeout": settings.api_header_timeout,
                "max_head_bytes": settings.api_max_header_bytes,
            },
        )
    return {"http": protocol, "h11_max_incomplete_event_size": settings.api_max_header_bytes}
