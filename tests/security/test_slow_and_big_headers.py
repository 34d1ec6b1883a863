"""Request heads are bounded in size and in time: an oversized header is answered 431 and the
connection closed, a client sending its head a byte at a time or nothing at all is dropped after
the header timeout, and the server answers everyone else meanwhile."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.rawhttp import closed_by_server, connect, parse_response, read_response
from tests.support.serve import HEADER_TIMEOUT, Served

pytestmark = pytest.mark.security

# Dropped no sooner than the timeout, and not much later (a loaded 2-core machine may be slow
# to run the timer, never this slow).
SLACK = 10.0


def test_a_64_kb_header_is_answered_431_and_closed(serve: Served) -> None:
    with connect(serve.port) as sock:
        sock.sendall(
            b"GET /v1/files HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 * 1024) + b"\r\n\r\n"
        )
        response = read_response(sock, timeout=10)
        assert response.status == 431
        assert response.headers.get("connection") == "close"
        assert closed_by_server(sock, timeout=10) is not None


def test_a_64_mb_header_is_not_read_whole(serve: Served) -> None:
    rss_before = serve.rss_bytes()
    sent = 0
    data = b""
    with connect(serve.port) as sock:
        sock.sendall(b"GET /v1/files HTTP/1.1\r\nHost: x\r\nX-Big: ")
        piece = b"a" * (1 << 20)
        try:
            while sent < 64 << 20:
                sock.sendall(piece)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(10)
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    # The server stopped reading near its limit: the client could not push 64 MB in.
    assert sent < 16 << 20, f"{sent:,} bytes of header sent"
    response = parse_response(data)
    assert response is None or response.status == 431, data[:200]
    assert serve.rss_bytes() - rss_before < 16 << 20
    assert httpx.get(f"{serve.base_url}/health", timeout=10).status_code == 200


def test_a_slow_header_client_is_dropped_while_others_are_served(serve: Served) -> None:
    answered: list[float] = []
    stop = threading.Event()

    def others() -> None:
        while not stop.is_set():
            started = time.monotonic()
            if httpx.get(f"{serve.base_url}/health", timeout=5).status_code == 200:
                answered.append(time.monotonic() - started)
            stop.wait(0.5)

    helper = threading.Thread(target=others, daemon=True)
    with connect(serve.port) as sock:
        start = time.monotonic()
        helper.start()
        try:
            dropped = None
            # One byte of a never-ending header every half second (slowloris).
            for byte in b"GET /v1/files HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
                try:
                    sock.send(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    dropped = time.monotonic() - start
                    break
                if closed_by_server(sock, timeout=0.5) is not None:
                    dropped = time.monotonic() - start
                    break
                if time.monotonic() - start > HEADER_TIMEOUT + SLACK:
                    break
        finally:
            stop.set()
            helper.join()
    assert dropped is not None, f"still open after {HEADER_TIMEOUT + SLACK:.0f} s"
    assert HEADER_TIMEOUT - 0.5 <= dropped <= HEADER_TIMEOUT + SLACK, dropped
    assert len(answered) >= 3 and max(answered) < 2, answered


def test_an_idle_connection_is_dropped(serve: Served) -> None:
    with connect(serve.port) as sock:
        dropped = closed_by_server(sock, timeout=HEADER_TIMEOUT + SLACK)
    assert dropped is not None, f"still open after {HEADER_TIMEOUT + SLACK:.0f} s"
    assert HEADER_TIMEOUT - 0.5 <= dropped <= HEADER_TIMEOUT + SLACK, dropped


def test_a_kept_alive_connection_that_goes_slow_is_dropped(serve: Served) -> None:
    with connect(serve.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).status == 200
        start = time.monotonic()
        # The next request's head starts but never ends: the byte cancels uvicorn's keep-alive
        # timer; the head's own deadline still holds.
        sock.sendall(b"G")
        dropped = closed_by_server(sock, timeout=HEADER_TIMEOUT + SLACK)
    assert dropped is not None
    assert time.monotonic() - start <= HEADER_TIMEOUT + SLACK


def test_an_ordinary_client_is_unaffected(serve: Served) -> None:
    headers = serve.new_key()
    with httpx.Client(base_url=serve.base_url, headers=headers, timeout=10) as client:
        for _ in range(3):  # one kept-alive connection
            assert client.get("/v1/files").status_code == 200
