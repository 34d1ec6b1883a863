"""An embeddings batch (/v1/embeddings) through `batchllm serve` and the official `openai`
client: each answer a CreateEmbeddingResponse the SDK parses, the invalid lines in the error
file, every object validated with the SDK's own models (`_strict_response_validation`).

The instant engine simulates generation only, so the worker here is a real vLLM pooling engine
(`--task embed`) on all-MiniLM-L6-v2 (384 dimensions; ~20 s to start): what is checked is the
API's embeddings output, not the vectors' quality (tests/engine/test_embedding_jobs.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.batch_api import StrictApi, api_worker, assert_line_shapes, serving
from tests.support.fleet import FleetEnv
from tests.support.serve import Server, create_key, jsonl, read_jsonl, upload, wait_status

openai = pytest.importorskip("openai")
from openai import OpenAI  # noqa: E402
from openai.types import CreateEmbeddingResponse  # noqa: E402
from openai.types.shared import ErrorObject  # noqa: E402

EMBEDDINGS = "/v1/embeddings"
DIMENSIONS = 384  # all-MiniLM-L6-v2's
BATCH_SECONDS = 300


@pytest.fixture(scope="module")
def api(
    fleet_env: FleetEnv, embed_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StrictApi]:
    work = tmp_path_factory.mktemp("batch-api-embeddings")
    keys = {"alice": create_key(fleet_env, "embeddings-alice")}
    env = fleet_env.worker_env(BATCHLLM_RECONCILE_SECONDS="2")
    # MiniLM's context is 256 positions.
    engine_args = ("--enforce-eager", "--max-model-len", "256", "--task", "embed")
    worker = api_worker("api-embed@test", embed_model, env, work, engine_args)
    server = Server(env, work / "serve.log")
    with serving(worker, server):
        api = StrictApi(fleet_env, server, worker, str(embed_model), keys)
        api.wait_model_served()
        yield api


def embedding_line(model: str, custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": EMBEDDINGS,
        "body": {"model": model, **body},
    }


def test_an_embeddings_batch_answers_with_embedding_lists(api: StrictApi) -> None:
    client = api.client()
    lines = [
        embedding_line(api.model, "one", input="The river runs to the sea."),
        embedding_line(api.model, "float", input="A farmer's table.", encoding_format="float"),
        embedding_line(api.model, "two", input=["Tell me about the river", "A wooden table"]),
        embedding_line(api.model, "no-input"),
        embedding_line(api.model, "unknown-field", input="x", frobnicate=True),
    ]
    file = upload(client, jsonl(lines))
    created = client.batches.create(
        input_file_id=file.id, endpoint=EMBEDDINGS, completion_window="24h"
    )
    assert created.endpoint == EMBEDDINGS and created.model == api.model
    batch = wait_status(api, client, created.id, "completed", BATCH_SECONDS)
    assert batch.request_counts.model_dump() == {"total": 5, "completed": 3, "failed": 2}
    output = {line["custom_id"]: line for line in read_jsonl(client, batch.output_file_id)}
    assert_line_shapes(list(output.values()))
    assert sorted(output) == ["float", "one", "two"]
    prompt = 0
    for custom_id, line in output.items():
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        body = CreateEmbeddingResponse.model_validate(line["response"]["body"])
        assert (body.object, body.model) == ("list", api.model)
        assert [e.index for e in body.data] == list(range(2 if custom_id == "two" else 1))
        for embedding in body.data:
            assert embedding.object == "embedding" and len(embedding.embedding) == DIMENSIONS
            assert math.isclose(math.hypot(*embedding.embedding), 1.0, rel_tol=1e-3)
        assert body.usage.prompt_tokens == body.usage.total_tokens > 0
        prompt += body.usage.prompt_tokens
    assert batch.usage is not None and batch.usage.input_tokens == prompt
    errors = read_jsonl(client, batch.error_file_id)
    assert_line_shapes(errors)
    assert sorted(line["custom_id"] for line in errors) == ["no-input", "unknown-field"]
    for line in errors:
        assert line["response"]["status_code"] == 400 and line["error"] is None, line
        error = ErrorObject.model_validate(line["response"]["body"]["error"])
        assert error.type == "invalid_request_error" and error.message and error.code, line
    params = {line["custom_id"]: line["response"]["body"]["error"]["param"] for line in errors}
    assert params == {"no-input": "input", "unknown-field": "frobnicate"}
