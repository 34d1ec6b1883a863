"""`batchllm serve` says so when it is open to more than its keys allow: --no-auth, or an
address other machines reach."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from batchllm.cli.serve import exposure_warnings
from tests.support.serve import start_serve, stop_serve

pytestmark = pytest.mark.security


def test_serve_without_keys_warns_and_serves_one_tenant(tmp_path: Path) -> None:
    served = start_serve(tmp_path, "--no-auth")
    try:
        assert httpx.get(f"{served.base_url}/v1/files", timeout=10).status_code == 200
    finally:
        stop_serve(served)
    assert "warning: --no-auth: anyone on this machine can read" in served.log()


def test_a_server_reachable_from_other_machines_is_warned_about() -> None:
    assert exposure_warnings("127.0.0.1", no_auth=False) == []
    [open_to_all] = exposure_warnings("0.0.0.0", no_auth=False)
    assert "listening on 0.0.0.0" in open_to_all and "TLS" in open_to_all
    no_keys, _ = exposure_warnings("0.0.0.0", no_auth=True)
    assert "anyone who can reach 0.0.0.0" in no_keys
