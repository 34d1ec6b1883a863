"""The one way the suites pick a port for a server they start: the package's own
(batchllm/process/ports.py), which never picks one of the machine's own services."""

from __future__ import annotations

from batchllm.process.ports import HOST, MACHINE_PORTS, free_port

__all__ = ["HOST", "MACHINE_PORTS", "free_port"]
