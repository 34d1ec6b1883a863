"""The third-party clients' suite (tests/clients, `make test-clients`): a private `batchllm
serve` with one paced instant-engine worker behind it, the batches each client sends, and the
checks of what it got back. The clients themselves are driven in tests/clients as their users
drive them; nothing here imports one.

The server: SQLite in a tmp home (the server and the worker are the only processes on it), an
empty database of the machine's Redis as the broker, the demo model's tokenizer (no weights:
the instant engine needs only its tokenizer and chat template), one API key.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.execution.stand_in_engines import instant_text
from tests.support.fleet import (
    PACED_INSTANT_ARGS,
    WORKER_SETTINGS,
    FleetEnv,
    Worker,
    fleet_env_vars,
    settings_of,
    stop_workers,
)
from tests.support.serve import CHAT, Server, chat_line, create_key
from tests.support.services import redis_database

# A batch that the worker finishes in about a second: 20 lines of 4 to 11 tokens each.
SMALL_LINES = 20
# A batch that runs long enough to be cancelled part-way, whatever the machine: the paced
# instant engine gives each of at most 256 running requests one token every 20 ms, so 3,000
# lines of 64 tokens take 12 waves of ~1.3 s (~16 s); the cancel comes within a second.
BIG_LINES = 3_000
BIG_TOKENS = 64
RECONCILE_SECONDS = "2"
# Each client polls at its own interval; the batches end in seconds, the deadlines are generous
# for a busy 2-core machine.
POLL_SECONDS = 0.5
DEADLINE_SECONDS = 180.0


@dataclass
class ClientServer:
    """What a client is pointed at: the base URL (`.../v1`, as OpenAI's), a key, the model."""

    base_url: str
    api_key: str
    model: str
    server: Server
    worker: Worker

    def logs(self) -> str:
        return (
            f"\n--- serve log (tail) ---\n{self.server.tail()}"
            f"\n--- worker log (tail) ---\n{self.worker.tail()}"
        )


@contextmanager
def client_server(root: Path) -> Iterator[ClientServer]:
    """A `batchllm serve` and one paced instant worker on a private SQLite home and Redis
    database, for the length of the block."""
    from batchllm.engine.models.demo_model import build_demo_tokenizer
    from batchllm.store.db import get_engine, upgrade

    model = str(build_demo_tokenizer(root / "model"))
    with redis_database(uuid.uuid4().hex[:12]) as (broker, broker_url):
        database_url = f"sqlite:///{root / 'batchllm.db'}"
        upgrade(database_url)
        env = fleet_env_vars(
            root=root,
            database_url=database_url,
            broker_url=broker_url,
            worker_settings={**WORKER_SETTINGS, "BATCHLLM_RECONCILE_SECONDS": RECONCILE_SECONDS},
        )
        fleet_env = FleetEnv(settings=settings_of(env), env=env, redis=broker)
        key = create_key(fleet_env, "clients")
        worker = Worker(
            "clients@test",
            model=Path(model),
            env=env,
            log_path=root / "worker.log",
            engine_args=PACED_INSTANT_ARGS,
        )
        server = Server(env, root / "serve.log")
        try:
            server.wait_healthy()
            worker.wait_ready(240)
            yield ClientServer(f"{server.base_url}/v1", key, model, server, worker)
        finally:
            server.stop()
            stop_workers([worker])
            get_engine(fleet_env.settings).dispose()


# -- the batches -------------------------------------------------------------------------------


def small_tokens(i: int) -> int:
    return 4 + i % 8


def small_batch(model: str, prefix: str) -> list[dict[str, Any]]:
    return [
        chat_line(model, f"{prefix}-{i}", max_tokens=small_tokens(i)) for i in range(SMALL_LINES)
    ]


def big_batch(model: str, prefix: str) -> list[dict[str, Any]]:
    return [chat_line(model, f"{prefix}-{i}", max_tokens=BIG_TOKENS) for i in range(BIG_LINES)]


def write_jsonl(path: Path, requests: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(request) + "\n" for request in requests))
    return path


# -- the checks --------------------------------------------------------------------------------


def answers_of(output: str) -> dict[str, str]:
    """custom_id -> the answer's text, from an output file's JSONL as OpenAI writes it; each
    line a 200 with a chat completion and no error."""
    answers: dict[str, str] = {}
    for text in output.splitlines():
        line = json.loads(text)
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and len(body["choices"]) == 1, line
        assert line["custom_id"] not in answers, f"{line['custom_id']} answered twice"
        answers[line["custom_id"]] = body["choices"][0]["message"]["content"]
    return answers


def assert_every_line_answered(
    answers: dict[str, str | None], requests: list[dict[str, Any]]
) -> None:
    """Every request answered once, with the text the instant engine gives its max_tokens."""
    expected = {r["custom_id"]: instant_text(r["body"]["max_tokens"]) for r in requests}
    assert sorted(answers) == sorted(expected)
    wrong = {cid: text for cid, text in answers.items() if text != expected[cid]}
    assert not wrong, f"{len(wrong)} answers are not the instant engine's: {wrong}"


def assert_cancelled_part_way(
    status: str, completed: int, failed: int, total: int, lines: int = BIG_LINES
) -> None:
    """A cancelled batch as batchllm ends one: every line counted, as done or as never run
    (the error file holds those), and the cancel came before the end."""
    assert status == "cancelled", status
    assert total == lines and completed + failed == total, (completed, failed, total)
    assert failed > 0, f"the cancel came after all {total} lines were done"
