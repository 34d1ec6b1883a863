"""Request bodies have a deadline: a body that arrives a byte every 2 s (an upload with a key, or
a login, which needs none) is answered 408 and its connection closed once it falls behind the
minimum rate after the grace, and the server's file descriptors go back to what they were; a
slow body that keeps up with the rate is taken whole. The dashboard's forms have a small body
limit, refused before a byte is read.

Before: such connections (a 10 MB upload in the probe) were held for as long as the client
liked (200 of them: 200 file descriptors after 150 s), and a login could declare a megabyte and
send nothing."""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.rawhttp import (
    BOUNDARY,
    connect,
    multipart_preamble,
    parse_response,
    read_response,
    upload_head,
)
from tests.support.serve import Served, start_serve, stop_serve

pytestmark = pytest.mark.security

BODY_TIMEOUT = 3.0
MIN_BODY_RATE = 1024
DRIP_SECONDS = 2.0
# Cut no sooner than the grace, and well before this (a loaded 2-core machine may be slow to
# run the timer, never this slow).
DEADLINE = BODY_TIMEOUT + 30.0


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_serve(
        tmp_path_factory.mktemp("slow"),
        BATCHLLM_API_BODY_TIMEOUT=str(BODY_TIMEOUT),
        BATCHLLM_API_MIN_BODY_RATE=str(MIN_BODY_RATE),
    )
    try:
        yield served
    finally:
        stop_serve(served)


def _socket_fds(served: Served) -> int:
    fd_dir = Path(f"/proc/{served.proc.pid}/fd")
    count = 0
    for fd in os.listdir(fd_dir):
        try:
            count += os.readlink(fd_dir / fd).startswith("socket:")
        except OSError:
            continue  # closed meanwhile
    return count


def _drip(socks: list[socket.socket], timeout: float) -> dict[socket.socket, tuple[float, bytes]]:
    """Send each socket one body byte every DRIP_SECONDS until the server closes it; for each
    closed one, the seconds it took and what the server sent. Those still open after `timeout`
    are missing from the answer."""
    start = time.monotonic()
    received = {sock: b"" for sock in socks}
    closed: dict[socket.socket, tuple[float, bytes]] = {}
    next_drip = start
    while len(closed) < len(socks) and time.monotonic() - start < timeout:
        open_socks = [s for s in socks if s not in closed]
        if time.monotonic() >= next_drip:
            for sock in open_socks:
                try:
                    sock.send(b"x")
                except (BrokenPipeError, ConnectionResetError):
                    closed[sock] = (time.monotonic() - start, received[sock])
            next_drip += DRIP_SECONDS
        wait = max(0.0, min(next_drip, start + timeout) - time.monotonic())
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [], wait)
        for sock in readable:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            if chunk:
                received[sock] += chunk
            else:
                closed[sock] = (time.monotonic() - start, received[sock])
    return closed


def _slow_upload(served: Served, headers: dict[str, str]) -> socket.socket:
    sock = connect(served.port)
    sock.sendall(upload_head(served.port, headers, content_length=1024 * 1024))  # under its limit
    sock.sendall(multipart_preamble())
    return sock


def _login_head(served: Served, length: int) -> bytes:
    return (
        "POST /ui/login HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{served.port}\r\n"
        "Content-Type: application/x-www-form-urlencoded\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _answered_408(sock):
    """The server's answer once it closed the connection a dripping client keeps open: a 408
    sent after its body timeout, within the deadline."""
    closed = _drip([sock], DEADLINE)
    assert sock in closed, f"the connection is still open after {DEADLINE} s"
    seconds, data = closed[sock]
    assert BODY_TIMEOUT - 0.5 <= seconds <= DEADLINE
    response = parse_response(data)
    assert response is not None and response.status == 408, data[:300]
    return response


def test_an_upload_sending_a_byte_every_2_s_is_answered_408_and_closed(slow: Served) -> None:
    with _slow_upload(slow, slow.new_key()) as sock:
        response = _answered_408(sock)
    assert response.json()["error"]["code"] == "request_timeout"
    assert response.headers.get("connection") == "close"


def test_twenty_slow_uploads_give_their_file_descriptors_back(slow: Served) -> None:
    headers = slow.new_key()
    before = _socket_fds(slow)
    socks = [_slow_upload(slow, headers) for _ in range(20)]
    try:
        deadline = time.monotonic() + 30
        while _socket_fds(slow) < before + 20:  # the server has accepted them all
            assert time.monotonic() < deadline, f"{_socket_fds(slow)} sockets, {before} before"
            time.sleep(0.1)
        closed = _drip(socks, DEADLINE)
        assert len(closed) == 20, f"{20 - len(closed)} of 20 still open after {DEADLINE} s"
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 30
    while (now := _socket_fds(slow)) > before:
        assert time.monotonic() < deadline, f"{now} sockets held, {before} before"
        time.sleep(0.1)


def test_a_login_sending_a_byte_every_2_s_is_answered_408_and_closed(slow: Served) -> None:
    with connect(slow.port) as sock:
        sock.sendall(_login_head(slow, 1000))
        _answered_408(sock)


def test_a_login_declaring_64_kb_is_refused_unread(slow: Served) -> None:
    with connect(slow.port) as sock:
        start = time.monotonic()
        sock.sendall(_login_head(slow, 64 * 1024))  # a form is a few hundred bytes
        # Answered at once, not after the body's deadline: nothing of it was waited for.
        response = read_response(sock, timeout=BODY_TIMEOUT)
        assert time.monotonic() - start < BODY_TIMEOUT
    assert response.status == 413, response.body[:300]
    assert response.json()["error"]["code"] == "request_too_large"


def test_a_slow_upload_that_keeps_the_minimum_rate_is_taken_whole(slow: Served) -> None:
    line = {"custom_id": "a", "body": {"model": "m", "prompt": "p" * 100}}
    content = (json.dumps(line).encode() + b"\n") * 60  # ~7 KB
    tail = f"\r\n--{BOUNDARY}--\r\n".encode()
    body = multipart_preamble() + content + tail
    with connect(slow.port) as sock:
        sock.sendall(upload_head(slow.port, slow.new_key(), content_length=len(body)))
        start = time.monotonic()
        # 2 KB a second, twice the minimum rate, for longer than the grace.
        for offset in range(0, len(body), 1024):
            sock.sendall(body[offset : offset + 1024])
            time.sleep(0.5)
        response = read_response(sock, timeout=30)
    assert time.monotonic() - start > BODY_TIMEOUT
    assert response.status == 200, response.body[:300]
    assert response.json()["bytes"] == len(content)
