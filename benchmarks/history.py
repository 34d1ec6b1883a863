"""A database with history, and the tools to see what reads cost on it: `populate` writes
thousands of ended jobs (ten shards each, five checkpoints a shard, unless told fewer: 100,000
jobs of one shard each are written in a minute), StatementLog times every
SQL statement an operation sends, `execution_ms` and `explain` ask PostgreSQL what they cost
it. benchmarks/history_run.py drives them over `status`, `jobs`, the Batch API's list and
retrieve and a reconciler pass (the CLI and the API sit above the bench's layer).
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import event, insert

from batchllm.output.parts import part_name
from batchllm.settings import Settings
from batchllm.store.models import Batch, Checkpoint, Job, Shard, utcnow

SHARDS_PER_JOB = 10
CHECKPOINTS_PER_SHARD = 5
ROWS_PER_SHARD = 10_000
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_CHUNK = 20_000


def populate(
    settings: Settings,
    jobs: int,
    *,
    owner: str,
    live: int = 5,
    shards_per_job: int = SHARDS_PER_JOB,
    checkpoints_per_shard: int = CHECKPOINTS_PER_SHARD,
) -> list[str]:
    """`jobs` jobs, every one a Batch API batch of `owner`, all ended but the last `live`
    (in progress, their shards running), each of `shards_per_job` shards of
    `checkpoints_per_shard` checkpoints; returns their ids, oldest first."""
    from batchllm.store.db import get_engine

    engine = get_engine(settings)
    now = utcnow()
    ids = [f"job_{uuid.uuid4().hex[:16]}" for _ in range(jobs)]
    job_rows, batch_rows, shard_rows, checkpoint_rows = [], [], [], []
    shard_id = checkpoint_id = 0
    for n, job_id in enumerate(ids):
        created = now - timedelta(minutes=jobs - n)
        ended = n < jobs - live
        job_rows.append(
            {
                "id": job_id,
                "status": "completed" if ended else "in_progress",
                "model": MODEL,
                "spec": {"model": MODEL},
                "metadata": {},
                "input_file": f"/data/{job_id}.jsonl",
                "storage_root": "/jobs",
                "output_dir": f"/jobs/{job_id}/output",
                "local_run": False,
                "request_total": shards_per_job * ROWS_PER_SHARD,
                "request_completed": shards_per_job * ROWS_PER_SHARD if ended else 0,
                "request_failed": 0,
                "shards_total": shards_per_job,
                "shards_done": shards_per_job if ended else 0,
                "created_at": created,
                "started_at": created,
                "finished_at": created + timedelta(seconds=50) if ended else None,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "cached_tokens": 0,
                "engine_seconds": 0.0,
                "structured_rows": 0,
                "structured_valid": 0,
            }
        )
        batch_rows.append(
            {
                "job_id": job_id,
                "owner": owner,
                "model": MODEL,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "input_file_id": f"file-{job_id}",
                # Written already (a retrieve of an ended batch without them writes them).
                "output_file_id": f"file-out-{job_id}" if ended else None,
                "error_file_id": f"file-err-{job_id}" if ended else None,
                "created_at": created,
            }
        )
        for index in range(shards_per_job):
            shard_id += 1
            shard_rows.append(
                {
                    "id": shard_id,
                    "job_id": job_id,
                    "index": index,
                    "status": "completed" if ended else "running",
                    "input_path": f"/jobs/{job_id}/input/{index:05d}.parquet",
                    "rows": ROWS_PER_SHARD,
                    "first_line": index * ROWS_PER_SHARD + 1,
                    "last_line": (index + 1) * ROWS_PER_SHARD,
                    "rows_ok": ROWS_PER_SHARD if ended else 0,
                    "rows_failed": 0,
                    "prompt_tokens": 0,
                    "completion_tokens": 0,
                    "engine_seconds": 0.0,
                    "next_seq": checkpoints_per_shard,
                    "attempts": 1,
                    "worker": "w@host",
                    "heartbeat_at": created + timedelta(seconds=40) if ended else now,
                    "dispatched_at": created,
                    "started_at": created,
                    "finished_at": created + timedelta(seconds=40) if ended else None,
                }
            )
            for seq in range(checkpoints_per_shard):
                checkpoint_id += 1
                checkpoint_rows.append(
                    {
                        "id": checkpoint_id,
                        "shard_id": shard_id,
                        "seq": seq,
                        "path": f"/jobs/{job_id}/output/{part_name(index, seq)}",
                        "rows": ROWS_PER_SHARD // checkpoints_per_shard,
                        "rows_ok": ROWS_PER_SHARD // checkpoints_per_shard,
                        "rows_failed": 0,
                        "prompt_tokens": 0,
                        "completion_tokens": 0,
                        "engine_seconds": 0.0,
                        "job_attempt": 1,
                        "created_at": created,
                    }
                )
    with engine.begin() as conn:
        for model, rows in (
            (Job, job_rows),
            (Batch, batch_rows),
            (Shard, shard_rows),
            (Checkpoint, checkpoint_rows),
        ):
            for start in range(0, len(rows), _CHUNK):
                conn.execute(insert(model), rows[start : start + _CHUNK])
        if conn.dialect.name != "postgresql":
            return ids
        for name in ("shards", "checkpoints"):  # explicit ids: move the sequences past them
            conn.exec_driver_sql(
                f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                f"(SELECT max(id) FROM {name}))"
            )
    # Statistics and the visibility map, as autovacuum leaves tables that have settled (a
    # history is written over months, not in one transaction): the plans are the steady ones.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM (ANALYZE)")
    return ids


class StatementLog:
    """Every statement an operation sends, with its time, through the engine's events."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.statements: list[tuple[float, str, Any]] = []

    def _before(self, conn, cursor, statement, parameters, context, executemany) -> None:
        conn.info["bench_started"] = time.perf_counter()

    def _after(self, conn, cursor, statement, parameters, context, executemany) -> None:
        took = (time.perf_counter() - conn.info.pop("bench_started")) * 1000
        self.statements.append((took, statement, parameters))

    @contextmanager
    def recording(self) -> Iterator[list[tuple[float, str, Any]]]:
        self.statements = []
        event.listen(self.engine, "before_cursor_execute", self._before)
        event.listen(self.engine, "after_cursor_execute", self._after)
        try:
            yield self.statements
        finally:
            event.remove(self.engine, "before_cursor_execute", self._before)
            event.remove(self.engine, "after_cursor_execute", self._after)


def timed(operation: Callable[[], Any], log: StatementLog, repeats: int = 5) -> dict[str, Any]:
    """The operation's median wall time over `repeats` warm runs, and its slowest statements
    of the last run."""
    operation()  # warm: imports, the pool's connection, prepared plans
    times = []
    for _ in range(repeats):
        with log.recording() as statements:
            started = time.perf_counter()
            operation()
            times.append((time.perf_counter() - started) * 1000)
    slowest = sorted(statements, key=lambda s: -s[0])[:3]
    return {
        "median_ms": statistics.median(times),
        "max_ms": max(times),
        "statements": len(statements),
        "sql_ms": sum(s[0] for s in statements),
        "db_execution_ms": execution_ms(log.engine, statements),
        "slowest": [
            {"ms": ms, "sql": " ".join(sql.split())[:400], "full_sql": sql, "params": params}
            for ms, sql, params in slowest
        ],
    }


def execution_ms(engine: Any, statements: list[tuple[float, str, Any]]) -> float | None:
    """What the server spent executing the SELECTs (EXPLAIN ANALYZE's Execution Time, summed):
    the database's own cost, free of the client's and of a busy machine's scheduling. None on
    another database (SQLite has no such figure)."""
    if engine.dialect.name != "postgresql":
        return None
    total = 0.0
    with engine.connect() as conn:
        for _, sql, params in statements:
            if not sql.lstrip().upper().startswith("SELECT"):
                continue
            if isinstance(params, list | tuple) and params and isinstance(params[0], dict):
                params = params[0]
            plan = [r[0] for r in conn.exec_driver_sql("EXPLAIN (ANALYZE) " + sql, params)]
            total += sum(float(line.split()[-2]) for line in plan if "Execution Time" in line)
    return total


def explain(engine: Any, statement: dict[str, Any]) -> list[str]:
    """The statement's plan: PostgreSQL's EXPLAIN ANALYZE, SQLite's EXPLAIN QUERY PLAN."""
    with engine.connect() as conn:
        params = statement["params"]
        if isinstance(params, list | tuple) and params and isinstance(params[0], dict):
            params = params[0]
        if engine.dialect.name != "postgresql":
            plan = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement["full_sql"], params)
            return [row[-1] for row in plan]
        plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, COSTS OFF) " + statement["full_sql"], params)
        return [row[0] for row in plan]
