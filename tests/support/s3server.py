"""A real S3-compatible server for the tests: moto's server mode (`moto[server]`, the `test`
extra) as a subprocess on a free 127.0.0.1 port, stopped by its PID afterwards.

Everything it stores is in its memory and gone when it stops. Any access key is accepted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchllm.process.ports import HOST, free_port
from tests.support.skips import require

ACCESS_KEY = "batchllm-test"
SECRET_KEY = "batchllm-test-secret"
REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path

    def env(self, bucket: str, prefix: str = "jobs") -> dict[str, str]:
        """The variables that point batchllm (and pyarrow's AWS SDK) at this server, with
        `s3://bucket/prefix` as the job storage."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",  # no credential look-up on 169.254.169.254
            "BATCHLLM_S3_ENDPOINT": self.endpoint,
            "BATCHLLM_STORAGE": f"s3://{bucket}/{prefix}",
        }

    def filesystem(self, *, allow_bucket_creation: bool = False):
        """A pyarrow S3 filesystem on this server, built independently of batchllm's code."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(
            endpoint_override=self.endpoint.removeprefix("http://"),
            scheme="http",
            region=REGION,
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            allow_bucket_creation=allow_bucket_creation,
        )

    def new_bucket(self) -> str:
        bucket = f"batchllm-{uuid.uuid4().hex[:12]}"
        self.filesystem(allow_bucket_creation=True).create_dir(bucket)
        return bucket

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2) as response:
            return bool(response.status < 500)
    except urllib.error.HTTPError as exc:  # an S3 error document is an answer too
        return exc.code < 500
    except OSError:
        return False


@contextlib.contextmanager
def moto_server(log_dir: Path, timeout: float = 60) -> Iterator[S3Server]:
    """Start moto's S3 server, wait until it answers, yield it; stop it by its PID."""
    try:
        import moto.server  # moto[server]: flask, werkzeug
    except ImportError as exc:
        require(False, f"moto[server] is not installed (the test extra): {exc}")
    port = free_port()
    endpoint = f"http://{HOST}:{port}"
    log_path = log_dir / f"moto-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "BATCHLLM_"))}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    server = S3Server(endpoint=endpoint, process=process, log_path=log_path)
    try:
        deadline = time.monotonic() + timeout
        while not _answers(endpoint):
            if process.poll() is not None:
                pytest.fail(f"moto server exited with {process.returncode}:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"moto server not answering after {timeout:.0f}s:\n{server.log_tail()}")
            time.sleep(0.2)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
