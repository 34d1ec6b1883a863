"""docs/architecture.md names every module of the package and of benchmarks/, so the map a
newcomer reads first cannot fall behind the code."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _modules() -> list[str]:
    names = [
        str(path.relative_to(REPO / "batchllm"))
        for path in (REPO / "batchllm").rglob("*.py")
        if path.name != "__init__.py"
    ]
    names += [
        str(path.relative_to(REPO))
        for path in (REPO / "benchmarks").rglob("*.py")
        if path.name != "__init__.py"
    ]
    return sorted(names)


def test_every_module_is_named_in_the_architecture_doc():
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert len(_modules()) > 100
    assert [name for name in _modules() if f"`{name}`" not in doc] == []
