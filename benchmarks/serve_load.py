"""A load check of `batchllm serve`: phases one after another against one private server
(a home of its own, the in-memory broker, no worker; SQLite unless --database-url names a
PostgreSQL server, where a fresh database is made and dropped), one line of figures each:

- polling: C clients back to back for S seconds, GET /v1/batches/{id} (80%) or
  GET /v1/batches?limit=20 (20%): answered requests a second, p50/p95/p99, statuses, errors;
- creates: N batches (POST /v1/files + POST /v1/batches) from 8 clients: creates a second,
  errors, the server's open files and RSS before, halfway and after, and their growth per
  create over the run and over its second half (the slope once warm);
- uploads: U uploads of M MiB of batch lines at once: seconds per upload, then each file
  downloaded again and its SHA-256 compared;
- overload: benchmarks.serve_burst's burst (its own fresh SQLite server) at the default
  BATCHLLM_API_MAX_IN_FLIGHT: answered, p50/p99, statuses, 503s without Retry-After, first
  answer after the burst.

    python -m benchmarks.serve_load --clients 100 --seconds 15 --creates 1500 \\
        --uploads 8 --upload-mib 20 --burst-clients 500 --burst-seconds 15 --output load.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serve_burst import LINES, Server, burst

PHASES = ("polling", "creates", "uploads", "overload")
CREATE_CLIENTS = 8
SEED_BATCHES = 20  # a full first page for GET /v1/batches?limit=20
TIMEOUT = httpx.Timeout(300.0, connect=30.0)


def default_in_flight() -> int:
    from batchllm.settings import Settings

    value = Settings.model_fields["api_max_in_flight"].default
    assert isinstance(value, int)
    return value


def quantiles(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)

    def at(q: float) -> float:
        return ordered[int(q * (len(ordered) - 1))] if ordered else float("nan")

    return {"p50_s": at(0.5), "p95_s": at(0.95), "p99_s": at(0.99)}


def count(counts: dict[str, int], key: object) -> None:
    counts[str(key)] = counts.get(str(key), 0) + 1


def process_figures(pid: int) -> dict[str, int]:
    """The server's open files and resident memory, from /proc: all of it (VmRSS) and its
    anonymous part (RssAnon: the heap, what a leak grows; VmRSS also counts pages of the
    libraries, which come and go with what runs and with other processes' memory pressure)."""
    memory = {"VmRSS:": 0, "RssAnon:": 0}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name = line.split(maxsplit=1)[0] if line else ""
        if name in memory:
            memory[name] = int(line.split()[1])
    return {
        "open_files": len(list(Path(f"/proc/{pid}/fd").iterdir())),
        "rss_kib": memory["VmRSS:"],
        "anon_kib": memory["RssAnon:"],
    }


def settled_figures(pid: int) -> dict[str, int]:
    """process_figures once the open files stop changing (the previous phase's connections
    closed), within 10 s."""
    figures = process_figures(pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        figures, previous = process_figures(pid), figures
        if figures["open_files"] == previous["open_files"]:
            break
    return figures


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_serve_process(pid: int) -> None:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"batchllm" not in argv or b"serve" not in argv:
        raise RuntimeError(f"pid {pid} is not `python -m batchllm serve`: {argv!r}")


def batch_file(index: int, mib: float) -> bytes:
    """Valid chat batch lines, unique to `index`, about `mib` MiB (~1 KiB a line, so a 20 MiB
    file stays under BATCHLLM_API_MAX_FILE_LINES)."""
    rng = random.Random(index)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    lines: list[bytes] = []
    size = 0
    while size < mib * 1024 * 1024:
        content = " ".join(rng.choice(words) for _ in range(160))
        line = (
            json.dumps(
                {
                    "custom_id": f"u{index}-{len(lines)}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "m",
                        "messages": [{"role": "user", "content": content}],
                        "max_tokens": 8,
                    },
                }
            ).encode()
            + b"\n"
        )
        lines.append(line)
        size += len(line)
    return b"".join(lines)


async def create_batch(client: httpx.AsyncClient, data: bytes = LINES) -> httpx.Response:
    """POST /v1/files then POST /v1/batches; the first answer that is not a 200."""
    uploaded = await client.post(
        "/v1/files", files={"file": ("a.jsonl", data)}, data={"purpose": "batch"}
    )
    if uploaded.status_code != 200:
        return uploaded
    return await client.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )


def run_async(
    server: Server, clients: int, body: Callable[[httpx.AsyncClient], Awaitable[Any]]
) -> Any:
    async def main() -> Any:
        limits = httpx.Limits(max_connections=clients + 10)
        async with httpx.AsyncClient(
            base_url=server.base_url, headers=server.headers, timeout=TIMEOUT, limits=limits
        ) as client:
            return await body(client)

    return asyncio.run(main())


def polling(server: Server, batch_id: str, *, clients: int, seconds: float) -> dict[str, Any]:
    """On aiohttp (vllm's dependency), not httpx: one httpx.AsyncClient with 64 connections
    made ~120 requests a second here, its own CPU the limit, where aiohttp made ~1,700 to
    /health (measured on this 2-core machine)."""
    import aiohttp

    rng = random.Random(66)
    latencies: list[float] = []
    codes: dict[str, int] = {}
    errors: dict[str, int] = {}

    async def poll(session: aiohttp.ClientSession, stop: float) -> None:
        while time.monotonic() < stop:
            path = f"/v1/batches/{batch_id}" if rng.random() < 0.8 else "/v1/batches?limit=20"
            started = time.monotonic()
            try:
                async with session.get(path) as response:
                    await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                count(errors, type(exc).__name__)
                continue
            count(codes, response.status)
            if response.status == 200:
                latencies.append(time.monotonic() - started)
            elif response.status == 503 and "Retry-After" in response.headers:
                wait = float(response.headers["Retry-After"])
                await asyncio.sleep(max(0.0, min(wait, stop - time.monotonic())))

    async def main() -> float:
        async with aiohttp.ClientSession(
            server.base_url,
            headers=server.headers,
            timeout=aiohttp.ClientTimeout(total=TIMEOUT.read),
            connector=aiohttp.TCPConnector(limit=clients + 10),
        ) as session:
            started = time.monotonic()
            await asyncio.gather(*(poll(session, started + seconds) for _ in range(clients)))
            return time.monotonic() - started

    cpu_before = cpu_seconds(server.proc.pid)
    elapsed = asyncio.run(main())
    return {
        "clients": clients,
        "seconds": elapsed,
        "answered": len(latencies),
        "answered_per_s": len(latencies) / elapsed,
        **quantiles(latencies),
        "codes": codes,
        "errors": errors,
        "server_cpu": (cpu_seconds(server.proc.pid) - cpu_before) / elapsed,
        # Steadier than answered/s on a shared machine: what a request costs the server.
        "server_cpu_ms_per_request": (cpu_seconds(server.proc.pid) - cpu_before)
        * 1000
        / max(1, sum(codes.values())),
    }


def creates(server: Server, *, creates: int) -> dict[str, Any]:
    before = settled_figures(server.proc.pid)
    cpu_before = cpu_seconds(server.proc.pid)
    codes: dict[str, int] = {}
    errors: dict[str, int] = {}
    remaining = iter(range(creates))
    deadline = time.monotonic() + 120 + creates  # generous: ~20 creates a second measured
    # Taken when half the creates are answered: the growth over the second half is the
    # slope once the server's pools and caches are warm (a leak keeps it; a plateau not).
    halfway: dict[str, Any] = {}
    samples: list[dict[str, int]] = []
    answered = 0

    async def create_loop(client: httpx.AsyncClient) -> None:
        nonlocal answered
        for _ in remaining:
            if time.monotonic() > deadline:
                count(errors, "deadline")
                continue
            try:
                count(codes, (await create_batch(client)).status_code)
            except httpx.HTTPError as exc:
                count(errors, type(exc).__name__)
            answered += 1
            if answered % max(creates // 10, 1) == 0:  # the curve, in the JSON output
                samples.append({"answered": answered, **process_figures(server.proc.pid)})
            if answered == creates // 2:
                halfway.update(process_figures(server.proc.pid), created=codes.get("200", 0))

    async def body(client: httpx.AsyncClient) -> float:
        started = time.monotonic()
        await asyncio.gather(*(create_loop(client) for _ in range(CREATE_CLIENTS)))
        return time.monotonic() - started

    elapsed = run_async(server, CREATE_CLIENTS, body)
    server_cpu = (cpu_seconds(server.proc.pid) - cpu_before) / elapsed
    after = settled_figures(server.proc.pid)
    created = codes.get("200", 0)
    second_half = max(created - halfway.get("created", 0), 1)
    return {
        "creates": creates,
        "created": created,
        "seconds": elapsed,
        "creates_per_s": created / elapsed,
        "codes": codes,
        "errors": errors,
        "failed": creates - created,
        "before": before,
        "after": after,
        "open_files_per_create": (after["open_files"] - before["open_files"]) / max(created, 1),
        "rss_kib_per_create": (after["rss_kib"] - before["rss_kib"]) / max(created, 1),
        "halfway": halfway,
        "samples": samples,
        "rss_kib_per_create_second_half": (after["rss_kib"] - halfway.get("rss_kib", 0))
        / second_half,
        "anon_kib_per_create_second_half": (after["anon_kib"] - halfway.get("anon_kib", 0))
        / second_half,
        "server_cpu": server_cpu,
    }


def uploads(server: Server, *, uploads: int, mib: float) -> dict[str, Any]:
    files = [batch_file(index, mib) for index in range(uploads)]
    digests = [hashlib.sha256(data).hexdigest() for data in files]
    codes: dict[str, int] = {}
    errors: dict[str, int] = {}

    async def upload(client: httpx.AsyncClient, index: int) -> tuple[float, str | None]:
        started = time.monotonic()
        try:
            response = await client.post(
                "/v1/files",
                files={"file": (f"u{index}.jsonl", files[index])},
                data={"purpose": "batch"},
            )
        except httpx.HTTPError as exc:
            count(errors, type(exc).__name__)
            return time.monotonic() - started, None
        count(codes, response.status_code)
        file_id = response.json()["id"] if response.status_code == 200 else None
        return time.monotonic() - started, file_id

    async def verify(client: httpx.AsyncClient, index: int, file_id: str) -> bool:
        digest = hashlib.sha256()
        async with client.stream("GET", f"/v1/files/{file_id}/content") as response:
            async for chunk in response.aiter_bytes():
                digest.update(chunk)
            return response.status_code == 200 and digest.hexdigest() == digests[index]

    async def body(client: httpx.AsyncClient) -> tuple[list[tuple[float, str | None]], int]:
        done = await asyncio.gather(*(upload(client, index) for index in range(uploads)))
        checks = [verify(client, i, file_id) for i, (_, file_id) in enumerate(done) if file_id]
        matched = await asyncio.gather(*checks)
        return done, len(matched) - sum(matched)

    done, mismatches = run_async(server, uploads, body)
    seconds = sorted(took for took, _ in done)
    return {
        "uploads": uploads,
        "mib": len(files[0]) / 1024 / 1024 if files else 0.0,
        "stored": sum(1 for _, file_id in done if file_id),
        "seconds_per_upload_mean": sum(seconds) / len(seconds) if seconds else float("nan"),
        "seconds_per_upload_max": seconds[-1] if seconds else float("nan"),
        "codes": codes,
        "errors": errors,
        "sha256_mismatches": mismatches,
    }


@contextmanager
def database(url: str | None) -> Iterator[str | None]:
    """None (the server's own SQLite), or a fresh database on the PostgreSQL server `url`
    names, at the newest schema, dropped afterwards (tests/support/services.py's way)."""
    if url is None or not url.startswith("postgresql"):
        yield url
        return
    import psycopg
    from sqlalchemy.engine import make_url

    from batchllm.store.db import upgrade

    server = make_url(url)
    name = f"batchllm_load_{uuid.uuid4().hex[:12]}"
    admin = psycopg.connect(
        host=server.host or "127.0.0.1",
        port=server.port or 5432,
        user=server.username,
        password=server.password,
        dbname=server.database or "test",
        autocommit=True,
        connect_timeout=10,
    )
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            fresh = server.set(database=name).render_as_string(hide_password=False)
            upgrade(fresh)
            yield fresh
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def describe(phase: str, row: dict[str, Any]) -> str:
    if phase == "polling":
        return (
            f"polling ({row['clients']} clients, {row['seconds']:.1f} s): "
            f"{row['answered_per_s']:,.0f} answered/s ({row['answered']:,}), p50 "
            f"{row['p50_s']:.3f} s, p95 {row['p95_s']:.3f} s, p99 {row['p99_s']:.3f} s, "
            f"statuses {row['codes']}, errors {row['errors']}, server CPU {row['server_cpu']:.2f} "
            f"({row['server_cpu_ms_per_request']:.2f} ms a request)"
        )
    if phase == "creates":
        before, after, halfway = row["before"], row["after"], row["halfway"]
        return (
            f"creates ({row['creates']:,} from {CREATE_CLIENTS} clients): "
            f"{row['creates_per_s']:.1f}/s, {row['created']:,} created, {row['failed']} failed, "
            f"statuses {row['codes']}, errors {row['errors']}, server CPU {row['server_cpu']:.2f}; "
            f"open files "
            f"{before['open_files']} -> {after['open_files']} "
            f"({row['open_files_per_create']:+.3f}/create), RSS {before['rss_kib'] / 1024:.0f} "
            f"-> {halfway.get('rss_kib', 0) / 1024:.0f} (halfway) -> "
            f"{after['rss_kib'] / 1024:.0f} MiB ({row['rss_kib_per_create']:+.1f} KiB/create "
            f"over the run, {row['rss_kib_per_create_second_half']:+.1f} over its second half; "
            f"anonymous {row['anon_kib_per_create_second_half']:+.1f})"
        )
    if phase == "uploads":
        return (
            f"uploads ({row['uploads']} x {row['mib']:.1f} MiB at once): {row['stored']} stored, "
            f"{row['seconds_per_upload_mean']:.2f} s per upload (max "
            f"{row['seconds_per_upload_max']:.2f} s), statuses {row['codes']}, errors "
            f"{row['errors']}, SHA-256 mismatches {row['sha256_mismatches']}"
        )
    return (
        f"overload ({row['clients']} clients, {row['seconds']:.0f} s, shedding at {row['cap']}, "
        f"fresh SQLite server): {row['answered']:,} answered, p50 {row['p50_s']:.3f} s, "
        f"p99 {row['p99_s']:.3f} s, statuses {row['codes']}, errors {row['errors']}, "
        f"503s without Retry-After {row['shed_without_retry_after']}, first answer after the "
        f"burst {row['first_answer_after_s'] * 1000:.0f} ms ({row['first_answer_after_status']})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--creates", type=int, default=1500)
    parser.add_argument("--uploads", type=int, default=8)
    parser.add_argument("--upload-mib", type=float, default=20.0)
    parser.add_argument("--burst-clients", type=int, default=500)
    parser.add_argument("--burst-seconds", type=float, default=15.0)
    parser.add_argument(
        "--phases", default=",".join(PHASES), help="comma list of " + ",".join(PHASES)
    )
    parser.add_argument(
        "--database-url",
        help="default: the server's own SQLite; postgresql+psycopg://user@host:port/db makes "
        "a fresh database on that server and drops it at the end",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="serve --workers N for the polling, creates and uploads phases (open files and "
        "RSS are then the parent's only)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the server (repeatable), e.g. BATCHLLM_API_THREADS=8",
    )
    parser.add_argument("--output", type=Path, help="write every figure here as JSON")
    args = parser.parse_args(argv)
    phases = [phase.strip() for phase in args.phases.split(",") if phase.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")

    cap = str(default_in_flight())
    figures: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    server_phases = [phase for phase in phases if phase != "overload"]
    if server_phases:
        # Quotas above anything the run makes: every create must be accepted.
        quota = str(10 * (args.creates + SEED_BATCHES) + 1000)
        extra_env = {
            "BATCHLLM_API_MAX_ACTIVE_BATCHES": quota,
            "BATCHLLM_API_MAX_ENQUEUED_ROWS": str(10 * int(quota)),
            **dict(setting.split("=", 1) for setting in args.env),
        }
        with database(args.database_url) as url:
            server = Server(cap, database_url=url, extra_env=extra_env, processes=args.workers)
            try:
                check_serve_process(server.proc.pid)
                with httpx.Client(
                    base_url=server.base_url, headers=server.headers, timeout=TIMEOUT
                ) as client:
                    batch_ids = []
                    for _ in range(SEED_BATCHES):
                        uploaded = client.post(
                            "/v1/files",
                            files={"file": ("a.jsonl", LINES)},
                            data={"purpose": "batch"},
                        )
                        uploaded.raise_for_status()
                        batch = client.post(
                            "/v1/batches",
                            json={
                                "input_file_id": uploaded.json()["id"],
                                "endpoint": "/v1/chat/completions",
                                "completion_window": "24h",
                            },
                        )
                        batch.raise_for_status()
                        batch_ids.append(batch.json()["id"])
                for phase in server_phases:
                    if phase == "polling":
                        row = polling(
                            server, batch_ids[0], clients=args.clients, seconds=args.seconds
                        )
                    elif phase == "creates":
                        row = creates(server, creates=args.creates)
                    else:
                        row = uploads(server, uploads=args.uploads, mib=args.upload_mib)
                    figures[phase] = row
                    print(describe(phase, row), flush=True)
                if server.proc.poll() is not None:
                    raise RuntimeError(f"serve exited ({server.proc.returncode}) during the run")
                log = (server.home / "serve.log").read_text(errors="replace")
                figures["server_log_tail"] = log.splitlines()[-20:]
                figures["server_log_errors"] = sum(
                    1 for line in log.splitlines() if "Traceback" in line or "ERROR" in line
                )
                print(f"server log: {figures['server_log_errors']} error lines", flush=True)
            finally:
                server.stop()
    if "overload" in phases:
        row = burst(cap, clients=args.burst_clients, seconds=args.burst_seconds)
        row.update(clients=args.burst_clients, seconds=args.burst_seconds)
        figures["overload"] = row
        print(describe("overload", row), flush=True)
    if args.output is not None:
        args.output.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
