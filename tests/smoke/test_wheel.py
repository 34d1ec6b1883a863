"""The package as a user installs it, checked inside `make test` in seconds: the wheel is built
from this checkout, its file list holds what the package needs at run time (the dashboard's
templates and static files, py.typed, the migrations' code) and its entry points (the
`batchllm` console script and vLLM's general plugin), and the console script runs from the
unpacked wheel on this venv's dependencies.

A fresh virtualenv with every dependency (scripts/smoke.sh, `make cpu-smoke`) takes minutes;
what it adds over this test is the dependency resolution, which pip does, not batchllm.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from batchllm import __version__
from tests.support.cli import REPO

# What a wheel build reads from the checkout; copied, so the build leaves no build/ or
# egg-info behind in it.
SOURCES = ("batchllm", "pyproject.toml", "README.md")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the venv's setuptools builds it, as offline as the rest of the suite.
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("batchllm-*.whl")
    return path


def package_files() -> set[str]:
    """Every file under batchllm/ in the checkout that is not Python bytecode."""
    return {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "batchllm").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_the_wheel_holds_every_package_file_templates_static_and_py_typed(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())

    assert "batchllm/py.typed" in names
    assert "batchllm/api/dashboard/templates/base.html" in names
    assert "batchllm/api/dashboard/static/dashboard.js" in names
    assert "batchllm/api/dashboard/static/dashboard.css" in names
    missing = package_files() - names
    assert not missing, f"files of batchllm/ not in the wheel: {sorted(missing)}"


def test_the_wheel_declares_the_console_script_and_the_vllm_plugin(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        points = configparser.ConfigParser()
        points.read_string(archive.read(name).decode())

    assert dict(points["console_scripts"]) == {"batchllm": "batchllm.launcher:main"}
    assert dict(points["vllm.general_plugins"]) == {
        "batchllm_parent_watch": "batchllm.process.parent_watch:register"
    }


# Run in a process whose path starts at the unpacked wheel: the entry points are loaded from
# the wheel's metadata and the package they import is the wheel's, not this checkout's.
ENTRY_POINTS = """
import importlib.metadata as md, sys
root = sys.argv[1]
(dist,) = [d for d in md.distributions(path=[root]) if d.metadata["Name"] == "batchllm"]
points = {(p.group, p.name): p for p in dist.entry_points}
plugin = points[("vllm.general_plugins", "batchllm_parent_watch")].load()
import batchllm
assert batchllm.__file__.startswith(root), batchllm.__file__
assert callable(plugin)
main = points[("console_scripts", "batchllm")].load()
sys.argv = ["batchllm", *sys.argv[2:]]
main()
"""


def test_the_console_script_of_the_unpacked_wheel_runs(wheel, tmp_path):
    root = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(root)

    def batchllm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", ENTRY_POINTS, str(root), *args],
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "HOME": str(tmp_path)},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    version = batchllm("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"batchllm, version {__version__}"
    helped = batchllm("--help")
    assert helped.returncode == 0, helped.stderr
    for command in ("run", "submit", "status", "serve", "worker", "doctor"):
        assert f"  {command} " in helped.stdout, helped.stdout
