"""The one way the suites pick a port for a server they start: the package's own
(batchllm/process/ports.py), which never picks one of the machine's own services."""

from __future__ import annotations

import socket

from batchllm.process.ports import HOST, MACHINE_PORTS, free_port

__all__ = ["HOST", "MACHINE_PORTS", "closed_port", "free_port"]


def closed_port() -> int:
    """A port nothing listens on (bound once by us, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
