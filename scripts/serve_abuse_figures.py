"""Measure what `batchllm serve` takes from abusive clients, at its default limits: the figures
of issue 20 (temp bytes of a refused upload, oversized headers, slow and idle connections).

    .venv/bin/python scripts/serve_abuse_figures.py

Starts its own server (private BATCHLLM_HOME and TMPDIR, SQLite, no broker) and stops it.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.security.rawhttp import (
    TempProbe,
    closed_by_server,
    connect,
    parse_response,
    read_response,
    stream_chunked_upload,
    upload_head,
)

from tests.security.conftest import start_serve, stop_serve

MB = 1 << 20


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="serve-abuse-"))
    defaults = {
        "BATCHLLM_API_MAX_FILE_BYTES": str(200 * 1024 * 1024),
        "BATCHLLM_API_MAX_STORED_BYTES": str(10 * 1024**3),
        "BATCHLLM_API_HEADER_TIMEOUT": "15",
    }
    serve = start_serve(work, **defaults)
    try:
        key = serve.new_key()
        with TempProbe(serve.proc.pid, serve.tmpdir) as probe:
            up = stream_chunked_upload(serve.port, {}, total=1024 * MB)
        status = up.response.status if up.response else "closed"
        print(
            f"unauthenticated chunked upload of up to 1 GiB: {status} after {up.seconds:.2f} s; "
            f"client got {up.sent / MB:.1f} MiB into its socket; server temp bytes "
            f"{probe.peak:,}"
        )
        with connect(serve.port) as sock, TempProbe(serve.proc.pid, serve.tmpdir) as probe:
            start = time.monotonic()
            sock.sendall(upload_head(serve.port, key, content_length=300 * MB))
            response = read_response(sock)
        print(
            f"declared 300 MiB upload with a valid key: {response.status} after "
            f"{time.monotonic() - start:.2f} s, no body sent; server temp bytes {probe.peak:,}"
        )
        with TempProbe(serve.proc.pid, serve.tmpdir) as probe:
            up = stream_chunked_upload(serve.port, key, total=300 * MB)
        status = up.response.status if up.response else "closed"
        print(
            f"chunked 300 MiB upload with a valid key (limit 200 MB): {status} after "
            f"{up.seconds:.2f} s; server temp bytes at most {probe.peak:,}"
        )

        with connect(serve.port) as sock:
            sock.sendall(
                b"GET /v1/files HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n"
            )
            print(f"64 KiB header: {read_response(sock).status}, then closed")
        rss = serve.rss_bytes()
        sent, data = 0, b""
        with connect(serve.port) as sock:
            sock.sendall(b"GET /v1/files HTTP/1.1\r\nHost: x\r\nX-Big: ")
            try:
                while sent < 64 * MB:
                    sock.sendall(b"a" * MB)
                    sent += MB
            except (BrokenPipeError, ConnectionResetError):
                pass
            sock.settimeout(5)
            try:
                while chunk := sock.recv(65536):
                    data += chunk
            except (ConnectionResetError, TimeoutError):
                pass
        answer = parse_response(data)
        print(
            f"64 MiB header: {answer.status if answer else 'closed'}; client got "
            f"{sent / MB:.0f} MiB into its socket before the close; server RSS "
            f"{rss / MB:.0f} -> {serve.rss_bytes() / MB:.0f} MiB"
        )

        with connect(serve.port) as sock:
            start = time.monotonic()
            dropped = None
            worst = 0.0
            for byte in b"GET /v1/files HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                try:
                    sock.send(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    dropped = time.monotonic() - start
                    break
                began = time.monotonic()
                httpx.get(f"{serve.base_url}/health", timeout=10).raise_for_status()
                worst = max(worst, time.monotonic() - began)
                if closed_by_server(sock, timeout=2.0) is not None:
                    dropped = time.monotonic() - start
                    break
        print(
            f"slow client (one header byte every 2 s): dropped after {dropped:.1f} s; "
            f"/health meanwhile answered in at most {worst * 1000:.0f} ms"
        )
        with connect(serve.port) as sock:
            idle = closed_by_server(sock, timeout=60)
        print(f"idle connection: dropped after {idle:.1f} s")
    finally:
        stop_serve(serve)


if __name__ == "__main__":
    main()
