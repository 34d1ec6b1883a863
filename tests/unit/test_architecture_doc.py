"""docs/architecture.md names every module of the package and of benchmarks/, so the map a
newcomer reads first cannot fall behind the code."""

from __future__ import annotations

import importlib
import re
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


def _named_in_concepts() -> list[str]:
    """The `folder/module.name` and `module.Class.name` references of the doc's "Where a concept
    lives" section, and the state machine's transitions it lists."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc.split("## Where a concept lives", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"`([a-z_/]+\.[A-Za-z_.]+)`", section)
    names = [n for n in names if not n.endswith(".py")]
    transitions = re.search(r"named transitions such as(.*?)\)", section, re.DOTALL)
    assert transitions is not None
    names += [f"store/state_machine.{t}" for t in re.findall(r"`(\w+)`", transitions.group(1))]
    return names


def _resolves(reference: str) -> bool:
    module_path, _, attributes = reference.partition(".")
    try:
        target: object = importlib.import_module("batchllm." + module_path.replace("/", "."))
    except ModuleNotFoundError:
        return False
    for attribute in attributes.split("."):
        if not hasattr(target, attribute):
            return False
        target = getattr(target, attribute)
    return True


def test_every_function_and_transition_the_doc_names_exists():
    named = _named_in_concepts()
    assert len(named) > 15 and "store/state_machine.start_job" in named
    assert [name for name in named if not _resolves(name)] == []
    assert not _resolves("store/state_machine.queue_job")  # the check can fail


def _row_path_block() -> str:
    doc = (REPO / "docs" / "architecture.md").read_text()
    section = doc.split("## A row's path", 1)[1].split("\n## ", 1)[0]
    return section.split("```text", 1)[1].split("```", 1)[0]


def test_the_row_path_names_modules_and_functions_that_exist():
    """The diagram's modules exist, and the names it gives each step are that module's."""
    block = _row_path_block()
    paths = re.findall(r"\b((?:[a-z_]+/)*[a-z_]+\.py)\b", block)
    assert len(paths) >= 15
    assert [p for p in paths if not (REPO / "batchllm" / p).is_file()] == []
    named = {
        "input/validation/validate.py": "read_row_chunks",
        "input/shards.py": "store_input",
        "execution/runner.py": "ShardRunner",
        "output/parts.py": "OutputBuffer",
        "output/commit.py": "commit_part",
    }
    for path, name in named.items():
        assert f"{path}" in block and name in block
        module = importlib.import_module("batchllm." + path.removesuffix(".py").replace("/", "."))
        assert hasattr(module, name), (path, name)
