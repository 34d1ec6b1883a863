"""The one `batchllm serve` process harness: a server on a free port of 127.0.0.1 in its own
process group, its output in a log file; the fleet suites' API helpers (keys, JSONL files, batch
lines, waits on a batch's status, OpenAI-shaped output checks); and the abuse suite's server
(`start_serve`: SQLite, the in-memory broker and small limits).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from batchllm.api import keys
from batchllm.settings import Settings
from batchllm.store.db import get_engine, session_scope
from tests.support import job_checks
from tests.support.cli import kill_group, start_batchllm
from tests.support.fleet import HOST, FleetEnv, Worker
from tests.support.ports import free_port

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types import Batch, FileObject

T = TypeVar("T")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"


# -- the server ----------------------------------------------------------------------------


class Server:
    """A `batchllm serve` process in its own process group, its output in a log file."""

    def __init__(self, env: dict[str, str], log_path: Path, *args: str) -> None:
        self.env, self.args, self.log_path = env, args, log_path
        self._log = log_path.open("wb")
        self._launch()

    def _launch(self) -> None:
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        env, args = self.env, self.args
        self.proc = start_batchllm(
            ["serve", "--host", HOST, "--port", str(self.port), *args], env=env, log=self._log
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def rss_bytes(self, field: str = "VmRSS") -> int:
        """Resident memory: all of it (VmRSS), or its anonymous part (RssAnon: the heap, what
        a leak grows, without the pages of files and libraries, which come and go with what
        runs and with other processes' memory pressure)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field}")

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        relaunches = 0
        while True:
            if self.proc.poll() is not None:
                # free_port's port can be taken by another process (another session's server)
                # before serve binds it: a new port, not a failed test.
                if "address already in use" in self.tail(5) and relaunches < 3:
                    relaunches += 1
                    self._launch()
                    continue
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).json() == {"status": "ok"}:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"serve not up after {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its own group (only what it started) if it does not go."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
        self._log.close()


# -- a server with a fleet behind it -------------------------------------------------------


@dataclass
class Api:
    fleet_env: FleetEnv
    server: Server
    worker: Worker
    model: str
    keys: dict[str, str]

    def client(self, key: str | None = None, **options: Any) -> OpenAI:
        from openai import OpenAI

        # No retries: a 409 or 5xx must show, not be retried away.
        return OpenAI(
            base_url=f"{self.server.base_url}/v1",
            api_key=key if key is not None else self.keys["alice"],
            max_retries=0,
            timeout=120,
            **options,
        )

    def wait_model_served(self, timeout: float = 60) -> None:
        """Until the worker has announced its model (GET /v1/models lists it): only then does
        a batch for it pass the create's served-model check without a configured list. The
        announcement follows the worker's "ready" by a moment (a thread of the worker)."""
        wait_for(
            lambda: self.model in {m.id for m in self.client().models.list().data} or None,
            timeout=timeout,
            what=lambda: f"the worker to announce {self.model}" + self.logs(),
        )

    def logs(self) -> str:
        return (
            f"\n--- serve log (tail) ---\n{self.server.tail()}"
            f"\n--- worker log (tail) ---\n{self.worker.tail()}"
        )

    @property
    def files_dir(self) -> Path:
        return Path(self.fleet_env.settings.resolved_storage) / "files"


def create_key(fleet_env: FleetEnv, name: str) -> str:
    done = fleet_env.cli("keys", "create", name)
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip()
    assert key.startswith("sk-batchllm-") and "\n" not in key, done.stdout
    return key


def wait_for(check: Callable[[], T | None], *, timeout: float, what: Callable[[], str]) -> T:
    return job_checks.wait_for(check, timeout=timeout, what=what, interval=0.5)


def wait_status(api: Api, client: OpenAI, batch_id: str, status: str, timeout: float) -> Batch:
    last: list[Batch] = []

    def reached() -> Batch | None:
        batch = client.batches.retrieve(batch_id)
        last[:] = [batch]
        if batch.status in ("failed", "completed", "cancelled", "expired"):
            assert batch.status == status, f"batch {batch.status}: {batch}{api.logs()}"
            return batch
        return None

    return wait_for(
        reached,
        timeout=timeout,
        what=lambda: f"batch {batch_id} to be {status} (last: {last}){api.logs()}",
    )


def jsonl(lines: list[dict[str, Any] | str]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def upload(client: OpenAI, content: bytes, name: str = "input.jsonl") -> FileObject:
    file = client.files.create(file=(name, content), purpose="batch")
    assert (file.purpose, file.bytes, file.filename) == ("batch", len(content), name)
    return file


def post_batch(
    client: Any,
    content: bytes,
    *,
    headers: dict[str, str] | None = None,
    filename: str = "input.jsonl",
    content_type: str | None = "application/jsonl",
) -> Any:
    """Upload `content` and create a chat batch of it over plain HTTP, as the Batch API's
    clients do (`client`: an httpx.Client on the server or Starlette's TestClient); the
    create's response. The upload must succeed."""
    file = (filename, content) if content_type is None else (filename, content, content_type)
    upload = client.post(
        "/v1/files", headers=headers, files={"file": file}, data={"purpose": "batch"}
    )
    assert upload.status_code == 200, upload.text
    body = {"input_file_id": upload.json()["id"], "endpoint": CHAT, "completion_window": "24h"}
    return client.post("/v1/batches", headers=headers, json=body)


def read_jsonl(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    stored = client.files.retrieve(file_id)
    content = client.files.content(file_id).content
    assert (stored.purpose, stored.bytes) == ("batch_output", len(content))
    return [json.loads(line) for line in content.decode().splitlines()]


def chat_line(model: str, custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"Say something about {custom_id}."}],
            "max_tokens": 8,
            "temperature": 0,
            **body,
        },
    }


def completion_line(model: str, custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"model": model, "prompt": f"Once upon {custom_id}", "max_tokens": 8, **body},
    }


def assert_ok_lines(
    lines: list[dict[str, Any]], response_type: type, model: str
) -> tuple[int, int]:
    """Every output line as OpenAI writes it; returns the summed (prompt, completion) tokens."""
    prompt = completion = 0
    for line in lines:
        assert line["id"].startswith("batch_req_") and line["error"] is None, line
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"], line
        body = response_type.model_validate(response["body"])
        assert body.model == model and len(body.choices) == 1
        assert body.usage is not None
        assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
        prompt += body.usage.prompt_tokens
        completion += body.usage.completion_tokens
    assert len({line["id"] for line in lines}) == len(lines)
    return prompt, completion


def assert_invalid_lines(lines: list[dict[str, Any]], params: dict[str, str | None]) -> None:
    """Every error line a 400 answer naming the parameter at fault, as OpenAI writes it."""
    from openai.types.shared import ErrorObject

    assert sorted(line["custom_id"] for line in lines) == sorted(params)
    for line in lines:
        assert line["id"].startswith("batch_req_") and line["error"] is None, line
        assert line["response"]["status_code"] == 400, line
        error = ErrorObject.model_validate(line["response"]["body"]["error"])
        assert error.type == "invalid_request_error" and error.message and error.code, line
        assert error.param == params[line["custom_id"]], line


# -- the abuse suite's server (tests/security) ---------------------------------------------

# Small, so that abuse is cheap to send.
MAX_FILE_BYTES = 2 * 1024 * 1024
MAX_STORED_BYTES = 5 * 1024 * 1024
MAX_ACTIVE_BATCHES = 3
HEADER_TIMEOUT = 4.0
RECONCILE_SECONDS = 1.0
# The model the abuse suites' batches name (`Served` configures it: no worker runs there).
SERVED_MODEL = "tiny"


class Served(Server):
    """A `batchllm serve` with a private BATCHLLM_HOME (SQLite), a private TMPDIR (whose bytes
    the upload tests measure) and the in-memory broker: a batch is recorded and "dispatched" to
    nowhere (no Redis, no worker), so it stays in progress until its window passes."""

    def __init__(
        self, work: Path, *args: str, database_url: str | None = None, **env_extra: str
    ) -> None:
        home, self.tmpdir = work / "home", work / "tmp"
        self.tmpdir.mkdir(parents=True)
        env = {
            **os.environ,
            "BATCHLLM_HOME": str(home),
            "BATCHLLM_BROKER_URL": "memory://",
            "BATCHLLM_API_MAX_FILE_BYTES": str(MAX_FILE_BYTES),
            "BATCHLLM_API_MAX_STORED_BYTES": str(MAX_STORED_BYTES),
            "BATCHLLM_API_MAX_ACTIVE_BATCHES": str(MAX_ACTIVE_BATCHES),
            "BATCHLLM_API_HEADER_TIMEOUT": str(HEADER_TIMEOUT),
            "BATCHLLM_RECONCILE_SECONDS": str(RECONCILE_SECONDS),
            # No worker announces a model on this broker: the model its batches name is
            # configured, as a deployment's first batches before any worker need.
            "BATCHLLM_SERVED_MODELS": json.dumps([SERVED_MODEL]),
            "TMPDIR": str(self.tmpdir),
            **env_extra,
        }
        for name in ("BATCHLLM_DATABASE_URL", "BATCHLLM_STORAGE"):
            env.pop(name, None)
        if database_url is not None:  # e.g. a PostgreSQL database instead of the home's SQLite
            env["BATCHLLM_DATABASE_URL"] = database_url
        # The same database and storage, for keys and direct checks.
        self.settings = Settings(
            home=home, database_url=database_url, storage=None, broker_url="memory://"
        )
        super().__init__(env, work / "serve.log", *args)

    def new_key(self, name: str = "tenant") -> dict[str, str]:
        """The Authorization header of a fresh key: a tenant of its own."""
        with session_scope(self.settings) as session:
            _, key = keys.create_key(session, name)
        return {"Authorization": f"Bearer {key}"}


def start_serve(
    work: Path, *args: str, database_url: str | None = None, **env_extra: str
) -> Served:
    served = Served(work, *args, database_url=database_url, **env_extra)
    try:
        served.wait_healthy(60)
    except BaseException:
        served.stop()
        raise
    return served


def stop_serve(served: Served) -> None:
    served.stop()


@contextmanager
def running_serve(
    work: Path, *args: str, database_url: str | None = None, **env_extra: str
) -> Iterator[Served]:
    """start_serve's server for the block; then stopped, and this process's engine of its
    database disposed (its pooled connections closed: a PostgreSQL database can be dropped)."""
    served = start_serve(work, *args, database_url=database_url, **env_extra)
    try:
        yield served
    finally:
        stop_serve(served)
        get_engine(served.settings).dispose()
