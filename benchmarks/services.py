"""The private services' old address, kept for the chaos harness (benchmarks/chaos*.py) until
it imports batchllm/process/services.py: their home now, since the fault suite's
tests/support/ starts them too and must not import benchmarks/."""

from __future__ import annotations

from batchllm.process.services import PostgresCluster, RedisServer, ServiceFailed, tail

__all__ = ["PostgresCluster", "RedisServer", "ServiceFailed", "tail"]
