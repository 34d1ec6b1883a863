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


def _tests_imports(path: Path) -> list[str]:
    """The `tests.*` modules a file imports, at any depth (function-level imports too), and
    test modules or conftests imported by their bare name (pytest puts each test folder on
    sys.path, so `from test_runner import x` works, and runs that module's fixtures twice)."""
    import ast

    bare = {p.stem for p in TESTS.rglob("*.py") if p.stem.startswith("test_")} | {"conftest"}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [
            name
            for name in names
            if name == "tests" or name.startswith("tests.") or name.split(".")[0] in bare
        ]
    return found


def test_test_files_share_code_only_through_tests_support():
    # A test module or conftest imported by another runs its fixtures and hooks twice and ties
    # two suites together; what suites share lives in tests/support.
    offenders = {
        str(path.relative_to(TESTS)): bad
        for path in TESTS.rglob("*.py")
        if (
            bad := [
                name
                for name in _tests_imports(path)
                if name != "tests.support" and not name.startswith("tests.support.")
            ]
        )
    }
    assert offenders == {}


def test_the_walk_catches_a_test_module_imported_by_its_bare_name(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from test_test_layout import TESTS\nimport conftest\nfrom tests.support import cli\n"
    )
    assert _tests_imports(module) == ["test_test_layout", "conftest", "tests.support"]
