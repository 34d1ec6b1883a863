"""Load shedding in `batchllm serve` (api/guard.py): past BATCHLLM_API_MAX_IN_FLIGHT requests in
the server, one more is answered 503 with Retry-After at once, not queued without bound;
/health and /metrics are answered whatever the load."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from batchllm.api.guard import RequestGuard
from batchllm.settings import Settings


class HeldApp:
    """An ASGI app whose answers wait until the test lets them go, counting what reached it."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.reached: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.reached.append(scope["path"])
        if scope["path"] not in ("/health", "/metrics"):
            await self.gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve")


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_one_request_past_the_cap_is_shed_at_once_with_retry_after_and_the_rest_answer(
    tmp_path,
):
    asyncio.run(_one_past_the_cap(tmp_path))


async def _one_past_the_cap(tmp_path) -> None:
    held = HeldApp()
    guard = RequestGuard(held, settings=Settings(home=tmp_path, api_max_in_flight=2), auth=False)
    async with _client(guard) as client:
        first = asyncio.create_task(client.get("/v1/batches"))
        second = asyncio.create_task(client.get("/v1/batches/batch_1"))
        await _until(lambda: len(held.reached) == 2)
        assert guard.in_flight == 2

        shed = await client.post("/v1/batches", json={"input_file_id": "file-1"})
        assert shed.status_code == 503
        assert shed.headers["retry-after"] == "1"
        assert shed.headers["connection"] == "close"  # its body was never read
        error = shed.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "server_overloaded")
        assert "BATCHLLM_API_MAX_IN_FLIGHT" in error["message"]
        # Liveness and metrics are never shed.
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        assert held.reached == ["/v1/batches", "/v1/batches/batch_1", "/health", "/metrics"]

        held.gate.set()
        assert [(await first).status_code, (await second).status_code] == [200, 200]
        assert guard.in_flight == 0
        # Room again: the next request is answered.
        assert (await client.get("/v1/batches")).status_code == 200


def test_a_request_that_fails_inside_still_gives_its_place_back(tmp_path):
    asyncio.run(_failing_inside(tmp_path))


async def _failing_inside(tmp_path) -> None:
    async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise RuntimeError("a bug in a route")

    guard = RequestGuard(failing, settings=Settings(home=tmp_path, api_max_in_flight=1), auth=False)
    async with _client(guard) as client:
        for _ in range(3):
            with pytest.raises(RuntimeError):
                await client.get("/v1/files")
    assert guard.in_flight == 0
