"""A database with history: 10,000 Batch API jobs (100k shards, 500k checkpoints) in a private
PostgreSQL, and what the everyday reads cost on it: `batchllm status`, `batchllm jobs`,
GET /v1/batches and /v1/batches/{id}, the dashboard's jobs page and a reconciler pass. Every SQL
statement each sends is timed; PostgreSQL's own execution time is summed (EXPLAIN ANALYZE) and
the slowest statement's plan is kept, so an index is added where a plan says so.

    python -m benchmarks.history_run --jobs 10000 --output docs/bench-history.json

Several sizes, one after the other, each in a fresh database, and a table of each operation's
time at each size with the ratio to the first (the Batch API's reads must stay flat as a key's
history grows):

    python -m benchmarks.history_run --jobs 100,100000 --shards-per-job 1 --checkpoints-per-shard 1

`--database sqlite` measures the API's default database (a file in --work-dir) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchllm.process.services import RedisServer
from benchmarks.history import (
    CHECKPOINTS_PER_SHARD,
    SHARDS_PER_JOB,
    StatementLog,
    explain,
    populate,
    timed,
)
from benchmarks.private_postgres import PostgresCluster


def measure_history(
    jobs: int,
    work_dir: Path,
    *,
    shards_per_job: int = SHARDS_PER_JOB,
    checkpoints_per_shard: int = CHECKPOINTS_PER_SHARD,
    database: str = "postgresql",
    repeats: int = 5,
) -> dict[str, Any]:
    from click.testing import CliRunner
    from fastapi.testclient import TestClient

    from batchllm.api.app import create_app
    from batchllm.api.dashboard.queries import job_page, key_quota
    from batchllm.api.dashboard.session import Viewer
    from batchllm.api.keys import create_key
    from batchllm.cli import cli
    from batchllm.store.db import get_engine, session_scope, upgrade
    from batchllm.worker.reconciler import reconcile_once

    postgres = PostgresCluster() if database == "postgresql" else None
    redis = RedisServer(work_dir=work_dir / "redis")
    if postgres is not None:
        postgres.start_new()
        url = postgres.url
    else:
        sqlite_file = work_dir / f"history-{jobs}.db"
        for stale in work_dir.glob(f"history-{jobs}.db*"):
            stale.unlink()
        url = f"sqlite:///{sqlite_file}"
    redis.start()
    try:
        upgrade(url)
        env = {
            "BATCHLLM_DATABASE_URL": url,
            "BATCHLLM_BROKER_URL": redis.url,
            "BATCHLLM_HOME": str(work_dir / "home"),
            "BATCHLLM_STORAGE": str(work_dir / "storage"),
        }
        os.environ.update(env)
        from batchllm.settings import get_settings

        get_settings.cache_clear()
        settings = get_settings()
        with session_scope(settings) as session:
            key_row, key = create_key(session, "bench")
        started = time.perf_counter()
        ids = populate(
            settings,
            jobs,
            owner=key_row.id,
            shards_per_job=shards_per_job,
            checkpoints_per_shard=checkpoints_per_shard,
        )
        populate_s = time.perf_counter() - started
        engine = get_engine(settings)
        log = StatementLog(engine)
        runner = CliRunner()
        client = TestClient(create_app(settings))
        headers = {"Authorization": f"Bearer {key}"}
        old, newest = ids[len(ids) // 2], ids[-1]
        viewer = Viewer(owner=key_row.id, name="bench", admin=False, login=True)

        def cli_ok(*args: str) -> Callable[[], None]:
            def run() -> None:
                result = runner.invoke(cli, list(args), env=env, catch_exceptions=False)
                assert result.exit_code == 0, result.output

            return run

        def api_ok(path: str) -> Callable[[], None]:
            def run() -> None:
                response = client.get(path, headers=headers)
                assert response.status_code == 200, response.text

            return run

        def dashboard_jobs_page() -> None:
            # What GET /ui (and each refresh of its live part) reads, in its one session.
            with session_scope(settings) as session:
                job_page(session, viewer, status=None, model=None, page=1)
                key_quota(session, viewer, settings)

        operations = {
            f"status (an ended job, {shards_per_job} shards)": cli_ok("status", old),
            "status (a running job)": cli_ok("status", newest),
            "jobs": cli_ok("jobs"),
            "API GET /v1/batches": api_ok("/v1/batches?limit=20"),
            "API GET /v1/batches/{id}": api_ok(f"/v1/batches/{old}"),
            "dashboard jobs page": dashboard_jobs_page,
            "reconciler pass": lambda: reconcile_once(lambda shard, queue: None, settings),
        }
        figures = {name: timed(operation, log, repeats) for name, operation in operations.items()}
        for figure in figures.values():
            if figure["slowest"]:
                figure["explain_slowest"] = explain(engine, figure["slowest"][0])
            for statement in figure["slowest"]:
                del statement["full_sql"]
        with engine.connect() as conn:
            counts = {
                t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar()
                for t in ("jobs", "shards", "checkpoints", "batches")
            }
        client.close()
        engine.dispose()
        return {
            "database": database,
            "rows": counts,
            "populate_s": populate_s,
            "operations": figures,
        }
    finally:
        redis.stop()
        if postgres is not None:
            postgres.destroy()


def table(runs: dict[int, dict[str, Any]]) -> str:
    """Each operation's median wall ms (its statements) at each size, and the ratio of the
    largest size's median to the smallest's."""
    sizes = sorted(runs)
    names = list(runs[sizes[0]]["operations"])
    header = ["operation", *(f"{n:,} jobs" for n in sizes)]
    if len(sizes) > 1:
        header.append(f"x ({sizes[-1]:,} / {sizes[0]:,})")
    lines = [header]
    for name in names:
        cells = [name]
        for n in sizes:
            op = runs[n]["operations"][name]
            cells.append(f"{op['median_ms']:.1f} ms ({op['statements']} st)")
        if len(sizes) > 1:
            first = runs[sizes[0]]["operations"][name]["median_ms"]
            last = runs[sizes[-1]]["operations"][name]["median_ms"]
            cells.append(f"{last / first:.2f}")
        lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in lines
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jobs",
        type=lambda text: [int(n.replace("_", "")) for n in text.split(",")],
        default=[10_000],
        help="jobs (one key's batches) to populate; a comma list measures each size in turn",
    )
    parser.add_argument("--shards-per-job", type=int, default=SHARDS_PER_JOB)
    parser.add_argument("--checkpoints-per-shard", type=int, default=CHECKPOINTS_PER_SHARD)
    parser.add_argument("--database", choices=("postgresql", "sqlite"), default="postgresql")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each operation")
    parser.add_argument("--work-dir", type=Path, default=Path(".bench-history"))
    parser.add_argument("--output", type=Path, default=None, help="every figure, as JSON")
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    for jobs in args.jobs:
        runs[jobs] = measure_history(
            jobs,
            args.work_dir,
            shards_per_job=args.shards_per_job,
            checkpoints_per_shard=args.checkpoints_per_shard,
            database=args.database,
            repeats=args.repeats,
        )
        rows = ", ".join(f"{n:,} {t}" for t, n in runs[jobs]["rows"].items())
        print(f"{jobs:,} jobs: {rows}; populated in {runs[jobs]['populate_s']:.1f} s", flush=True)
    command = "python -m benchmarks.history_run " + " ".join(argv or sys.argv[1:])
    figures: dict[str, Any] = runs[args.jobs[0]] if len(args.jobs) == 1 else {"runs": runs}
    figures["command"] = command
    figures["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.output:
        args.output.write_text(json.dumps(figures, indent=1, default=str) + "\n")
    print(table(runs))


if __name__ == "__main__":
    main()
