"""batch-openai (PyPI `batch-openai`) against `batchllm serve`, as its README uses it: a
`BatchRequestBuilder` submitted with an `OpenAI` client whose `base_url` and `api_key` name the
server, `BatchJob.wait()` for the results, a `BatchRegistry` tracking the job, and its
`batch-openai` command line (which reads `OPENAI_BASE_URL` and `OPENAI_API_KEY`, as the SDK
does) to follow, cancel and download a batch (docs/batch-api.md, "Clients tried")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from batch_openai import BatchJob, BatchRegistry, BatchRequestBuilder
from openai import OpenAI

from tests.support.client_batches import (
    BIG_LINES,
    DEADLINE_SECONDS,
    POLL_SECONDS,
    ClientServer,
    answers_of,
    assert_every_line_answered,
    big_batch,
    small_batch,
)

CLI = str(Path(sys.executable).with_name("batch-openai"))


def submit(served: ClientServer, requests: list[dict[str, Any]], description: str) -> BatchJob:
    client = OpenAI(base_url=served.base_url, api_key=served.api_key)
    builder = BatchRequestBuilder()
    for request in requests:
        body = dict(request["body"])
        builder.add(body.pop("messages"), custom_id=request["custom_id"], **body)
    assert len(builder) == len(requests)
    return builder.submit(client, description=description)


def cli(served: ClientServer, registry: Path, *args: str) -> str:
    """`batch-openai --registry REGISTRY ARGS` as its user runs it: the server and key from
    the environment, in a directory of its own (it reads a .env file from there)."""
    env = {**os.environ, "OPENAI_BASE_URL": served.base_url, "OPENAI_API_KEY": served.api_key}
    done = subprocess.run(
        [CLI, "--registry", str(registry), *args],
        env=env,
        cwd=registry.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"batch-openai {args}: {done.stderr}{served.logs()}"
    return done.stdout


def test_batch_openai_submits_waits_and_reads_the_results(
    served: ClientServer, tmp_path: Path
) -> None:
    requests = small_batch(served.model, "batch-openai")
    job = submit(served, requests, "small")
    registry = BatchRegistry(tmp_path / "registry")
    registry.track(job)

    # wait() polls until the batch ends and reads its output and error files; a batch that
    # ends otherwise than `completed` raises.
    result = job.wait(poll_interval=POLL_SECONDS)

    assert job.status == "completed" and job.description == "small"
    assert result.failed == [], result.failed
    assert all(item.raw_response["usage"]["completion_tokens"] > 0 for item in result)
    assert_every_line_answered({item.custom_id: item.content for item in result}, requests)
    # The command line's view: the live status (which it records in the registry), then the
    # registry's list.
    shown = cli(served, tmp_path / "registry", "status", job.batch_id)
    assert "Status:      completed" in shown and f"{len(requests)} completed, 0 failed" in shown
    listed = cli(served, tmp_path / "registry", "list")
    assert re.search(rf"{job.batch_id[:22]} +small +completed ", listed), listed


def test_batch_openai_cancels_a_running_batch_from_its_command_line(
    served: ClientServer, tmp_path: Path
) -> None:
    requests = big_batch(served.model, "batch-openai-big")
    job = submit(served, requests, "big")
    registry = tmp_path / "registry"
    BatchRegistry(registry).track(job)

    said = cli(served, registry, "cancel", job.batch_id)

    status = re.search(r"Status: (\w+)", said)
    assert status and status.group(1) in ("cancelling", "cancelled"), said
    deadline = time.monotonic() + DEADLINE_SECONDS
    while "Status:      cancelled" not in (shown := cli(served, registry, "status", job.batch_id)):
        assert "Status:      cancelling" in shown, shown
        assert time.monotonic() < deadline, f"not cancelled: {shown}{served.logs()}"
        time.sleep(POLL_SECONDS)
    counts = re.search(r"Requests: +(\d+) total, (\d+) completed, (\d+) failed", shown)
    assert counts, shown
    total, completed, failed = map(int, counts.groups())
    assert (total, completed + failed) == (BIG_LINES, BIG_LINES) and failed > 0, shown
    # `download` merges the output and error files: every line once, answered or not run.
    downloaded = tmp_path / "results.jsonl"
    said = cli(served, registry, "download", job.batch_id, "--output", str(downloaded))
    assert f"Wrote {BIG_LINES} records" in said, said
    lines = downloaded.read_text().splitlines()
    answers = "\n".join(line for line in lines if json.loads(line)["error"] is None)
    assert len(answers_of(answers)) == completed and len(lines) == BIG_LINES
    assert len({json.loads(line)["custom_id"] for line in lines}) == BIG_LINES
