"""The chaos run's TCP proxy (benchmarks/chaos_proxy.py) in front of a local echo server, no
service needed: bytes pass through unchanged, a delay is felt on the wire, a partition resets
new connections and stalls open ones until it heals, and an HTTP failure resets or answers
503 until it heals."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from batchllm.process.ports import HOST
from benchmarks.chaos_proxy import TcpProxy

pytestmark = pytest.mark.timeout(60)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    server = socketserver.ThreadingTCPServer((HOST, 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with TcpProxy(name="echo", target_port=server.server_address[1]) as running:
        yield running
    server.shutdown()
    server.server_close()


def _connect(proxy: TcpProxy, timeout: float = 10) -> socket.socket:
    return socket.create_connection((HOST, proxy.port), timeout=timeout)


def _exchange(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def _refused(proxy: TcpProxy) -> bool:
    """Whether a new connection is cut at once (reset or closed before any answer)."""
    try:
        with _connect(proxy, timeout=5) as sock:
            sock.sendall(b"ping")
            return sock.recv(16) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def _wait_for(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_bytes_pass_through_the_proxy_unchanged_both_ways(proxy):
    payload = os.urandom(1_000_000)
    with _connect(proxy) as sock:
        assert _exchange(sock, payload) == payload
        assert _exchange(sock, b"again") == b"again"
    assert proxy.stats.accepted == 1
    assert proxy.stats.bytes >= 2 * len(payload)


def test_a_delay_holds_every_chunk_each_way_until_healed(proxy):
    with _connect(proxy) as sock:
        began = time.monotonic()
        _exchange(sock, b"warm")
        plain = time.monotonic() - began

        proxy.delay(0.3, 0.3)
        began = time.monotonic()
        assert _exchange(sock, b"slow") == b"slow"
        delayed = time.monotonic() - began

        proxy.heal()
        began = time.monotonic()
        assert _exchange(sock, b"fast") == b"fast"
        healed = time.monotonic() - began
    # There and back: two chunks, 0.3 s each.
    assert delayed >= 0.6
    assert plain < 0.3 and healed < 0.3


def test_a_partition_refuses_new_connections_and_stalls_open_ones_until_it_heals(proxy):
    with _connect(proxy) as before:
        assert _exchange(before, b"one") == b"one"
        proxy.partition()

        assert _refused(proxy)
        before.settimeout(0.5)
        before.sendall(b"held")
        with pytest.raises(TimeoutError):
            before.recv(16)

        proxy.heal()
        before.settimeout(10)
        assert before.recv(16) == b"held"  # the stalled bytes flow on where they stopped
    with _connect(proxy) as after:
        assert _exchange(after, b"two") == b"two"
    assert proxy.stats.reset == 1


def test_an_http_failure_resets_open_connections_and_fails_new_requests_until_healed(proxy):
    with _connect(proxy) as before:
        assert _exchange(before, b"one") == b"one"
        proxy.fail_http(seed=3)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            before.sendall(b"x")
            if before.recv(16) == b"":
                raise ConnectionResetError("closed")

    answers = []
    for _ in range(12):
        try:
            with _connect(proxy) as sock:
                sock.sendall(b"GET /bucket/key HTTP/1.1\r\nHost: s3\r\n\r\n")
                answers.append(sock.recv(4096).split(b"\r\n", 1)[0] or b"closed")
        except ConnectionResetError:
            answers.append(b"reset")
    assert set(answers) <= {b"HTTP/1.1 503 Slow Down", b"reset", b"closed"}
    assert b"HTTP/1.1 503 Slow Down" in answers
    assert {b"reset", b"closed"} & set(answers)

    proxy.heal()
    with _connect(proxy) as after:
        assert _exchange(after, b"two") == b"two"
    _wait_for(lambda: proxy.open_links() == 0)
