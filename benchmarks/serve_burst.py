"""A burst against `batchllm serve` (issue 66): C clients poll one batch back to back for S
seconds through a private server (SQLite, no worker), with load shedding at
BATCHLLM_API_MAX_IN_FLIGHT and without it, side by side in one run: answered requests, their
p50/p99, the 503s (each must carry Retry-After) and the first answer after the burst.

    python -m benchmarks.serve_burst --clients 500 --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from batchllm.process.ports import free_port

NO_CAP = "100000"  # more than any burst: shedding off
LINES = b"".join(
    b'{"custom_id": "c%d", "method": "POST", "url": "/v1/chat/completions", "body": '
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}}\n' % i
    for i in range(3)
)


class Server:
    """`batchllm serve` on a free port with a home of its own (SQLite) and the in-memory broker
    (no worker: the batch stays in progress), ended by PID."""

    def __init__(
        self,
        cap: str,
        *,
        database_url: str | None = None,
        extra_env: dict[str, str] | None = None,
        processes: int = 1,
    ) -> None:
        """`processes`: `serve --workers`; with more than one, self.proc is their parent."""
        from batchllm.api import keys
        from batchllm.settings import Settings
        from batchllm.store.db import session_scope

        self.home = Path(tempfile.mkdtemp(prefix="batchllm-burst-"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
        env.update(
            BATCHLLM_HOME=str(self.home),
            BATCHLLM_BROKER_URL="memory://",
            # No worker registry on that broker: the batches' model is configured, as a
            # deployment whose workers are not up yet does (serve refuses an unserved model).
            BATCHLLM_SERVED_MODELS='["m"]',
            BATCHLLM_API_MAX_IN_FLIGHT=cap,
        )
        if database_url is not None:  # a database of the caller's, at the newest schema
            env["BATCHLLM_DATABASE_URL"] = database_url
        env.update(extra_env or {})
        settings = Settings(home=self.home, broker_url="memory://", database_url=database_url)
        with session_scope(settings) as session:
            _, key = keys.create_key(session, "burst")
        self.headers = {"Authorization": f"Bearer {key}"}
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = (self.home / "serve.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchllm", "serve", "--host", "127.0.0.1", "--port", str(port)]
            + (["--workers", str(processes)] if processes > 1 else []),
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve did not start: see {self.home / 'serve.log'}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.home, ignore_errors=True)


async def _poll(session: Any, path: str, stop: float, seen: dict[str, Any]) -> None:
    import aiohttp

    while time.monotonic() < stop:
        started = time.monotonic()
        try:
            async with session.get(path) as response:
                await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            seen["errors"][type(exc).__name__] = seen["errors"].get(type(exc).__name__, 0) + 1
            continue
        seen["codes"][response.status] = seen["codes"].get(response.status, 0) + 1
        if response.status == 200:
            seen["latencies"].append(time.monotonic() - started)
        elif response.status == 503:
            retry_after = response.headers.get("Retry-After")
            if retry_after is None:
                seen["no_retry_after"] += 1
                continue
            await asyncio.sleep(float(retry_after))


def burst(cap: str, *, clients: int, seconds: float) -> dict[str, Any]:
    served = Server(cap)
    try:
        with httpx.Client(base_url=served.base_url, headers=served.headers, timeout=60) as client:
            uploaded = client.post(
                "/v1/files", files={"file": ("a.jsonl", LINES)}, data={"purpose": "batch"}
            ).json()
            batch = client.post(
                "/v1/batches",
                json={
                    "input_file_id": uploaded["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            ).json()
            path = f"/v1/batches/{batch['id']}"
            seen: dict[str, Any] = {
                "latencies": [],
                "codes": {},
                "errors": {},
                "no_retry_after": 0,
            }

            async def run() -> None:
                # aiohttp (vLLM's dependency), not httpx: one httpx.AsyncClient made ~120
                # requests a second here, its own CPU the limit (aiohttp ~1,700 to /health),
                # so the burst measured the client more than the server.
                import aiohttp

                async with aiohttp.ClientSession(
                    served.base_url,
                    headers=served.headers,
                    timeout=aiohttp.ClientTimeout(total=60),
                    connector=aiohttp.TCPConnector(limit=clients + 100),
                ) as polling:
                    stop = time.monotonic() + seconds
                    await asyncio.gather(
                        *(_poll(polling, path, stop, seen) for _ in range(clients))
                    )

            asyncio.run(run())
            started = time.monotonic()
            after = client.get(path)
            first_after = time.monotonic() - started
    finally:
        served.stop()
    latencies = sorted(seen["latencies"])

    def quantile(q: float) -> float:
        return latencies[int(q * (len(latencies) - 1))] if latencies else float("nan")

    return {
        "cap": cap,
        "answered": len(latencies),
        "p50_s": quantile(0.5),
        "p99_s": quantile(0.99),
        "codes": seen["codes"],
        "errors": seen["errors"],
        "shed_without_retry_after": seen["no_retry_after"],
        "first_answer_after_s": first_after,
        "first_answer_after_status": after.status_code,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--cap", default="64", help="BATCHLLM_API_MAX_IN_FLIGHT to measure")
    args = parser.parse_args(argv)
    for cap in (NO_CAP, args.cap):
        row = burst(cap, clients=args.clients, seconds=args.seconds)
        label = "no shedding" if cap == NO_CAP else f"shedding at {cap}"
        print(
            f"{label}: {row['answered']:,} answered, p50 {row['p50_s']:.3f} s, "
            f"p99 {row['p99_s']:.3f} s, statuses {row['codes']}, errors {row['errors']}, "
            f"503s without Retry-After {row['shed_without_retry_after']}, first answer after "
            f"the burst {row['first_answer_after_s'] * 1000:.0f} ms "
            f"({row['first_answer_after_status']})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
