"""Fair share in tokens on a real fleet: one `batchllm worker` on the instant engine with a cost
per token served (BATCHLLM_INSTANT_TOKEN_SECONDS: its time follows tokens, as a real engine's
does), real Redis and PostgreSQL. Two API keys' batches are queued before the worker starts,
one with prompts 20x longer than the other's. While both have work queued, each is served
50% +- 10% of the prompt + output tokens (by turns it was ~75% for the long one here: a long
shard holds 416 tokens, a short one 144), read from the checkpoints the worker committed."""

from __future__ import annotations

import json
import time
from pathlib import Path

from sqlalchemy import select

from batchllm.api import batches, keys
from batchllm.jobs.submit import submit_job
from batchllm.spec import JobSpec, SamplingDefaults
from batchllm.store.db import session_scope
from batchllm.store.models import Checkpoint, Job, Shard
from tests.support.fleet import ENGINE, INSTANT_ARGS, start_workers, stop_workers, tails
from tests.support.inputs import source_of

MAX_TOKENS = 8
LONG_ROWS, LONG_SHARD = 24, 2  # 12 shards
SHORT_ROWS, SHORT_SHARD = 480, 8  # 60 shards: still queued when the long job ends
TOKEN_SECONDS = 0.0002  # ~14,000 tokens served: ~3 s of the engine's time


def _write(path: Path, rows: int, words: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"row {i}: " + " ".join(["word"] * words)}) + "\n"
            for i in range(rows)
        )
    )
    return path


def _submit(fleet_env, source: Path, model: Path, owner: str, shard_size: int) -> str:
    spec = JobSpec(
        model=str(model), engine=ENGINE, sampling=SamplingDefaults(max_tokens=MAX_TOKENS)
    )

    def record(job_id: str) -> None:  # as the Batch API records a key's batch
        batches.record_batch(
            fleet_env.settings,
            job_id,
            owner=owner,
            endpoint="/v1/completions",
            window="24h",
            input_file_id=f"file-{owner}",
        )

    job = submit_job(
        source_of(source, fleet_env.settings),
        spec,
        shard_size=shard_size,
        settings=fleet_env.settings,
        before_dispatch=record,
    )
    return job.id


def _served(fleet_env, job_id: str) -> list[tuple[float, int, int, float]]:
    """The job's checkpoints: (committed at, prompt tokens, output tokens, engine seconds)."""
    with session_scope(fleet_env.settings) as session:
        rows = session.execute(
            select(
                Checkpoint.created_at,
                Checkpoint.prompt_tokens,
                Checkpoint.completion_tokens,
                Checkpoint.engine_seconds,
            )
            .join(Shard, Shard.id == Checkpoint.shard_id)
            .where(Shard.job_id == job_id)
        ).all()
    return [(at.timestamp(), p, c, s) for at, p, c, s in rows]


def test_two_tenants_one_with_prompts_20x_longer_each_get_half_the_tokens_served(
    fleet_env, tiny_model, tmp_path
):
    with session_scope(fleet_env.settings) as session:
        long_key = keys.create_key(session, "long-prompts")[0].id
        short_key = keys.create_key(session, "short-prompts")[0].id
    long_job = _submit(
        fleet_env, _write(tmp_path / "long.jsonl", LONG_ROWS, 200), tiny_model, long_key, LONG_SHARD
    )
    short_job = _submit(
        fleet_env,
        _write(tmp_path / "short.jsonl", SHORT_ROWS, 6),
        tiny_model,
        short_key,
        SHORT_SHARD,
    )
    workers = start_workers(
        ["tokens@test"],
        fleet_env=fleet_env,
        model=tiny_model,
        log_dir=tmp_path,
        engine_args=INSTANT_ARGS,
        env={"BATCHLLM_INSTANT_TOKEN_SECONDS": str(TOKEN_SECONDS)},
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            with session_scope(fleet_env.settings) as session:
                ended = [session.get(Job, j).status.is_final for j in (long_job, short_job)]
            if all(ended):
                break
            assert workers[0].proc.poll() is None, "the worker exited" + tails(workers)
            assert time.monotonic() < deadline, f"jobs not ended: {ended}" + tails(workers)
            time.sleep(0.5)
    finally:
        stop_workers(workers)

    long_served, short_served = _served(fleet_env, long_job), _served(fleet_env, short_job)
    long_prompt = sum(p for _, p, _, _ in long_served) / LONG_ROWS
    short_prompt = sum(p for _, p, _, _ in short_served) / SHORT_ROWS
    assert long_prompt >= 15 * short_prompt, (long_prompt, short_prompt)  # ~20x longer prompts
    # While both had work queued: until the first of them was served its last tokens.
    until = min(max(at for at, *_ in long_served), max(at for at, *_ in short_served))
    tokens = {
        name: sum(p + c for at, p, c, _ in served if at <= until)
        for name, served in (("long", long_served), ("short", short_served))
    }
    seconds = {
        name: sum(s for at, _, _, s in served if at <= until)
        for name, served in (("long", long_served), ("short", short_served))
    }
    share = tokens["long"] / (tokens["long"] + tokens["short"])
    engine_share = seconds["long"] / (seconds["long"] + seconds["short"])
    print(f"tokens served {tokens}, long share {share:.2f}; engine time share {engine_share:.2f}")
    assert 0.4 <= share <= 0.6, (tokens, seconds)
