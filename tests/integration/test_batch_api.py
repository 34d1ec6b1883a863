"""`batchllm serve` end to end, driven by the official `openai` client: a real server process
with API keys, a real `batchllm worker` on the paced instant engine (the tiny model's tokenizer
and chat template; every request answers with filler text at its max_tokens, one token per
20 ms: tests/support/fleet.py), the isolated PostgreSQL database and Redis database of
conftest's fleet_env. What is checked is the API and the fleet, not generation: the served
answers of a real model are tests/integration/test_real_model_api.py's subject, tool-call
parsing tests/engine/test_reasoning_tools_responses.py's.

One worker serves every batch of the module. Its reconciler runs every 2 s, so completion
windows of seconds expire within a test. Every object the SDK returns is validated with its own
pydantic models (`_strict_response_validation`), every output and error line checked for the
shape OpenAI writes (read_jsonl below).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, StoredFile, job_id_of
from tests.support.batch_api import StrictApi, api_worker, assert_line_shapes, serving
from tests.support.fleet import PACED_INSTANT_ARGS, FleetEnv
from tests.support.serve import (
    CHAT,
    COMPLETIONS,
    RESPONSES,
    Api,
    Server,
    assert_invalid_lines,
    assert_ok_lines,
    chat_line,
    completion_line,
    create_key,
    jsonl,
    upload,
    wait_for,
    wait_status,
)
from tests.support.serve import read_jsonl as read_file_lines

openai = pytest.importorskip("openai")
from openai import OpenAI  # noqa: E402
from openai.types import Batch, Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

MAX_FILE_BYTES = 4 * 1024 * 1024
# A 1x1 PNG.
PNG_DATA_URL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ"
    "/pLvAAAAAElFTkSuQmCC"
)
RECONCILE_SECONDS = "2"
# Long enough that cancelling or expiring it always finds rows done and rows left: on the
# paced instant engine 256 rows of 16-48 tokens take about a second, so 10,000 about 40 s
# whatever the machine, and it is stopped after a few seconds.
BIG_LINES = 10_000
FIRST_BATCH_SECONDS = 300
# Configured on the server, served by no worker: its batches are accepted and wait.
CONFIGURED_MODEL = "/configured-model-without-workers"
BATCH_SECONDS = 300
# Configured on the server, served by no worker: its batches are accepted and wait.
CONFIGURED_MODEL = "/configured-model-without-workers"


# -- the server and its worker ---------------------------------------------------------------


@pytest.fixture(scope="module")
def api(
    fleet_env: FleetEnv, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Api]:
    work = tmp_path_factory.mktemp("batch-api")
    keys = {name: create_key(fleet_env, name) for name in ("alice", "bob")}
    listed = fleet_env.cli("keys", "list")
    assert listed.returncode == 0 and "alice" in listed.stdout and "sk-" not in listed.stdout
    env = fleet_env.worker_env(
        BATCHLLM_RECONCILE_SECONDS=RECONCILE_SECONDS,
        BATCHLLM_API_MAX_FILE_BYTES=str(MAX_FILE_BYTES),
    )
    worker = api_worker("api@test", tiny_model, env, work, PACED_INSTANT_ARGS)
    # A model configured with no worker (test_a_queued_batch_expires); the worker's model is
    # served because its live worker announces it.
    server = Server(
        {**env, "BATCHLLM_SERVED_MODELS": json.dumps([CONFIGURED_MODEL])}, work / "serve.log"
    )
    with serving(worker, server):
        api = StrictApi(fleet_env, server, worker, str(tiny_model), keys)
        api.wait_model_served()
        yield api


# -- helpers ---------------------------------------------------------------------------------


def big_batch(api: Api) -> bytes:
    """BIG_LINES chat lines that each generate exactly 16 to 48 tokens (ignore_eos): rows keep
    finishing all along, so a checkpoint comes well before the end. Prompt and answer stay
    within 64 tokens, well inside the worker's context."""
    return jsonl(
        [
            {
                "custom_id": f"big-{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": api.model,
                    "messages": [{"role": "user", "content": f"big-{i}"}],
                    "max_tokens": big_tokens(i),
                    "ignore_eos": True,
                },
            }
            for i in range(BIG_LINES)
        ]
    )


def big_tokens(i: int) -> int:
    return 16 + i % 33


def read_jsonl(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """A result file's lines, each as OpenAI writes it: an answer (status code, request id,
    body) or an error (code, message)."""
    lines = read_file_lines(client, file_id)
    assert_line_shapes(lines)
    return lines


def refused_batch(client: OpenAI) -> Batch:
    """A batch refused at once for naming two models: no engine time."""
    file = upload(client, jsonl([chat_line("m1", "a"), chat_line("m2", "b")]))
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None, batch
    return batch


def assert_window(batch: Batch, seconds: int) -> None:
    # The window starts when the request comes (expires_at), the batch's clock once its input
    # is stored (created_at): they differ by the time storing took.
    assert 0 <= batch.created_at + seconds - batch.expires_at <= 10, batch


def backlog(api: Api) -> dict[str, float]:
    """serve's three backlog gauges for the worker's model, as a scraper reads them."""
    text = httpx.get(f"{api.server.base_url}/metrics", timeout=30).text
    found = re.findall(
        r"^(batchllm_backlog_rows|batchllm_backlog_seconds|batchllm_live_workers)"
        r'\{model="([^"]*)"\} (\S+)$',
        text,
        flags=re.M,
    )
    return {name: float(value) for name, model, value in found if model == api.model}


def completed_jobs(api: Api) -> int:
    with session_scope(api.fleet_env.settings) as session:
        return session.scalar(
            select(func.count())
            .select_from(Job)
            .where(Job.model == api.model, Job.status == JobStatus.COMPLETED)
        )


def file_rows(api: Api) -> int:
    with session_scope(api.fleet_env.settings) as session:
        return session.scalar(select(func.count()).select_from(StoredFile))


# -- tests -----------------------------------------------------------------------------------


def test_keys_are_required(api: Api) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        api.client("sk-batchllm-not-a-key").batches.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    revoked = create_key(api.fleet_env, "revoked")
    api.client(revoked).files.list()
    done = api.fleet_env.cli("keys", "revoke", "revoked")
    assert done.returncode == 0, done.stderr
    # The server trusts a key it looked up for BATCHLLM_API_KEY_CACHE_SECONDS (5): the
    # revocation takes effect within that, not at once.
    deadline = time.monotonic() + 5 + 60
    while True:
        try:
            api.client(revoked).files.list()
        except openai.AuthenticationError as exc:
            assert exc.status_code == 401
            break
        assert time.monotonic() < deadline, "a revoked key was still served after 65 s"
        time.sleep(0.5)
    # No key at all (the SDK refuses to send a request without one).
    bare = httpx.get(f"{api.server.base_url}/v1/batches", timeout=10)
    assert bare.status_code == 401
    assert set(bare.json()["error"]) == {"message", "type", "param", "code"}
    assert bare.json()["error"]["code"] == "missing_api_key"


def test_models_lists_the_worker_model_and_the_configured_one(api: Api) -> None:
    models = [m.id for m in api.client().models.list().data]
    assert api.model in models and CONFIGURED_MODEL in models
    assert "/nonexistent-model" not in models


def test_a_model_neither_served_nor_configured_is_refused_at_create(api: Api) -> None:
    """As OpenAI: model_not_found at create, naming the models served, not a batch waiting
    in_progress on a queue no worker reads until it expires."""
    client = api.client()
    file = upload(client, jsonl([chat_line(api.model + "-typo", "x")]))
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("model_not_found", "body.model")
    assert repr(api.model + "-typo") in error["message"]
    assert repr(api.model) in error["message"] and repr(CONFIGURED_MODEL) in error["message"]
    assert "BATCHLLM_SERVED_MODELS" in error["message"]


def test_an_oversized_upload_keeps_nothing(api: Api) -> None:
    client = api.client(api.keys["bob"])
    before_files = sorted(api.files_dir.rglob("*")) if api.files_dir.exists() else []
    before_listed = [f.id for f in client.files.list().data]
    before_rows = file_rows(api)
    line = json.dumps(chat_line(api.model, "x")).encode() + b"\n"
    just_over = (line * (MAX_FILE_BYTES // len(line) + 1))[: MAX_FILE_BYTES + 1]
    # One byte over: refused while it is stored; over by more than the multipart framing:
    # refused from its Content-Length before a byte is stored.
    for content in (just_over, just_over + line * (100_000 // len(line))):
        with pytest.raises(openai.APIStatusError) as caught:
            client.files.create(file=("big.jsonl", content), purpose="batch")
        assert caught.value.status_code == 413, caught.value
        assert caught.value.code == "file_too_large"
        after = sorted(api.files_dir.rglob("*")) if api.files_dir.exists() else []
        assert after == before_files
        assert [f.id for f in client.files.list().data] == before_listed
        assert file_rows(api) == before_rows
    # The limit itself is fine.
    fits = upload(client, line * (MAX_FILE_BYTES // len(line)))
    assert client.files.delete(fits.id).deleted


def image_line(model: str, custom_id: str, url: str) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return chat_line(model, custom_id, messages=[{"role": "user", "content": content}])


def test_a_chat_batch_completes(api: Api) -> None:
    client = api.client()
    valid = [chat_line(api.model, f"chat-{i}") for i in range(6)]
    invalid = [
        {**chat_line(api.model, "no-messages"), "body": {"model": api.model, "max_tokens": 8}},
        chat_line(api.model, "bad-temperature", temperature=-1),
        chat_line(api.model, "unknown-field", frobnicate=True),
        image_line(api.model, "bad-image", "data:image/png;base64,bm90IGFuIGltYWdl"),
    ]
    # A valid image the worker's text-only model cannot take: an error row when it runs.
    with_image = image_line(api.model, "with-image", PNG_DATA_URL)
    lines: list[dict[str, Any] | str] = [
        *valid[:3],
        *invalid,
        with_image,
        *valid[3:],
        '{"custom_id": "cut',
    ]
    broken_id = f"line-{len(lines)}"  # a line that does not parse gets its number as custom_id
    file = upload(client, jsonl(lines))
    # What a client that polls files.retrieve after an upload waits for (OpenAI's `processed`).
    retrieved = client.files.retrieve(file.id)
    assert (retrieved.status, retrieved.purpose, retrieved.bytes) == (
        "processed",
        "batch",
        len(jsonl(lines)),
    )
    created = client.batches.create(
        input_file_id=file.id,
        endpoint=CHAT,
        completion_window="24h",
        metadata={"suite": "batch-api"},
    )
    assert created.status in ("validating", "in_progress") and created.model == api.model
    assert (created.input_file_id, created.metadata) == (file.id, {"suite": "batch-api"})
    assert created.request_counts.total == len(lines)
    assert_window(created, 24 * 3600)

    batch = wait_status(api, client, created.id, "completed", FIRST_BATCH_SECONDS)
    assert batch.completed_at and batch.in_progress_at and batch.errors is None
    assert batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.cancelling_at is None
    assert batch.request_counts.model_dump() == {
        "total": len(lines),
        "completed": len(valid),
        "failed": len(invalid) + 2,
    }
    output = read_jsonl(client, batch.output_file_id)
    errors = read_jsonl(client, batch.error_file_id)
    (no_images,) = [line for line in errors if line["custom_id"] == "with-image"]
    errors.remove(no_images)
    assert no_images["response"] is None, no_images
    assert no_images["error"] == {
        "code": "invalid_prompt",
        "message": "model does not accept images",
    }
    assert sorted(line["custom_id"] for line in output) == sorted(c["custom_id"] for c in valid)
    prompt, completion = assert_ok_lines(output, ChatCompletion, api.model)
    for line in output:
        choice = ChatCompletion.model_validate(line["response"]["body"]).choices[0]
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert_invalid_lines(
        errors,
        {
            "no-messages": "messages",
            "bad-temperature": "temperature",
            "unknown-field": "frobnicate",
            "bad-image": "messages.0.content.1.image_url",
            broken_id: None,  # malformed JSON: no parameter to blame
        },
    )
    assert {line["custom_id"] for line in output + errors + [no_images]} == {
        *(c["custom_id"] for c in valid + invalid + [with_image]),
        broken_id,
    }
    assert batch.usage is not None
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt, completion)
    assert batch.usage.total_tokens == prompt + completion and completion > 0
    # Retrieving again exports nothing new: the same files.
    again = client.batches.retrieve(batch.id)
    assert (again.output_file_id, again.error_file_id) == (
        batch.output_file_id,
        batch.error_file_id,
    )
    # OpenAI's id form; the job's own id (what the CLI shows) finds the same batch.
    assert created.id == batch.id and batch.id.startswith("batch_")
    by_job_id = client.batches.retrieve(job_id_of(batch.id))
    assert by_job_id.model_dump() == again.model_dump()
    assert client.files.retrieve(batch.output_file_id).filename == f"{batch.id}_output.jsonl"


def test_a_completions_batch_completes(api: Api) -> None:
    client = api.client()
    valid = [completion_line(api.model, f"cmpl-{i}") for i in range(4)]
    invalid = [completion_line(api.model, "zero-tokens", max_tokens=0)]
    file = upload(client, jsonl([*valid, *invalid]))
    created = client.batches.create(
        input_file_id=file.id, endpoint=COMPLETIONS, completion_window="1h"
    )
    assert_window(created, 3600)
    batch = wait_status(api, client, created.id, "completed", BATCH_SECONDS)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    output = read_jsonl(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(c["custom_id"] for c in valid)
    prompt, completion = assert_ok_lines(output, Completion, api.model)
    for line in output:
        assert Completion.model_validate(line["response"]["body"]).object == "text_completion"
    assert_invalid_lines(read_jsonl(client, batch.error_file_id), {"zero-tokens": "max_tokens"})
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt, completion)


def test_a_responses_batch_answers_with_response_objects(api: Api) -> None:
    """/v1/responses lines through serve and a fleet worker: Response objects the SDK parses,
    a line's tools and forced tool choice carried to its answer. (That a forced tool call comes
    back as a function_call item is the real engine's part: tests/engine/
    test_reasoning_tools_responses.py::test_responses_lines_give_response_objects_the_sdk_parses.)"""
    from openai.types.responses import Response

    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}}
    lines = [
        {
            "custom_id": "resp-text",
            "method": "POST",
            "url": RESPONSES,
            "body": {
                "model": api.model,
                "input": "Hello",
                "instructions": "Be brief.",
                "max_output_tokens": 6,
                "temperature": 0,
            },
        },
        {
            "custom_id": "resp-tool",
            "method": "POST",
            "url": RESPONSES,
            "body": {
                "model": api.model,
                "input": [{"role": "user", "content": "Weather?"}],
                "tools": [{"type": "function", "name": "get_weather", "parameters": city}],
                "tool_choice": {"type": "function", "name": "get_weather"},
                "max_output_tokens": 30,
            },
        },
        {
            "custom_id": "resp-bad",
            "method": "POST",
            "url": RESPONSES,
            "body": {"model": api.model, "input": "x", "text": {"format": {"type": "xml"}}},
        },
    ]
    client = api.client()
    file = upload(client, jsonl(lines))
    created = client.batches.create(
        input_file_id=file.id,
        endpoint=RESPONSES,
        completion_window="1h",
        metadata={"tool_call_parser": "hermes"},
    )
    batch = wait_status(api, client, created.id, "completed", FIRST_BATCH_SECONDS)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    output = {line["custom_id"]: line for line in read_jsonl(client, batch.output_file_id)}
    text = Response.model_validate(output["resp-text"]["response"]["body"])
    assert text.object == "response" and text.model == api.model
    assert text.output[0].type == "message" and text.usage.output_tokens <= 6
    assert text.status == ("incomplete" if text.usage.output_tokens == 6 else "completed")
    tool = Response.model_validate(output["resp-tool"]["response"]["body"])
    assert tool.object == "response" and tool.model == api.model
    assert tool.tool_choice.type == "function" and tool.tool_choice.name == "get_weather"
    assert [t.name for t in tool.tools] == ["get_weather"]
    # The instant engine answers every line at its max_output_tokens.
    assert (tool.status, tool.usage.output_tokens) == ("incomplete", 30)
    assert_invalid_lines(read_jsonl(client, batch.error_file_id), {"resp-bad": "text.format.type"})


def test_a_file_for_two_endpoints_is_refused(api: Api) -> None:
    client = api.client()
    file = upload(client, jsonl([chat_line(api.model, "a"), completion_line(api.model, "b")]))
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [(2, "invalid_url", "url")]
    assert batch.output_file_id is None and batch.error_file_id is None
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/moderations", completion_window="24h"
        )
    assert caught.value.param == "endpoint"


def test_batch_pages(api: Api) -> None:
    client = api.client()
    for _ in range(3):
        refused_batch(client)
    everything = client.batches.list(limit=100)
    assert not everything.has_more and len(everything.data) >= 3
    ids = [b.id for b in everything.data]
    assert len(set(ids)) == len(ids)

    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == ids[:1] and first.has_more
    second = client.batches.list(limit=1, after=first.data[0].id)
    assert [b.id for b in second.data] == ids[1:2]
    assert second.has_more == (len(ids) > 2)
    paged = []
    page = first
    while True:
        paged += [b.id for b in page.data]
        if not page.has_next_page():
            break
        page = page.get_next_page()
    assert paged == ids
    assert [b.id for b in client.batches.list(limit=1)] == ids  # the SDK's auto-pagination
    last = client.batches.list(limit=1, after=ids[-1])
    assert last.data == [] and not last.has_more


def test_another_key_sees_nothing(api: Api) -> None:
    alice, bob = api.client(), api.client(api.keys["bob"])
    refused_batch(alice)  # at least one, with the batches the tests before this one made
    batches = alice.batches.list(limit=100).data
    bobs = {b.id for b in bob.batches.list(limit=100).data}
    for batch in batches:
        assert batch.id not in bobs
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            bob.batches.cancel(batch.id)
        with pytest.raises(openai.NotFoundError):
            bob.files.retrieve(batch.input_file_id)
        for file_id in filter(None, (batch.output_file_id, batch.error_file_id)):
            with pytest.raises(openai.NotFoundError):
                bob.files.content(file_id)
            with pytest.raises(openai.NotFoundError):
                bob.files.delete(file_id)
            alice.files.retrieve(file_id)  # still there
    with pytest.raises(openai.NotFoundError):
        bob.batches.list(after=batches[0].id)
    bob_files = {f.id for f in bob.files.list().data}
    assert not bob_files & {f.id for f in alice.files.list().data}


def test_cancel_a_running_batch(api: Api) -> None:
    client = api.client()
    file = upload(client, big_batch(api), "big.jsonl")
    created = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")

    def running() -> Batch | None:
        batch = client.batches.retrieve(created.id)
        assert batch.status == "in_progress", batch
        return batch if batch.request_counts.completed > 0 else None

    wait_for(running, timeout=BATCH_SECONDS, what=lambda: "a first checkpoint" + api.logs())
    # The autoscaler's view while it runs (serve's /metrics, from the database and the worker
    # registry): rows still to do, the time they take at the model's recent rate (the module's
    # earlier batches completed), the live worker.
    during = backlog(api)
    assert 0 < during["batchllm_backlog_rows"] < BIG_LINES, during
    assert during["batchllm_live_workers"] == 1, during
    # The seconds at a rate: the model's completed jobs', or this batch's own so far (a first
    # checkpoint is in) when the module's earlier batches did not run.
    assert during["batchllm_backlog_seconds"] > 0, (during, completed_jobs(api))
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled")
    assert cancelling.cancelling_at is not None  # when the cancel was asked for (issue 64)
    batch = wait_status(api, client, created.id, "cancelled", 120)
    assert batch.cancelling_at == cancelling.cancelling_at <= batch.cancelled_at
    after = backlog(api)
    assert after["batchllm_backlog_rows"] == after["batchllm_backlog_seconds"] == 0, after
    print(f"backlog gauges of {api.model}: during the batch {during}, after its cancel {after}")
    assert batch.cancelled_at and batch.completed_at is None
    counts = batch.request_counts
    assert counts.total == BIG_LINES
    assert 0 < counts.completed < BIG_LINES and counts.failed == BIG_LINES - counts.completed
    # The finished rows in the output file; every line that never ran in the error file, with
    # code `cancelled`: each input line in exactly one of the two.
    output = read_jsonl(client, batch.output_file_id)
    assert len(output) == counts.completed
    not_run = read_jsonl(client, batch.error_file_id)
    assert {line["error"]["code"] for line in not_run} == {"cancelled"}
    assert len(not_run) == counts.failed  # the count says what the error file holds
    assert all(line["response"] is None for line in not_run)
    custom_ids = [line["custom_id"] for line in output]
    everything = custom_ids + [line["custom_id"] for line in not_run]
    assert sorted(everything) == sorted(f"big-{i}" for i in range(BIG_LINES))
    prompt, completion = assert_ok_lines(output, ChatCompletion, api.model)
    for line in output:
        i = int(line["custom_id"].removeprefix("big-"))
        assert line["response"]["body"]["usage"]["completion_tokens"] == big_tokens(i)
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt, completion)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(created.id)
    # The worker is free again: a small batch completes.
    small = upload(client, jsonl([chat_line(api.model, "after-cancel")]))
    after = client.batches.create(input_file_id=small.id, endpoint=CHAT, completion_window="24h")
    assert (
        wait_status(api, client, after.id, "completed", BATCH_SECONDS).request_counts.completed == 1
    )


def test_a_queued_batch_expires(api: Api) -> None:
    """Its model is configured (BATCHLLM_SERVED_MODELS) but no worker serves it (scaled to
    zero): accepted, it waits in the queue until its window passes."""
    client = api.client()
    lines = [chat_line(CONFIGURED_MODEL, f"never-{i}") for i in range(3)]
    file = upload(client, jsonl(lines))
    created = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="5s")
    assert created.status == "in_progress" and created.model == CONFIGURED_MODEL
    # in_progress since its create, though no worker ever started it (issue 64)
    assert created.in_progress_at == created.created_at
    assert_window(created, 5)
    batch = wait_status(api, client, created.id, "expired", 60)
    assert batch.expired_at and batch.expired_at >= batch.expires_at
    assert batch.in_progress_at == created.created_at
    # No line ran: the output file is empty, and the error file lists every line as OpenAI
    # does for a batch that expired (openai_files: not-run lines of an expired job); the
    # counts say what the files hold.
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
    assert batch.output_file_id is None  # no line ran: no output file id, as OpenAI
    errors = read_jsonl(client, batch.error_file_id)
    assert_expired_lines(errors)
    assert sorted(line["custom_id"] for line in errors) == [c["custom_id"] for c in lines]


def assert_expired_lines(lines: list[dict[str, Any]]) -> None:
    for line in lines:
        assert line["id"].startswith("batch_req_") and line["response"] is None, line
        assert line["error"]["code"] == "batch_expired" and line["error"]["message"], line


def test_a_running_batch_expires_with_its_finished_rows(api: Api) -> None:
    client = api.client()
    file = upload(client, big_batch(api), "big.jsonl")
    created = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="15s")
    batch = wait_status(api, client, created.id, "expired", 120)
    counts = batch.request_counts
    assert 0 < counts.completed < BIG_LINES, counts
    assert batch.in_progress_at and batch.expired_at >= batch.expires_at
    output = read_jsonl(client, batch.output_file_id)
    assert len(output) == counts.completed
    assert_ok_lines(output, ChatCompletion, api.model)
    # The lines it had no time for are batch_expired errors: every line is in one file.
    errors = read_jsonl(client, batch.error_file_id)
    assert len(errors) == BIG_LINES - counts.completed == counts.failed
    assert_expired_lines(errors)
    assert sorted(line["custom_id"] for line in output + errors) == sorted(
        f"big-{i}" for i in range(BIG_LINES)
    )
