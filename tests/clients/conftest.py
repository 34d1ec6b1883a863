"""The third-party OpenAI Batch clients' suite: `make test-clients` runs it in its own venv
(.venv-clients: batchllm from this repo with its `api` extra, and the clients pinned in
tests/clients/requirements.txt), never inside `make test`.

Two guards keep it out of the main suite: its tests carry the `clients` marker, which
pyproject.toml's default `-m` deselects (`make test-clients` passes `-m clients`), and where
the client libraries are not installed (the project's .venv) its test modules are not even
collected, so the main venv needs none of them.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from tests.support.client_batches import ClientServer, client_server

# The import names of tests/clients/requirements.txt's clients.
CLIENT_LIBRARIES = ("litellm", "batch_openai", "openai_batch")

if any(importlib.util.find_spec(name) is None for name in CLIENT_LIBRARIES):
    collect_ignore_glob = ["test_*.py"]

# LiteLLM fetches its model price list from the web when imported; this machine reaches no
# such host, and the copy it ships is what an offline user gets (the variable is LiteLLM's own).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def pytest_configure(config: pytest.Config) -> None:
    # LiteLLM's own types warn through pydantic on import: noise, not this suite's subject.
    config.addinivalue_line("filterwarnings", "ignore:.*ReadOnly. qualifier:UserWarning:pydantic")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here + os.sep):
            item.add_marker(pytest.mark.clients)


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClientServer]:
    """One private `batchllm serve` and instant worker for every client of the session."""
    with client_server(tmp_path_factory.mktemp("clients")) as server:
        yield server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    server = item.funcargs.get("served") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(server, ClientServer):
        report.sections.append(("serve and worker logs (tail)", server.logs()))
