"""openai-batch (PyPI `openai-batch`, Parasail's) against `batchllm serve`: its `Batch` over a
JSONL file (`submit_wait_download()`, and the step-by-step `submit()`, `status()`,
`download()`), and its command line, `python -m openai_batch.run` with `--base-url` and
`--api-key`, creating a batch (`-c`) and resuming it (`--resume`) to download the results. The
library has no cancel. Its `add_to_batch()` is not used: in 0.3.4 a batch built with it fails
in `submit()` inside the library, whatever the server (it closes the file it wrote, then reads
it: "I/O operation on closed file"); so its users hand it a JSONL file, as its command line does
(docs/batch-api.md, "Clients tried")."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from openai_batch import Batch
from openai_batch.providers import Provider, get_provider_by_base_url

from tests.support.client_batches import (
    DEADLINE_SECONDS,
    POLL_SECONDS,
    ClientServer,
    answers_of,
    assert_every_line_answered,
    small_batch,
    write_jsonl,
)

ENDED = ("completed", "failed", "expired", "cancelled")


def provider(served: ClientServer) -> Provider:
    """The server as the library names one it does not know: a provider made from its URL."""
    found = get_provider_by_base_url(served.base_url)
    found.api_key = served.api_key
    return found


def test_openai_batch_submits_waits_and_downloads(served: ClientServer, tmp_path: Path) -> None:
    requests = small_batch(served.model, "openai-batch")
    with Batch(
        submission_input_file=str(write_jsonl(tmp_path / "batch_input.jsonl", requests)),
        output_file=tmp_path / "batch_output.jsonl",
        error_file=tmp_path / "batch_errors.jsonl",
        provider=provider(served),
    ) as batch:
        result, output_path, error_path = batch.submit_wait_download(
            interval=POLL_SECONDS, metadata={"client": "openai-batch"}
        )

    assert result.status == "completed", f"{result}{served.logs()}"
    assert (result.request_counts.completed, result.request_counts.failed) == (len(requests), 0)
    assert result.metadata == {"client": "openai-batch"}
    # No error file: the library downloads one only when the batch names it (none failed).
    assert (output_path, error_path) == (tmp_path / "batch_output.jsonl", None)
    assert_every_line_answered(answers_of(Path(output_path).read_text()), requests)


def test_openai_batch_step_by_step(served: ClientServer, tmp_path: Path) -> None:
    requests = small_batch(served.model, "openai-batch-steps")
    batch = Batch(
        submission_input_file=str(write_jsonl(tmp_path / "batch_input.jsonl", requests)),
        output_file=tmp_path / "batch_output.jsonl",
        provider=provider(served),
    )
    batch_id = batch.submit()

    # Resumed by id, as its README does after a restart.
    resumed = Batch(batch_id=batch_id, output_file=tmp_path / "resumed.jsonl")
    resumed.provider = provider(served)
    deadline = time.monotonic() + DEADLINE_SECONDS
    while (status := resumed.status()).status not in ENDED:
        assert time.monotonic() < deadline, f"still {status.status}{served.logs()}"
        time.sleep(POLL_SECONDS)
    output_path, error_path = resumed.download()

    assert status.id == batch_id and status.status == "completed", status
    assert batch.status().status == "completed"
    assert (output_path, error_path) == (tmp_path / "resumed.jsonl", None)
    assert_every_line_answered(answers_of(Path(output_path).read_text()), requests)


def test_openai_batch_command_line_creates_then_resumes(
    served: ClientServer, tmp_path: Path
) -> None:
    requests = small_batch(served.model, "openai-batch-cli")
    source = write_jsonl(tmp_path / "input.jsonl", requests)
    where = ("--base-url", served.base_url, "--api-key", served.api_key)

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "openai_batch.run", *args, *where],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"openai_batch.run {args}: {done.stderr}{served.logs()}"
        return done.stdout

    created = run(str(source), "-c")
    batch_id = created.split("Created ", 1)[1].split(".\n", 1)[0]
    # It polls once a minute: resume once the batch has ended, so it downloads at once.
    batch = Batch(batch_id=batch_id)
    batch.provider = provider(served)
    deadline = time.monotonic() + DEADLINE_SECONDS
    while batch.status().status not in ENDED:
        assert time.monotonic() < deadline, served.logs()
        time.sleep(POLL_SECONDS)
    resumed = run("--resume", batch_id, "-o", "output.jsonl", "-e", "errors.jsonl")

    assert f"Status of {batch_id}: completed" in resumed, resumed
    assert not (tmp_path / "errors.jsonl").exists()
    assert_every_line_answered(answers_of((tmp_path / "output.jsonl").read_text()), requests)
