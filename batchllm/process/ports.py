"""Picking a free local port for a server a process starts (the bench's, the test suites')."""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
# The machine's own services: a private server must never take (or be mistaken for) them.
MACHINE_PORTS = frozenset({5432, 6379})


def free_port() -> int:
    """A port free on 127.0.0.1 right now, never one of the machine's, and below the kernel's
    ephemeral range: a port the OS hands out (bind to 0) is one every outgoing connection may
    take too, and between this check and the server's own bind one did (a serve's "address
    already in use" with three test sessions at once). Below that range only another explicit
    bind can take it, and the pick is random over thousands of ports."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(20_000, low)
        if port in MACHINE_PORTS:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        return port
    while True:  # the range is crowded: the OS's pick, as before
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in MACHINE_PORTS:
            return port


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768  # Linux's default
    return max(low, 20_001)
