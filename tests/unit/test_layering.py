"""The package's layers import only downwards:
cli -> api -> bench -> doctor -> worker -> engine -> output -> store -> input.

The last three are the pipeline's stages, each knowing only the ones before it: the input
(read, validate, shard) knows no SQL; the store (jobs, shards, states, leases) reads and writes
no part files; the output (the Parquet contract and the commit protocol) records its
checkpoints in the store. The top-level modules (settings, errors, storage, heap, client, demo)
sit outside the order: the foundation below every layer, or entry points above them."""

from __future__ import annotations

import ast
from pathlib import Path

import batchllm

LAYERS = [
    "cli",
    "api",
    "bench",
    "doctor",
    "worker",
    "engine",
    "output",
    "store",
    "input",
]  # each may import the ones after it
PACKAGE = Path(batchllm.__file__).parent
FOUNDATION = ["settings", "errors", "storage", "heap"]  # may import no layer


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


def test_the_foundation_imports_no_layer():
    assert {m: imported_layers(PACKAGE / f"{m}.py") for m in FOUNDATION} == {
        m: set() for m in FOUNDATION
    }


def test_the_walk_sees_every_layer_and_catches_an_upward_import(tmp_path):
    assert all(any((PACKAGE / layer).rglob("*.py")) for layer in LAYERS)
    module = tmp_path / "m.py"
    module.write_text("from batchllm.worker import runner\nimport batchllm.cli.run\n")
    assert imported_layers(module) == {"worker", "cli"}
