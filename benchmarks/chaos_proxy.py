"""A small TCP proxy the chaos run owns (issue 52), between its workers and a service (Redis,
PostgreSQL, the S3 server): the faults no process signal can make. No toxiproxy server is
installable here and `tc netem` needs privileges a container may lack (GUIDE section 5), so
the harness forwards the workers' connections itself, on an asyncio loop in a thread of its
own, and changes what the wire does on command:

- `delay(low, high)`: every chunk waits a random low..high seconds before it is passed on
  (each direction; a request and its answer cross twice), until `heal()`.
- `partition()`: new connections are reset as soon as they are accepted (what a refused
  connect looks like to a client), and the open ones stall: nothing is read from or written to
  either side, so their bytes wait in the kernels' buffers. `heal()` lets them flow on where
  they stopped, as a short partition heals under TCP's retransmissions.
- `fail_http(rng)`: an HTTP service failing (an S3 endpoint in trouble): the open
  connections are reset, and each new one is either reset or answered `503 Slow Down` (S3's
  throttling answer) and closed, at random, until `heal()`.

Everything else passes through byte for byte. The proxy connects to its target anew for every
client connection, so a restarted service (redis-restart, pg-outage) is reached again without
the proxy noticing. Control calls return once the loop has applied them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from dataclasses import dataclass, field

from batchllm.process.ports import HOST, free_port

CHUNK = 65536
CONNECT_TIMEOUT = 10.0
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_503 = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(SLOW_DOWN) + SLOW_DOWN
)


@dataclass
class ProxyStats:
    accepted: int = 0
    reset: int = 0  # connections reset by a partition or an HTTP failure
    answered_503: int = 0
    upstream_failed: int = 0  # the target did not take the connection (down, restarting)
    bytes: int = 0


@dataclass(eq=False)
class _Link:
    """One client connection and its upstream one."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dead peer or a firewall would."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class TcpProxy:
    """Listens on `port` (default: a free one) of 127.0.0.1, chosen at once so that the
    clients' settings can name it before the proxy starts, and forwards to `target_port`."""

    def __init__(
        self, *, name: str, target_port: int, target_host: str = HOST, port: int | None = None
    ) -> None:
        self.name, self.target_host, self.target_port = name, target_host, target_port
        self.port = port or free_port()
        self.stats = ProxyStats()
        self.mode = "clear"  # clear | delay | partition | http-errors
        self._delay = (0.0, 0.0)
        self._rng = random.Random(0)
        self._links: set[_Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    # -- from the harness's threads ---------------------------------------------------------

    def start(self) -> TcpProxy:
        ready = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            loop = self._loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self._listen())
            except BaseException as exc:  # surfaced in start()
                failed.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
            loop.close()

        self._thread = threading.Thread(target=serve, name=f"proxy-{self.name}", daemon=True)
        self._thread.start()
        ready.wait(timeout=30)
        if failed or not ready.is_set():
            raise RuntimeError(f"proxy {self.name} did not start: {failed}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def delay(self, low: float, high: float, *, seed: int = 0) -> None:
        self._call(self._set, "delay", (low, high), seed)

    def partition(self) -> None:
        self._call(self._set, "partition", (0.0, 0.0), 0)

    def fail_http(self, *, seed: int = 0) -> None:
        self._call(self._set, "http-errors", (0.0, 0.0), seed)

    def heal(self) -> None:
        self._call(self._set, "clear", (0.0, 0.0), 0)

    def open_links(self) -> int:
        return len(self._links)

    def _call(self, fn, *args) -> None:
        if self._loop is None:
            raise RuntimeError(f"proxy {self.name} is not running")
        future = asyncio.run_coroutine_threadsafe(fn(*args), self._loop)
        future.result(timeout=30)

    # -- on the proxy's loop ----------------------------------------------------------------

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, HOST, self.port)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            self._cut(link)
        await asyncio.sleep(0)

    async def _set(self, mode: str, delay: tuple[float, float], seed: int) -> None:
        assert self._flowing is not None
        self.mode, self._delay, self._rng = mode, delay, random.Random(seed)
        if mode == "partition":
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode == "http-errors":
            for link in list(self._links):
                self.stats.reset += 1
                self._cut(link)

    def _cut(self, link: _Link) -> None:
        _reset(link.client)
        if link.upstream is not None:
            _reset(link.upstream)
        for task in link.tasks:
            task.cancel()
        self._links.discard(link)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        if self.mode == "partition" or (self.mode == "http-errors" and self._rng.random() < 0.5):
            self.stats.reset += 1
            _reset(writer)
            return
        if self.mode == "http-errors":
            await self._answer_503(reader, writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), CONNECT_TIMEOUT
            )
        except (OSError, asyncio.TimeoutError):
            self.stats.upstream_failed += 1
            _reset(writer)
            return
        link = _Link(client=writer, upstream=up_writer)
        self._links.add(link)
        link.tasks = [
            asyncio.ensure_future(self._pipe(reader, up_writer)),
            asyncio.ensure_future(self._pipe(up_reader, writer)),
        ]
        try:
            # Either side's end ends the link: the protocols behind it never half-close.
            await asyncio.wait(link.tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in link.tasks:
                task.cancel()
            for end in (writer, up_writer):
                with contextlib.suppress(Exception):
                    end.close()
            self._links.discard(link)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                await self._flowing.wait()  # a partition stops reading too: bytes queue up
                data = await reader.read(CHUNK)
                if not data:
                    return
                if self.mode == "delay":
                    await asyncio.sleep(self._rng.uniform(*self._delay))
                await self._flowing.wait()  # a partition that began meanwhile holds this chunk
                writer.write(data)
                await writer.drain()
                self.stats.bytes += len(data)

    async def _answer_503(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A request body left unread makes the kernel's close a reset after the answer.
        with contextlib.suppress(
            ConnectionError, OSError, EOFError, asyncio.TimeoutError, asyncio.LimitOverrunError
        ):
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(_503)
            await writer.drain()
            self.stats.answered_503 += 1
        with contextlib.suppress(Exception):
            writer.close()
            await writer.wait_closed()
