"""A database with history: 10,000 Batch API jobs (100k shards, 500k checkpoints) in a private
PostgreSQL, and what the everyday reads cost on it: `batchllm status`, `batchllm jobs`,
GET /v1/batches and /v1/batches/{id}, and a reconciler pass. Every SQL statement each sends is
timed; PostgreSQL's own execution time is summed (EXPLAIN ANALYZE) and the slowest statement's
plan is kept, so an index is added where a plan says so.

    python -m benchmarks.history_run --jobs 10000 --output docs/bench-history.json
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

from batchllm.process.services import PostgresCluster, RedisServer
from benchmarks.history import StatementLog, explain, populate, timed


def measure_history(jobs: int, work_dir: Path) -> dict[str, Any]:
    from click.testing import CliRunner
    from fastapi.testclient import TestClient

    from batchllm.api.app import create_app
    from batchllm.api.keys import create_key
    from batchllm.cli import cli
    from batchllm.store.db import get_engine, session_scope, upgrade
    from batchllm.worker.reconciler import reconcile_once

    postgres, redis = PostgresCluster(), RedisServer(work_dir=work_dir / "redis")
    postgres.start_new()
    redis.start()
    try:
        upgrade(postgres.url)
        env = {
            "BATCHLLM_DATABASE_URL": postgres.url,
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
        ids = populate(settings, jobs, owner=key_row.id)
        populate_s = time.perf_counter() - started
        engine = get_engine(settings)
        log = StatementLog(engine)
        runner = CliRunner()
        client = TestClient(create_app(settings))
        headers = {"Authorization": f"Bearer {key}"}
        old, newest = ids[len(ids) // 2], ids[-1]

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

        operations = {
            "status (an ended job, 10 shards)": cli_ok("status", old),
            "status (a running job)": cli_ok("status", newest),
            "jobs": cli_ok("jobs"),
            "API GET /v1/batches": api_ok("/v1/batches?limit=20"),
            "API GET /v1/batches/{id}": api_ok(f"/v1/batches/{old}"),
            "reconciler pass": lambda: reconcile_once(lambda shard, queue: None, settings),
        }
        figures = {name: timed(operation, log) for name, operation in operations.items()}
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
        return {"rows": counts, "populate_s": populate_s, "operations": figures}
    finally:
        redis.stop()
        postgres.destroy()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--work-dir", type=Path, default=Path(".bench-history"))
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    figures = measure_history(args.jobs, args.work_dir)
    figures["command"] = "python -m benchmarks.history_run " + " ".join(argv or sys.argv[1:])
    figures["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = json.dumps(figures, indent=1, default=str)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
