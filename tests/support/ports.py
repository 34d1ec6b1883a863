"""The one way the suites pick a port for a server they start."""

from __future__ import annotations

import socket

HOST = "127.0.0.1"
# The machine's own services: a private server must never take (or be mistaken for) them.
MACHINE_PORTS = frozenset({5432, 6379})


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the OS picks it), never one of the machine's."""
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port not in MACHINE_PORTS:
            return port
