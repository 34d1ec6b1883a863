"""Where vLLM's engine core runs (engine/start_settings.py): in the owning process for a
one-device CPU engine, in vLLM's own process elsewhere, and as the user said when they did."""

from __future__ import annotations

import pytest

from batchllm.engine import start_settings
from batchllm.engine.start_settings import engine_core_in_process

VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setattr(start_settings, "_set_here", False)
    return monkeypatch


def test_a_one_device_cpu_engine_runs_its_core_in_process(unset) -> None:
    import os

    assert engine_core_in_process(1, is_cpu=True) is True
    assert os.environ[VAR] == "0"
    # A later engine of this process on several devices gets vLLM's processes back: the
    # variable was set here, not by the user.
    assert engine_core_in_process(2, is_cpu=True) is False
    assert os.environ[VAR] == "1"


def test_a_gpu_engine_keeps_vllms_engine_core_process(unset) -> None:
    assert engine_core_in_process(1, is_cpu=False) is False


@pytest.mark.parametrize("value, in_process", [("1", False), ("0", True), ("false", True)])
def test_the_users_choice_wins(unset, value: str, in_process: bool) -> None:
    import os

    unset.setenv(VAR, value)
    assert engine_core_in_process(1, is_cpu=True) is in_process
    assert engine_core_in_process(1, is_cpu=False) is in_process
    assert os.environ[VAR] == value
