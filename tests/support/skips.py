"""A real dependency that is missing: a skip on a developer's machine, a failure under CI, so
CI can never pass by skipping."""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, reason: str) -> None:
    """Skip when a real dependency is missing, except under CI where that is a failure."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required under CI: {reason}")
    pytest.skip(reason)
