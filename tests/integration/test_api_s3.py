"""`batchllm serve` with its storage in a bucket (BATCHLLM_STORAGE=s3://bucket/prefix on moto's
S3 server): the official `openai` client uploads a file, creates a batch that a real worker
runs (on the instant engine: the storage is the subject, not generation), and downloads the
output and error files. Each object is also read straight from the bucket, with a pyarrow
filesystem built independently of batchllm, and nothing lands on the local disk's default
storage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from batchllm.settings import Settings
from batchllm.store.db import session_scope
from batchllm.store.models import Job, StoredFile, job_id_of
from tests.support.batch_api import serving
from tests.support.fleet import INSTANT_ARGS, FleetEnv, Worker
from tests.support.s3server import S3Server, moto_server
from tests.support.serve import (
    CHAT,
    Server,
    assert_invalid_lines,
    assert_ok_lines,
    chat_line,
    create_key,
    jsonl,
    wait_for,
)

openai = pytest.importorskip("openai")
from openai import OpenAI  # noqa: E402
from openai.types import Batch  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

pytestmark = pytest.mark.integration

PREFIX = "api"


@dataclass
class S3Api:
    fleet_env: FleetEnv  # the fleet's PostgreSQL and Redis, the storage in the bucket
    s3: S3Server
    bucket: str
    server: Server
    worker: Worker
    model: str
    key: str

    def client(self) -> OpenAI:
        return OpenAI(
            base_url=f"{self.server.base_url}/v1", api_key=self.key, max_retries=0, timeout=120
        )

    def object(self, path: str) -> bytes | None:
        """An object of the bucket as S3 has it (None when there is none), read without
        batchllm's code."""
        fs = self.s3.filesystem()
        if fs.get_file_info(path).type != pafs.FileType.File:
            return None
        with fs.open_input_stream(path) as src:
            return bytes(src.read())

    def logs(self) -> str:
        return (
            f"\n--- serve log (tail) ---\n{self.server.tail()}"
            f"\n--- worker log (tail) ---\n{self.worker.tail()}"
        )


@pytest.fixture(scope="module")
def s3_api(
    fleet_env: FleetEnv, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[S3Api]:
    work = tmp_path_factory.mktemp("api-s3")
    # The tiny model under a name of its own: this module's worker has a queue of its own.
    model = work / "s3-model"
    model.symlink_to(tiny_model, target_is_directory=True)
    with moto_server(work) as s3:
        bucket = s3.new_bucket()
        env = {**fleet_env.env, **s3.env(bucket, PREFIX)}
        settings = Settings(
            **{
                k.removeprefix("BATCHLLM_").lower(): v
                for k, v in env.items()
                if k.startswith("BATCHLLM_")
            }
        )
        assert settings.resolved_storage == f"s3://{bucket}/{PREFIX}"
        s3_fleet = FleetEnv(settings=settings, env=env, redis=fleet_env.redis)
        key = create_key(s3_fleet, "s3-tenant")
        worker = Worker(
            "api-s3@test",
            model=model,
            env=env,
            log_path=work / "worker.log",
            engine_args=INSTANT_ARGS,
        )
        # Configured, as a deployment whose batches may come before its worker announces it.
        server = Server(
            {**env, "BATCHLLM_SERVED_MODELS": json.dumps([str(model)])}, work / "serve.log"
        )
        with serving(worker, server):
            yield S3Api(s3_fleet, s3, bucket, server, worker, str(model), key)


def test_a_batch_runs_from_upload_to_output_download_with_every_file_in_the_bucket(
    s3_api: S3Api,
):
    client = s3_api.client()
    valid = [chat_line(s3_api.model, f"chat-{i}") for i in range(6)]
    content = jsonl([*valid, chat_line(s3_api.model, "zero-tokens", max_tokens=0)])

    file = client.files.create(file=("requests.jsonl", content), purpose="batch")
    assert (file.bytes, file.filename) == (len(content), "requests.jsonl")
    files_prefix = f"{s3_api.bucket}/{PREFIX}/files"
    assert s3_api.object(f"{files_prefix}/{file.id}.jsonl") == content  # streamed into the bucket
    assert client.files.content(file.id).content == content  # and read back from it

    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")

    def ended() -> Batch | None:
        now = client.batches.retrieve(batch.id)
        return now if now.status in ("completed", "failed", "expired", "cancelled") else None

    done = wait_for(
        ended,
        timeout=300,
        what=lambda: f"batch {batch.id} to end{s3_api.logs()}",
    )
    assert done.status == "completed", f"{done}{s3_api.logs()}"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)

    output = client.files.content(done.output_file_id).content
    errors = client.files.content(done.error_file_id).content
    output_lines = [json.loads(line) for line in output.decode().splitlines()]
    assert [line["custom_id"] for line in output_lines] == [f"chat-{i}" for i in range(6)]
    assert_ok_lines(output_lines, ChatCompletion, s3_api.model)
    assert_invalid_lines(
        [json.loads(line) for line in errors.decode().splitlines()], {"zero-tokens": "max_tokens"}
    )

    results = f"{files_prefix}/{job_id_of(batch.id)}-results"
    assert s3_api.object(f"{results}/output.jsonl") == output
    assert s3_api.object(f"{results}/errors.jsonl") == errors
    for file_id, data, lines in ((done.output_file_id, output, 6), (done.error_file_id, errors, 1)):
        stored = client.files.retrieve(file_id)
        assert (stored.purpose, stored.bytes) == ("batch_output", len(data))
        with session_scope(s3_api.fleet_env.settings) as session:
            row = session.get(StoredFile, file_id)
            assert (row.path.startswith(results + "/"), row.lines) == (True, lines)
    with session_scope(s3_api.fleet_env.settings) as session:
        job = session.get(Job, job_id_of(batch.id))
        assert job.input_file == f"s3://{files_prefix}/{file.id}.jsonl"
        assert job.output_dir == f"s3://{s3_api.bucket}/{PREFIX}/{job.id}/output"
    # The default local storage ($BATCHLLM_HOME/jobs) was never used.
    assert not (s3_api.fleet_env.settings.home / "jobs").exists()

    assert client.files.delete(file.id).deleted
    assert s3_api.object(f"{files_prefix}/{file.id}.jsonl") is None
    with pytest.raises(openai.NotFoundError):
        client.files.content(file.id)


def test_a_file_naming_two_models_is_read_from_the_bucket_and_refused(s3_api: S3Api):
    """The batch-level checks read the uploaded file from the bucket too."""
    client = s3_api.client()
    content = jsonl([chat_line("m1", "a"), chat_line("m1", "b"), chat_line("m2", "c")])
    file = client.files.create(file=("two-models.jsonl", content), purpose="batch")

    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="1h")

    assert batch.status == "failed" and batch.errors is not None, batch
    listed = [(e.line, e.code, e.param) for e in batch.errors.data or []]
    assert listed == [(3, "model_mismatch", "body.model")]
    assert batch.input_file_id == file.id
