"""What the Batch API suites (tests/integration/test_batch_api*.py, test_api_s3.py) share on top
of tests/support/serve.py: clients that validate every response with the openai SDK's own
models, the worker and servers a module's fixture starts and stops, and the shape OpenAI's
batch output gives each line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.fleet import Worker, stop_workers
from tests.support.serve import Api, Server

if TYPE_CHECKING:
    from openai import OpenAI


class StrictApi(Api):
    """Clients that validate every response with the SDK's own models."""

    def client(self, key: str | None = None, **options: Any) -> OpenAI:
        return super().client(key, _strict_response_validation=True, **options)


def api_worker(
    name: str, model: Path, env: dict[str, str], work: Path, engine_args: tuple[str, ...]
) -> Worker:
    """The one worker behind a module's servers, its engine's OpenMP threads on core 0, its log
    work/worker.log."""
    return Worker(
        name,
        model=model,
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0"},
        log_path=work / "worker.log",
        engine_args=engine_args,
    )


@contextmanager
def serving(worker: Worker, *servers: Server) -> Iterator[None]:
    """Until each server answers /health and the worker is ready; stops them all at the end,
    whatever happened."""
    try:
        for server in servers:
            server.wait_healthy()
        worker.wait_ready()
        yield
    finally:
        for server in servers:
            server.stop()
        stop_workers([worker])


def assert_line_shapes(lines: list[dict[str, Any]]) -> None:
    """Each line as OpenAI's batch output writes it (vLLM's BatchRequestOutput): exactly one of
    an answer (status code, request id, body) and an error (code, message)."""
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"}, line
        assert line["id"].startswith("batch_req_") and isinstance(line["custom_id"], str), line
        response, error = line["response"], line["error"]
        assert (response is None) != (error is None), line
        if response is not None:
            assert isinstance(response["status_code"], int) and response["request_id"], line
            assert isinstance(response["body"], dict), line
        if error is not None:
            assert set(error) == {"code", "message"} and error["code"] and error["message"], line
