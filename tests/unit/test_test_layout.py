"""The test tree's own rule: pytest imports test modules by basename (no packages under tests/),
so two files of one name in different folders break collection of whichever comes second -
only when both are in one session, which `make test`'s two sessions can hide."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_name_no_other_folder_uses():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
