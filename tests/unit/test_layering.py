"""The package's layers import only downwards:
cli -> api -> bench -> doctor -> jobs -> kept_engine -> worker -> execution -> engine -> output
-> store -> input.

jobs is a job's front doors (submit to the fleet, run locally, retry, estimate); worker the
Celery fleet; execution running a shard through an engine, in a worker or in `run`.

The last three are the pipeline's stages, each knowing only the ones before it: the input
(read, validate, shard) knows no SQL; the store (jobs, shards, states, leases) reads and writes
no part files; the output (the Parquet contract and the commit protocol) records its
checkpoints in the store. The top-level modules (settings, errors, storage, heap, the
process/ plumbing, client, demo) sit outside the order: the foundation below every layer, or
entry points above them."""

from __future__ import annotations

import ast
from pathlib import Path

import batchllm

LAYERS = [
    "cli",
    "api",
    "bench",
    "doctor",
    "jobs",
    "kept_engine",
    "worker",
    "execution",
    "engine",
    "output",
    "store",
    "input",
]  # each may import the ones after it
PACKAGE = Path(batchllm.__file__).parent
FOUNDATION = ["settings", "errors", "storage", "heap", "process"]  # may import no layer


def imported_layers(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "batchllm" and len(parts) > 1 and parts[1] in LAYERS:
                found.add(parts[1])
    return found


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for rank, layer in enumerate(LAYERS):
        allowed = set(LAYERS[rank:])
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for other in imported_layers(path) - allowed:
                upward.append(f"{path.relative_to(PACKAGE)} imports batchllm.{other}")
    assert upward == []


def _foundation_files(name: str) -> list[Path]:
    folder = PACKAGE / name
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{name}.py"]


def test_the_foundation_imports_no_layer():
    assert {
        m: set().union(*(imported_layers(f) for f in _foundation_files(m))) for m in FOUNDATION
    } == {m: set() for m in FOUNDATION}


def test_the_walk_sees_every_layer_and_catches_an_upward_import(tmp_path):
    assert all(any((PACKAGE / layer).rglob("*.py")) for layer in LAYERS)
    module = tmp_path / "m.py"
    module.write_text("from batchllm.execution import runner\nimport batchllm.cli.run\n")
    assert imported_layers(module) == {"execution", "cli"}
