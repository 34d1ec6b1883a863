"""The abuse suite's server: a real `batchllm serve` process on a free port, with a private
BATCHLLM_HOME (SQLite), a private TMPDIR and the in-memory broker (tests/support/serve.py's
`start_serve`); the module shares one server, each test has its own API keys (tenants).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.serve import Served, start_serve, stop_serve


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_serve(tmp_path_factory.mktemp("serve"))
    try:
        yield served
    finally:
        stop_serve(served)
