"""Tokens as the unit of admission: a batch's prompt tokens estimated at create, the key's
enqueued tokens per model against its limit (OpenAI's `token_limit_exceeded`: the batch is
created failed, with the numbers), released as rows finish and when the batch ends, shown in
headers; in process (FastAPI's TestClient, SQLite, the in-memory broker: no worker runs, so an
accepted batch's tokens stay enqueued)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

from batchllm.api import enqueued, keys
from batchllm.api.app import create_app
from batchllm.settings import Settings
from batchllm.store.db import session_scope
from batchllm.store.models import Job, job_id_of

pytest.importorskip("fastapi.testclient")
pytest.importorskip("openai.types")
from fastapi.testclient import TestClient
from openai.types import Batch

from tests.support.serve import post_batch

CHAT = "/v1/chat/completions"
# A line asking "hi" as the user: "hi" 1 token, "user" 1, the message's 3: 5 tokens a line.
LINE_TOKENS = 5


# -- the estimate ------------------------------------------------------------------------------


def test_a_chat_lines_estimate_counts_its_texts_by_four_bytes_and_each_message():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You answer in one word."},  # 23 bytes: 6 tokens
            {"role": "user", "content": "hi"},
        ],
        "max_tokens": 400,  # not prompt
        "temperature": 0.5,
    }
    # system 2 + 6 + 3, user 1 + 1 + 3
    assert enqueued.estimate_prompt_tokens(body) == 11 + 5


def test_images_cost_a_fixed_price_not_their_bytes_and_token_ids_count_one_each():
    image = "data:image/png;base64," + "A" * 40_000
    chat = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is it?"},  # "text" 1, "what is it?" 3
                    {"type": "image_url", "image_url": {"url": image}},  # "image_url" 3, 85
                ],
            }
        ]
    }
    # the message 3, "user" 1, the text part 1 + 3, the image part 3 + 85
    assert enqueued.estimate_prompt_tokens(chat) == 3 + 1 + (1 + 3) + (3 + 85)
    assert enqueued.estimate_prompt_tokens({"prompt": [101, 102, 103]}) == 3
    assert enqueued.estimate_prompt_tokens({"input": ["abcdefgh", "abc"]}) == 2 + 1
    # Three-byte characters: about a token each, as BPE vocabularies cut them.
    assert enqueued.estimate_prompt_tokens({"prompt": "日本語の文章"}) == 5
    assert enqueued.estimate_prompt_tokens("not a body") == 0


def test_tool_definitions_and_instructions_count_as_prompt():
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    assert enqueued.estimate_prompt_tokens({"input": "hi", "tools": tools}) > 1
    assert enqueued.estimate_prompt_tokens({"input": "hi", "instructions": "a" * 40}) == 11


# -- the limit through the API -----------------------------------------------------------------


@pytest.fixture
def api_settings(tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path / "home",
        database_url=f"sqlite:///{tmp_path / 'batchllm.db'}",
        storage=str(tmp_path / "storage"),
        broker_url="memory://",
        served_models=["tiny", "other"],  # the models these batches name (no worker runs)
        # 3 batches of 4 lines fit: 3 * 4 * 5 = 60 tokens
        api_max_enqueued_tokens=3 * 4 * LINE_TOKENS,
    )


def _key(settings: Settings, name: str) -> tuple[str, dict[str, str]]:
    with session_scope(settings) as session:
        row, key = keys.create_key(session, name)
        return row.id, {"Authorization": f"Bearer {key}"}


def _line(custom_id: str, model: str) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    line = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}
    return json.dumps(line).encode() + b"\n"


def _create(client: TestClient, headers: dict[str, str], lines: int, model: str = "tiny") -> Any:
    content = b"".join(_line(f"q{i}", model) for i in range(lines))
    return post_batch(client, content, headers=headers, filename="in.jsonl")


def test_a_batch_over_its_keys_enqueued_tokens_fails_as_openais_and_another_key_is_unaffected(
    api_settings: Settings,
) -> None:
    client = TestClient(create_app(api_settings, auth=True))
    _, alice = _key(api_settings, "alice")
    _, bob = _key(api_settings, "bob")

    created = [_create(client, alice, 4) for _ in range(3)]
    assert [r.status_code for r in created] == [200] * 3
    assert created[-1].headers["x-batchllm-enqueued-tokens"] == "60"
    assert created[-1].headers["x-batchllm-enqueued-tokens-limit"] == "60"

    over = _create(client, alice, 4)
    # As OpenAI: the batch is created, and failed with the error and the numbers.
    assert over.status_code == 200, over.text
    batch = Batch.model_validate(over.json())
    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data is not None
    (error,) = batch.errors.data
    assert error.code == "token_limit_exceeded"
    assert error.message is not None
    assert error.message.startswith(
        "Enqueued token limit reached for tiny for this API key. Limit: 60 enqueued tokens."
    )
    assert "This batch's 20 prompt tokens (estimated) and the 60 already enqueued" in (
        error.message
    )
    # Another model has a limit of its own, and another key is not held back by alice.
    assert Batch.model_validate(_create(client, alice, 4, "other").json()).status != "failed"
    assert Batch.model_validate(_create(client, bob, 12).json()).status == "in_progress"

    listed = client.get("/v1/batches", headers=alice)
    assert json.loads(listed.headers["x-batchllm-enqueued-tokens"]) == {"other": 20, "tiny": 60}
    assert listed.headers["x-batchllm-enqueued-tokens-limit"] == "60"
    # The line quota stands beside it: the failed batch's lines are not enqueued either.
    assert listed.headers["x-batchllm-enqueued-rows"] == str(4 * 4)

    # The tokens come back when a batch ends: cancelled (no worker ran it), its 20 are free.
    first = created[0].json()["id"]
    assert client.post(f"/v1/batches/{first}/cancel", headers=alice).status_code == 200
    tokens = client.get("/v1/batches", headers=alice).headers["x-batchllm-enqueued-tokens"]
    assert json.loads(tokens) == {"other": 20, "tiny": 40}
    assert Batch.model_validate(_create(client, alice, 4).json()).status == "in_progress"


def test_a_batchs_tokens_are_released_as_its_rows_finish(api_settings: Settings) -> None:
    client = TestClient(create_app(api_settings, auth=True))
    owner, alice = _key(api_settings, "alice")
    batch_id = _create(client, alice, 4).json()["id"]
    with session_scope(api_settings) as session:
        assert session.get(Job, job_id_of(batch_id)).prompt_tokens_estimate == 20
        # 3 of its 4 lines done (one failed): a quarter of its estimate is still reserved.
        session.execute(
            update(Job)
            .where(Job.id == job_id_of(batch_id))
            .values(request_completed=2, request_failed=1)
        )
    with session_scope(api_settings) as session:
        assert enqueued.enqueued_tokens(session, owner, "tiny") == 5
        assert enqueued.enqueued_tokens_by_model(session, owner) == {"tiny": 5}


def test_a_keys_own_limit_overrides_the_servers(api_settings: Settings) -> None:
    client = TestClient(create_app(api_settings, auth=True))
    _, alice = _key(api_settings, "alice")
    with session_scope(api_settings) as session:
        keys.set_limits(session, "alice", enqueued_tokens=25)
    assert Batch.model_validate(_create(client, alice, 4).json()).status == "in_progress"
    refused = Batch.model_validate(_create(client, alice, 2).json())
    assert refused.status == "failed"
    assert refused.errors is not None and refused.errors.data is not None
    assert "Limit: 25 enqueued tokens" in (refused.errors.data[0].message or "")
    listed = client.get("/v1/batches", headers=alice)
    assert listed.headers["x-batchllm-enqueued-tokens-limit"] == "25"


def test_a_batch_found_over_the_limit_when_recorded_is_failed_and_leaves_no_task(
    api_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race concurrent creates run: the early check saw room, the count under the lock
    (api/batches.record_batch) does not. The batch is recorded failed as an early refusal is
    (no lines, no files: the job made for it dropped before any task went out), and it
    reserves nothing."""
    client = TestClient(create_app(api_settings, auth=True))
    owner, alice = _key(api_settings, "alice")
    for _ in range(3):
        assert _create(client, alice, 4).status_code == 200
    real = enqueued.over_token_limit
    calls: list[int] = []

    def room_at_first(*args: Any) -> Any:
        calls.append(1)
        return None if len(calls) == 1 else real(*args)  # the early check, then the locked one

    monkeypatch.setattr(enqueued, "over_token_limit", room_at_first)
    late = _create(client, alice, 4)
    assert late.status_code == 200, late.text
    batch = Batch.model_validate(late.json())
    assert batch.status == "failed" and len(calls) == 2
    assert batch.errors is not None and batch.errors.data is not None
    assert [e.code for e in batch.errors.data] == ["token_limit_exceeded"]
    assert (batch.request_counts is not None and batch.request_counts.total) == 0
    assert (batch.output_file_id, batch.error_file_id) == (None, None)
    with session_scope(api_settings) as session:
        job = session.get(Job, job_id_of(batch.id))
        assert job.error is not None and job.error.startswith("Enqueued token limit reached")
        assert job.shards == []
        assert session.scalar(select(func.count()).select_from(Job)) == 4  # 3 ran, 1 failed
        assert enqueued.enqueued_tokens(session, owner, "tiny") == 60
