"""Fixtures the unit tests of the CLI share: a one-line prompt file and a model directory
(empty: nothing loads it before the engine would)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.homes import seed_home


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n')
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's tokenizer and config without its weights (built in ~1 s, no torch):
    no unit test runs an engine, and sizing, validation and tokenization read only these.
    Overrides tests/conftest.py's whole model for the unit tests."""
    from batchllm.engine.models.demo_model import build_demo_tokenizer

    return build_demo_tokenizer(tmp_path_factory.mktemp("model") / "tiny-tokenizer")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def _own_home(tmp_path_factory, monkeypatch, migrated_database) -> None:
    """No unit test reads or migrates the developer's ~/.batchllm: code that falls back to the
    default settings (a Celery task, a CLI command) gets a fresh home instead. A test that sets
    BATCHLLM_HOME itself (the `settings` fixture) overrides this."""
    home = seed_home(tmp_path_factory.mktemp("home"), migrated_database)
    monkeypatch.setenv("BATCHLLM_HOME", str(home))
