"""Polls on threads of their own (api/polls.py): with every request thread held by slow work,
GET of a batch and of a page of batches are still answered, while another route waits for a
request thread."""

from __future__ import annotations

import asyncio
import threading

import httpx
from anyio import to_thread

from batchllm.api.app import create_app
from batchllm.settings import Settings


def test_polls_are_answered_while_every_request_thread_is_held(tmp_path):
    asyncio.run(_polls_beside_held_threads(tmp_path))


async def _until(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _polls_beside_held_threads(tmp_path) -> None:
    settings = Settings(home=tmp_path, api_threads=1, api_poll_threads=1)
    app = create_app(settings, auth=False, expire_batches=False)
    request_threads = to_thread.current_default_thread_limiter()  # this loop's own
    request_threads.total_tokens = 1  # what the app's lifespan sets from api_threads
    release = threading.Event()
    # Slow work (an upload, a big file's create) holding the one request thread.
    holder = asyncio.create_task(to_thread.run_sync(release.wait))
    await _until(lambda: request_threads.borrowed_tokens == 1)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
            listed = await asyncio.wait_for(client.get("/v1/batches"), 60)
            assert listed.status_code == 200, listed.text
            assert listed.json()["data"] == []
            missing = await asyncio.wait_for(client.get("/v1/batches/batch_0123abcd"), 60)
            assert missing.status_code == 404, missing.text

            # A route on the request threads waits for the held one, and answers once free.
            files = asyncio.create_task(client.get("/v1/files"))
            await asyncio.sleep(0.5)
            assert not files.done()
            release.set()
            answered = await asyncio.wait_for(files, 60)
            assert answered.status_code == 200, answered.text
    finally:
        release.set()
        await holder
