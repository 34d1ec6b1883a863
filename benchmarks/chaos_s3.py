"""The chaos run's object storage: moto's S3 server (`moto[server]`, the test extra) as a
process of the run on a free port, its bucket, and a copy of the bucket's files on local disk
taken before the server (which keeps everything in memory) ends, so that the checker, and
`python -m benchmarks.chaos_check DIR` later, read exactly the files the fleet committed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from batchllm.process.ports import HOST, free_port
from batchllm.process.services import ServiceFailed, tail

ACCESS_KEY = "batchllm-chaos"
SECRET_KEY = "batchllm-chaos-secret"
REGION = "us-east-1"
BUCKET = "batchllm-chaos"
PREFIX = "jobs"


class MotoServer:
    """`python -m moto.server` on a free port of 127.0.0.1, ended by its PID."""

    def __init__(self, *, log_path: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def storage(self) -> str:
        return f"s3://{BUCKET}/{PREFIX}"

    def env(self, endpoint: str) -> dict[str, str]:
        """What points batchllm (and pyarrow's AWS SDK) at the bucket through `endpoint`."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "BATCHLLM_S3_ENDPOINT": endpoint,
            "BATCHLLM_STORAGE": self.storage,
        }

    def filesystem(self, *, allow_bucket_creation: bool = False) -> Any:
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(
            endpoint_override=f"{HOST}:{self.port}",
            scheme="http",
            region=REGION,
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            allow_bucket_creation=allow_bucket_creation,
        )

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=2) as response:
                return bool(response.status < 500)
        except urllib.error.HTTPError as exc:
            return exc.code < 500
        except OSError:
            return False

    def start(self, timeout: float = 60) -> None:
        try:
            import moto.server  # noqa: F401  (moto[server]: flask, werkzeug)
        except ImportError as exc:
            raise ServiceFailed(
                f"the S3 run needs moto[server] (the test extra): {exc}; or use --storage dir"
            ) from exc
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "BATCHLLM_"))}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None:
                raise ServiceFailed(
                    f"moto server exited with {self.proc.returncode}:\n" + tail(self.log_path)
                )
            if time.monotonic() > deadline:
                raise ServiceFailed(f"moto server not answering after {timeout:.0f} s")
            time.sleep(0.2)
        self.filesystem(allow_bucket_creation=True).create_dir(BUCKET)

    def mirror(self, into: Path) -> int:
        """Copy every file of the bucket's prefix to `into` (same relative paths); returns how
        many."""
        import pyarrow.fs as pafs

        fs = self.filesystem()
        infos = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/{PREFIX}", recursive=True))
        files = [info for info in infos if info.type == pafs.FileType.File]
        for info in files:
            target = into / Path(info.path).relative_to(f"{BUCKET}/{PREFIX}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(info.path) as stream:
                target.write_bytes(stream.read())
        return len(files)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
