"""Which models `POST /v1/batches` accepts (api/served.py), as OpenAI's `model_not_found`: a
model no worker serves, none served lately and no configuration lists is refused at create,
naming the models served and how an operator adds one; a configured model with no worker is
accepted and waits; a live worker's model, and one whose workers were scaled to zero within the
retention, are accepted. In process (TestClient, SQLite) on a private database of the local
Redis: the registry is the one workers write (worker/registry.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from openai.types import Batch

from batchllm.api import keys
from batchllm.api.app import create_app
from batchllm.settings import Settings
from batchllm.store.db import get_engine, session_scope
from batchllm.store.models import Job, job_id_of
from batchllm.store.states import JobStatus, ShardStatus
from batchllm.worker import registry
from batchllm.worker.redis_broker import worker_key
from tests.support.serve import post_batch
from tests.support.services import redis_database

CHAT = "/v1/chat/completions"


@pytest.fixture
def broker() -> Iterator[tuple[redis.Redis, str]]:
    with redis_database(uuid.uuid4().hex[:12]) as found:
        yield found


@pytest.fixture
def fleet_settings(settings: Settings, broker: tuple[redis.Redis, str]) -> Settings:
    get_engine(settings)
    return settings.model_copy(update={"broker_url": broker[1]})


def tenant(settings: Settings) -> dict[str, str]:
    with session_scope(settings) as session:
        _, key = keys.create_key(session, "tenant")
    return {"Authorization": f"Bearer {key}"}


def create(client: TestClient, headers: dict[str, str], model: str) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    line = {"custom_id": "a", "method": "POST", "url": CHAT, "body": body}
    return post_batch(
        client, json.dumps(line).encode() + b"\n", headers=headers, filename="in.jsonl"
    )


def refusal(response: Any) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "model_not_found",
        "body.model",
    )
    return str(error["message"])


def test_a_model_neither_served_nor_configured_is_refused_naming_the_served_ones(
    fleet_settings: Settings,
) -> None:
    registry.register(fleet_settings.broker_url, "w1@host", ["live-model"], ttl_seconds=60)
    settings = fleet_settings.model_copy(update={"served_models": ["configured-model"]})
    client = TestClient(create_app(settings))
    headers = tenant(settings)

    message = refusal(create(client, headers, "live-model-typo"))

    assert "'live-model-typo' is not served here" in message
    assert "served: 'configured-model', 'live-model'" in message
    assert "BATCHLLM_SERVED_MODELS" in message  # how an operator adds one
    with session_scope(settings) as session:
        assert session.query(Job).count() == 0  # no job, no queue


def test_a_configured_model_with_no_worker_is_accepted_and_stays_queued(
    fleet_settings: Settings, broker: tuple[redis.Redis, str]
) -> None:
    settings = fleet_settings.model_copy(update={"served_models": ["scaled-to-zero"]})
    client = TestClient(create_app(settings))

    response = create(client, tenant(settings), "scaled-to-zero")

    assert response.status_code == 200, response.text
    batch = Batch.model_validate(response.json())
    assert (batch.status, batch.model) == ("in_progress", "scaled-to-zero")
    with session_scope(settings) as session:
        job = session.get(Job, job_id_of(batch.id))
        assert job is not None and job.status is JobStatus.QUEUED
        assert [shard.status for shard in job.shards] == [ShardStatus.QUEUED]
    # Its shard task waits on its model's queue in the broker for a worker to start.
    client_redis = broker[0]
    queued = [key for key in client_redis.keys("*") if b"scaled-to-zero" in key]
    assert queued, client_redis.keys("*")


def test_a_live_workers_model_is_accepted_and_so_is_it_after_the_worker_is_gone(
    fleet_settings: Settings, broker: tuple[redis.Redis, str]
) -> None:
    """What a worker announces (batchllm worker --model M registers M while it lives) is
    served; once its worker is gone (its key expired: scaled to zero), the registry still
    remembers it for BATCHLLM_SERVED_MODEL_RETENTION_SECONDS; --require-served-model does
    not."""
    registry.register(fleet_settings.broker_url, "w1@host", ["m"], ttl_seconds=60)
    headers = tenant(fleet_settings)
    default = TestClient(create_app(fleet_settings))
    live_only = TestClient(create_app(fleet_settings, require_served_model=True))
    for client in (default, live_only):
        assert create(client, headers, "m").status_code == 200

    broker[0].delete(worker_key("w1@host"))  # the worker stopped: its key is gone
    assert registry.served_models(fleet_settings.broker_url) == {}

    assert create(default, headers, "m").status_code == 200
    models = default.get("/v1/models", headers=headers).json()["data"]
    assert [model["id"] for model in models] == ["m"]
    message = refusal(create(live_only, headers, "m"))
    assert "no live worker serves a model" in message
    no_memory = fleet_settings.model_copy(update={"served_model_retention_seconds": 0})
    refusal(create(TestClient(create_app(no_memory)), headers, "m"))


def test_a_fresh_deployment_says_how_to_accept_a_model_before_its_workers_start(
    fleet_settings: Settings,
) -> None:
    """No worker ever started, nothing configured: the first batch is refused, and the message
    tells the operator what to set."""
    client = TestClient(create_app(fleet_settings))

    message = refusal(create(client, tenant(fleet_settings), "/models/llama-8b"))

    assert "no worker has served a model in the last 7 days" in message
    assert "BATCHLLM_SERVED_MODELS='[\"/models/llama-8b\"]'" in message
    assert "batchllm worker --model /models/llama-8b" in message


def test_serves_own_worker_model_is_accepted_before_the_worker_announces_it(
    fleet_settings: Settings,
) -> None:
    client = TestClient(create_app(fleet_settings, own_models=["./tiny-model"]))
    headers = tenant(fleet_settings)
    assert create(client, headers, "./tiny-model").status_code == 200
    refusal(create(client, headers, "tiny-model"))  # compared exactly


def test_an_unreachable_registry_is_a_503_not_a_refusal(settings: Settings) -> None:
    get_engine(settings)
    away = settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    client = TestClient(create_app(away))
    response = create(client, tenant(away), "m")
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "service_unavailable"
    assert "registry" in response.json()["error"]["message"]
