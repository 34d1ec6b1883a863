"""How soon `submit` queues a big file's first shard for the fleet, against the time it takes to
validate and store the whole file, side by side on one file: in file order with the context
length given (shards are queued as validation stores them: store/shard_recording.py) and
without it (queued once the whole file is stored; a worker sizes the job's context from all of
its rows), and placed by prompt (the default: shards written, and queued, once the file is read).

Both submit to a private Redis with no worker listening and the embedded SQLite database, so
nothing runs the shards: what is timed is the submit alone. The tasks in Redis are counted
afterwards (one per shard, or the figures are refused) and each job is cancelled.

    python -m benchmarks.first_shard --lines 10000000 --output docs/bench-first-shard.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.bench.parts.overhead import peak_rss, write_lines
from batchllm.process.services import RedisServer, ServiceFailed
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults

MODEL = "bench/first-shard"  # no worker serves it: the tasks stay queued
SHARD_SIZE = 10_000  # the default BATCHLLM_SHARD_SIZE


def queued_tasks(redis: RedisServer, queue: str) -> int:
    """Tasks waiting on the queue: kombu keeps one Redis list per queue and priority step."""
    client = redis.client()
    return sum(
        client.llen(key)
        for key in client.scan_iter(match=queue + "*")
        if client.type(key) == b"list"
    )


def time_submit(
    source: Path, settings: Settings, redis: RedisServer, *, max_model_len: int | None
) -> dict[str, Any]:
    from sqlalchemy import func, select

    from batchllm.input.files.source import resolve_input
    from batchllm.jobs.submit import submit_job
    from batchllm.store import service
    from batchllm.store.db import session_scope
    from batchllm.store.models import Shard
    from batchllm.worker.celery_app import queue_for_job

    spec = JobSpec(
        model=MODEL,
        engine=EngineOptions(max_model_len=max_model_len),
        sampling=SamplingDefaults(max_tokens=32),
    )
    first_task: list[float] = []
    stored_then: list[int] = []

    def first_queued(job_id: str) -> None:  # right before the first task is sent
        first_task.append(time.monotonic())
        with session_scope(settings) as session:
            count = select(func.count()).select_from(Shard).where(Shard.job_id == job_id)
            stored_then.append(int(session.scalar(count) or 0))

    started = time.monotonic()
    job = submit_job(
        resolve_input(source, s3_endpoint=settings.resolved_s3_endpoint),
        spec,
        shard_size=SHARD_SIZE,
        settings=settings,
        before_dispatch=first_queued,
    )
    ended = time.monotonic()
    tasks = queued_tasks(redis, queue_for_job(spec))
    if tasks != job.shards_total:
        raise BenchFailed(f"{tasks} tasks in Redis for {job.shards_total} shards")
    with session_scope(settings) as session:
        service.cancel_job(session, job.id)
    redis.client().flushdb()
    return {
        "max_model_len_given": max_model_len is not None,
        "lines": job.request_total,
        "shards": job.shards_total,
        "status_when_submit_returned": job.status.value,
        "first_shard_queued_s": first_task[0] - started,
        "shards_stored_when_first_queued": stored_then[0],
        "whole_file_stored_s": ended - started,
        "lines_per_s": job.request_total / (ended - started),
    }


def measure(lines: int, work_dir: Path) -> dict[str, Any]:
    from batchllm.bench.contenders import bench_settings

    source = write_lines(
        work_dir / "input.jsonl", lines, model=MODEL, prompt_words=(8, 64), output_tokens=(16, 128)
    )
    redis = RedisServer(work_dir=work_dir / "redis")
    redis.start()
    try:
        runs = []
        # In file order (placement off), the context given and not; then placed, given.
        for max_model_len, placed in ((4096, False), (None, False), (4096, True)):
            home = work_dir / f"home-{max_model_len or 'sized'}-{placed}"
            settings = bench_settings(home)
            settings.broker_url = redis.url
            settings.place_prefixes = placed
            runs.append(time_submit(source, settings, redis, max_model_len=max_model_len))
            shutil.rmtree(home, ignore_errors=True)  # the stored shards: ~0.5 GB a million lines
        return {
            "lines": lines,
            "input_bytes": source.stat().st_size,
            "streamed": runs[0],
            "queued_after_validation": runs[1],
            "placed": runs[2],
            "peak_rss_bytes": peak_rss(),
        }
    finally:
        redis.stop()
        source.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--work-dir", type=Path, default=Path(".bench-first-shard"))
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    figures = measure(args.lines, args.work_dir)
    text = json.dumps(figures, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    try:
        main()
    except (BenchFailed, ServiceFailed) as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        sys.exit(1)
