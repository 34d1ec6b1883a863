"""LiteLLM's batch API (`litellm.create_file`, `create_batch`, `retrieve_batch`,
`list_batches`, `file_retrieve`, `file_content`, `cancel_batch`) against `batchllm serve`, as its
users point it at an OpenAI-compatible server: `custom_llm_provider` "openai" (or "hosted_vllm",
LiteLLM's provider for a vLLM server), `api_base` and `api_key`, nothing else changed
(docs/batch-api.md, "Clients tried")."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import litellm
import pytest

from tests.support.client_batches import (
    DEADLINE_SECONDS,
    POLL_SECONDS,
    ClientServer,
    answers_of,
    assert_cancelled_part_way,
    assert_every_line_answered,
    big_batch,
    small_batch,
    write_jsonl,
)
from tests.support.serve import CHAT

ENDED = ("completed", "failed", "expired", "cancelled")


def where(served: ClientServer, provider: str = "openai") -> dict[str, Any]:
    return {"custom_llm_provider": provider, "api_base": served.base_url, "api_key": served.api_key}


def upload_and_create(served: ClientServer, path: Path, provider: str = "openai") -> Any:
    with path.open("rb") as handle:
        uploaded = litellm.create_file(file=handle, purpose="batch", **where(served, provider))
    assert uploaded.purpose == "batch" and uploaded.bytes == path.stat().st_size, uploaded
    batch = litellm.create_batch(
        completion_window="24h",
        endpoint=CHAT,
        input_file_id=uploaded.id,
        metadata={"client": "litellm"},
        **where(served, provider),
    )
    # OpenAI answers `validating`; batchllm validates within the create (docs: "queued").
    assert batch.input_file_id == uploaded.id, batch
    assert batch.status in ("validating", "in_progress"), batch
    return batch


def poll_until_ended(served: ClientServer, batch_id: str, provider: str = "openai") -> Any:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        batch = litellm.retrieve_batch(batch_id=batch_id, **where(served, provider))
        if batch.status in ENDED:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}{served.logs()}"
        time.sleep(POLL_SECONDS)


def download(served: ClientServer, file_id: str, provider: str = "openai") -> str:
    return litellm.file_content(file_id=file_id, **where(served, provider)).text


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_uploads_creates_polls_and_downloads_a_batch(
    served: ClientServer, tmp_path: Path, provider: str
) -> None:
    requests = small_batch(served.model, f"litellm-{provider}")
    created = upload_and_create(
        served, write_jsonl(tmp_path / "requests.jsonl", requests), provider
    )

    batch = poll_until_ended(served, created.id, provider)

    assert batch.status == "completed", f"{batch}{served.logs()}"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(requests), len(requests), 0)
    assert batch.error_file_id is None and batch.output_file_id, batch
    assert batch.metadata == {"client": "litellm"}
    listed = litellm.list_batches(limit=100, **where(served, provider))
    assert created.id in [b.id for b in listed.data], listed
    output = litellm.file_retrieve(file_id=batch.output_file_id, **where(served, provider))
    assert output.purpose == "batch_output", output
    text = download(served, batch.output_file_id, provider)
    assert output.bytes == len(text.encode())
    assert_every_line_answered(answers_of(text), requests)


def test_litellm_cancels_a_running_batch(served: ClientServer, tmp_path: Path) -> None:
    requests = big_batch(served.model, "litellm-big")
    created = upload_and_create(served, write_jsonl(tmp_path / "big.jsonl", requests))

    cancelling = litellm.cancel_batch(batch_id=created.id, **where(served))

    assert cancelling.id == created.id and cancelling.status in ("cancelling", "cancelled")
    batch = poll_until_ended(served, created.id)
    counts = batch.request_counts
    assert_cancelled_part_way(batch.status, counts.completed, counts.failed, counts.total)
    assert batch.cancelled_at is not None, batch
    # Each line once, in one file or the other: its answer, or `cancelled` for a line never run.
    answered = answers_of(download(served, batch.output_file_id)) if batch.output_file_id else {}
    assert len(answered) == counts.completed
    never_run = download(served, batch.error_file_id).splitlines()
    assert len(never_run) == counts.failed
    assert len(answered) + len(never_run) == len(requests)
