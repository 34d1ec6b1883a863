"""The package's layers import only downwards:
cli -> pipeline -> client -> api -> bench -> doctor -> jobs -> kept_engine -> worker -> execution
-> engine -> output -> store -> input.

pipeline.py (`batchllm pipeline`'s stages) and client.py (the Python API, which the CLI's job
commands call too) are modules, not folders: entry points below the CLI, above the job's front
doors.

jobs is a job's front doors (submit to the fleet, run locally, retry, estimate); worker the
Celery fleet; execution running a shard through an engine, in a worker or in `run`.

The last three are the pipeline's stages, each knowing only the ones before it: the input
(read, validate, shard) knows no SQL; the store (jobs, shards, states, leases) reads and writes
no part files; the output (the Parquet contract and the commit protocol) records its
checkpoints in the store. The top-level modules (settings, errors, storage, heap, the
process/ plumbing, demo) sit outside the order: the foundation below every layer, or
entry points above them.

input/ is in layers of its own: its top-level modules (the stored input) -> validation -> parsing
-> images -> files -> formats."""

from __future__ import annotations

import ast
from pathlib import Path

import batchllm

LAYERS = [
    "cli",
    "pipeline",
    "client",
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
FOUNDATION = [
    "settings",
    "errors",
    "storage",
    "heap",
    "external_sort",
    "row_errors",
    "spec",
    "process",
]  # may import no layer


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
        for path in _foundation_files(layer):
            for other in imported_layers(path) - allowed:
                upward.append(f"{path.relative_to(PACKAGE)} imports batchllm.{other}")
    assert upward == []


def _foundation_files(name: str) -> list[Path]:
    """The modules of a folder `name`, or the module `name`.py."""
    folder = PACKAGE / name
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{name}.py"]


def test_the_foundation_imports_no_layer():
    assert {
        m: set().union(*(imported_layers(f) for f in _foundation_files(m))) for m in FOUNDATION
    } == {m: set() for m in FOUNDATION}


def test_the_walk_sees_every_layer_and_catches_an_upward_import(tmp_path):
    assert all(
        files and all(f.is_file() for f in files)
        for files in (_foundation_files(layer) for layer in LAYERS)
    )
    module = tmp_path / "m.py"
    module.write_text(
        "from batchllm.execution import runner\nimport batchllm.cli.run\n"
        "from batchllm.client import Client\n"
    )
    assert imported_layers(module) == {"execution", "cli", "client"}


# -- sizes and cycles: what a newcomer can hold in their head -----------------------------------

MAX_MODULES_PER_FOLDER = 15
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# Click option lists: one decorator per flag, read as a table rather than as logic.
OPTION_LISTS = {"cli/options.py:job_options"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_folder_module_and_function_stays_small():
    folders = {
        str(d.relative_to(PACKAGE)): n
        for d in {m.parent for m in _modules()}
        if (n := len([m for m in d.glob("*.py") if m.name != "__init__.py"]))
        > MAX_MODULES_PER_FOLDER
    }
    long_modules = {
        str(m.relative_to(PACKAGE)): n
        for m in _modules()
        if (n := len(m.read_text().splitlines())) > MAX_MODULE_LINES
    }
    long_functions = {}
    for m in _modules():
        for node in ast.walk(ast.parse(m.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{m.relative_to(PACKAGE)}:{node.name}"
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES and name not in OPTION_LISTS:
                    long_functions[name] = length
    assert (folders, long_modules, long_functions) == ({}, {}, {})


def _module_name(path: Path) -> str:
    parts = ["batchllm", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Which package modules each module imports (at any depth, function-level too; an import
    of a package's own __init__ by its modules is left out: re-exports, not a dependency)."""
    names = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a loop."""
    reach = {m: set() for m in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in reach[start]:
                reach[start].add(m)
                todo.extend(graph.get(m, ()))
    groups = {frozenset({m} | {o for o in reach[m] if m in reach[o]}) for m in graph}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def test_no_module_imports_itself_around_a_loop():
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- input/'s own layers ---------------------------------------------------------------------

# input/'s top-level modules (the stored input: shards, token ids, adapters, a job's spec) first,
# then its folders; each may import the ones after it. A lazy import inside a function counts.
INPUT_LAYERS = ["", "validation", "parsing", "images", "files", "formats"]


def _input_layer(module: str) -> str:
    """The sub-layer of a module of batchllm.input ("" for input/'s top-level modules)."""
    parts = module.split(".")[2:]
    return parts[0] if parts and parts[0] in INPUT_LAYERS else ""


def upward_in_input(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for module, targets in graph.items():
        if not module.startswith("batchllm.input"):
            continue
        rank = INPUT_LAYERS.index(_input_layer(module))
        for target in sorted(targets):
            if target.startswith("batchllm.input") and (
                INPUT_LAYERS.index(_input_layer(target)) < rank
            ):
                upward.append(f"{module} imports {target}")
    return upward


def test_no_module_of_input_imports_a_sub_layer_above_its_own():
    folders = {d.name for d in (PACKAGE / "input").iterdir() if (d / "__init__.py").is_file()}
    assert folders == set(INPUT_LAYERS) - {""}  # a new folder must take its place in the order
    assert upward_in_input(import_graph()) == []
    fake = {
        "batchllm.input.parsing.line": {"batchllm.input.formats.rows"},
        "batchllm.input.files.lines": {"batchllm.input.validation.validate"},
        "batchllm.input.formats.rows": {"batchllm.input.shards"},
    }
    assert upward_in_input(fake) == [
        "batchllm.input.files.lines imports batchllm.input.validation.validate",
        "batchllm.input.formats.rows imports batchllm.input.shards",
    ]


# -- the input resolved once, at the front doors ------------------------------------------------

# Where a job's input comes in: the CLI, the Batch API, the Python API and its pipeline files,
# and `batchllm bench`, which writes its own workload files and runs them as jobs. Everything
# below them (jobs/, input/, ...) takes the InputSource they resolved (input/files/source.py).
FRONT_DOORS = ["cli", "api", "bench", "client", "pipeline"]
INPUT_RESOLVED_IN = "input/files/source.py"


def resolves_input(path: Path) -> bool:
    """Whether the module imports or calls `resolve_input` (an alias or a lazy import too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and any(a.name == "resolve_input" for a in node.names):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "resolve_input":
            return True
        if isinstance(node, ast.Name) and node.id == "resolve_input":
            return True
    return False


def test_only_the_front_doors_resolve_a_jobs_input(tmp_path):
    doors = [m for name in FRONT_DOORS for m in _foundation_files(name)]
    below = [
        str(m.relative_to(PACKAGE))
        for m in _modules()
        if m not in doors and str(m.relative_to(PACKAGE)) != INPUT_RESOLVED_IN and resolves_input(m)
    ]
    assert below == []
    assert {str(m.relative_to(PACKAGE)) for m in doors if resolves_input(m)} >= {
        "cli/options.py",
        "client.py",
        "api/batches_routes.py",
    }
    module = tmp_path / "m.py"
    module.write_text(
        "def f(p):\n    from batchllm.input.files import source\n    source.resolve_input(p)\n"
    )
    assert resolves_input(module)
