"""HTTP at the socket level, for what a well-behaved client (httpx, openai) never sends: bodies
streamed past limits, huge or slow headers, idle connections. And a probe of the temp space
the server process holds."""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BOUNDARY = "abuseboundary"


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def parse_response(data: bytes) -> Response | None:
    """The response in `data` once its head and its Content-Length body are all there."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    if len(rest) < length:
        return None
    return Response(status, headers, rest[:length])


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def read_response(sock: socket.socket, timeout: float = 30) -> Response:
    """Read until a whole response is there; AssertionError when the server closes first."""
    data = b""
    deadline = time.monotonic() + timeout
    while (response := parse_response(data)) is None:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a whole response: {data[:200]!r}")
        data += chunk
    return response


def closed_by_server(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closes the connection (EOF or reset), or None if it is still
    open after `timeout`. Whatever the server sends meanwhile is discarded."""
    start = time.monotonic()
    while (left := timeout - (time.monotonic() - start)) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            continue
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
    return None


def upload_head(port: int, headers: dict[str, str], *, content_length: int | None = None) -> bytes:
    """The request head of a multipart POST /v1/files: chunked unless a length is given."""
    lines = [
        "POST /v1/files HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    if content_length is None:
        lines.append("Transfer-Encoding: chunked")
    else:
        lines.append(f"Content-Length: {content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def multipart_preamble() -> bytes:
    return (
        f"--{BOUNDARY}\r\n"
        'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f"--{BOUNDARY}\r\n"
        'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()


@dataclass
class Streamed:
    response: Response | None  # None: the server closed without one
    sent: int  # body bytes the client got into its socket before the answer
    seconds: float


def stream_chunked_upload(
    port: int, headers: dict[str, str], total: int, chunk: int = 1 << 20
) -> Streamed:
    """POST a chunked multipart upload of up to `total` bytes of JSONL, stopping as soon as
    the server answers (or closes)."""
    line = b'{"custom_id": "x", "body": {"model": "m", "prompt": "' + b"a" * 200 + b'"}}\n'
    data = (line * (chunk // len(line) + 1))[:chunk]
    sock = connect(port)
    start = time.monotonic()
    sent = 0
    received = b""
    try:
        sock.sendall(upload_head(port, headers))
        first = multipart_preamble()
        while sent < total:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            piece = first + data
            first = b""
            try:
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        else:
            tail = f"\r\n--{BOUNDARY}--\r\n".encode()
            sock.sendall(f"{len(tail):x}\r\n".encode() + tail + b"\r\n0\r\n\r\n")
        response = None
        sock.settimeout(30)
        try:
            while (response := parse_response(received)) is None:
                more = sock.recv(65536)
                if not more:
                    break
                received += more
        except (ConnectionResetError, TimeoutError):
            pass
        return Streamed(response, sent, time.monotonic() - start)
    finally:
        sock.close()


@dataclass
class TempProbe:
    """The most bytes the server process held at once in files under its TMPDIR: open files
    (spooled uploads are unlinked at creation, so only /proc/PID/fd sees them) and any left in
    the directory. Polled every few milliseconds from a thread while an upload runs."""

    pid: int
    tmpdir: Path
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def held(self) -> int:
        total = 0
        seen = set()
        fd_dir = Path(f"/proc/{self.pid}/fd")
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(fd_dir / fd)
                if target.startswith(str(self.tmpdir)):
                    info = os.stat(fd_dir / fd)
                    seen.add((info.st_dev, info.st_ino))
                    total += info.st_size
            except OSError:
                continue  # closed meanwhile
        for path in self.tmpdir.rglob("*"):
            try:
                info = path.stat()
            except OSError:
                continue
            if path.is_file() and (info.st_dev, info.st_ino) not in seen:
                total += info.st_size
        return total

    def __enter__(self) -> TempProbe:
        def poll() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, self.held())
                self._stop.wait(0.005)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, self.held())
