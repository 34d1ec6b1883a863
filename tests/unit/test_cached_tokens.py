"""Prefix-cache hits: each request's cached prompt tokens (vLLM's num_cached_tokens) add up to
the job's `cached_tokens`, which `usage` reports as input_tokens_details.cached_tokens. The
fake engine's prefix cache counts the longest prefix a prompt shares with an earlier one."""

from __future__ import annotations

import json

from batchllm import Client
from batchllm.engine.protocol import Finished
from batchllm.output.parts import OUTPUT_SCHEMA
from batchllm.store.db import session_scope
from batchllm.store.job_view import job_view
from batchllm.store.models import Job
from tests.support.fake_runs import (
    FakeEngine,
    FakeEngines,
    engine_error,
    output_rows,
    small_commits,
)

__all__ = ["small_commits"]

# A plain prompt is BOS + its words (the fake's word tokenizer): 5, 5, 5 and 3 tokens.
PROMPTS = {
    "a": "system says hello alpha",
    "b": "system says hello beta",  # shares BOS + 3 words with "a": 4 cached
    "a-again": "system says hello alpha",  # the whole prompt of "a": 5 cached
    "other": "other words",  # shares only BOS: 1 cached
}
FIRST_RUN_CACHED = 0 + 4 + 5 + 1


class FailingEngine(FakeEngine):
    """Ends the requests whose prompt mentions one of `failing` with finish reason "error",
    still reporting their prefix-cache hits (vLLM did read the cache for them)."""

    def __init__(self, failing: set[str]) -> None:
        super().__init__()
        self.failing = failing

    def step(self) -> list[Finished]:
        finished = super().step()
        for i, out in enumerate(finished):
            if out.text.split()[-1] in self.failing:
                finished[i] = engine_error(out, cached_tokens=out.cached_tokens)
        return finished


def run(settings, tmp_path, engine: FakeEngine):
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"custom_id": k, "prompt": p}) + "\n" for k, p in PROMPTS.items())
    )
    client = Client(settings)
    job = client.run(
        path, model="/models/fake", max_model_len=24, max_tokens=2, engines=FakeEngines(engine)
    )
    return client, job


def usage_of(settings, job_id: str) -> dict:
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return {"cached_tokens": job.cached_tokens, **job_view(job)["usage"]}


def test_prefix_cache_hits_add_up_to_the_jobs_cached_tokens_in_its_usage(small_commits, tmp_path):
    _, job = run(small_commits, tmp_path, FakeEngine())

    assert (job.status, job.completed) == ("completed", 4)
    usage = usage_of(small_commits, job.id)
    assert usage["cached_tokens"] == FIRST_RUN_CACHED
    assert usage["input_tokens"] == 5 + 5 + 5 + 3
    assert usage["input_tokens_details"] == {"cached_tokens": FIRST_RUN_CACHED}
    assert usage["total_tokens"] == 18 + 4 * 2
    # No output column carries them: the rows keep the output schema.
    rows = output_rows(small_commits, job.id)
    assert len(rows) == 4 and set(rows[0]) == set(OUTPUT_SCHEMA.names)


def test_a_retry_adds_its_hits_and_keeps_the_replaced_rows_hits(small_commits, tmp_path):
    engine = FailingEngine(failing={"beta"})
    client, job = run(small_commits, tmp_path, engine)
    assert (job.completed, job.failed) == (3, 1)
    assert usage_of(small_commits, job.id)["cached_tokens"] == FIRST_RUN_CACHED

    engine.failing = set()  # the same engine: its cache holds "b"'s whole prompt
    retried = client.retry(job, engines=FakeEngines(engine))

    assert (retried.completed, retried.failed) == (4, 0)
    usage = usage_of(small_commits, job.id)
    # The replaced row's prompt tokens are taken off (input counts each line once), but no
    # row records its cache hits: cached tokens count every run's, a usage figure.
    assert usage["input_tokens"] == 18
    assert usage["cached_tokens"] == FIRST_RUN_CACHED + 5
    assert usage["input_tokens_details"] == {"cached_tokens": FIRST_RUN_CACHED + 5}


def test_the_hit_rate_is_in_the_jobs_throughput_its_summary_and_the_metrics(
    small_commits, tmp_path
):
    from prometheus_client import REGISTRY

    from batchllm.store.job_view import job_view as view_of
    from tests.support.cli import invoke

    def counted() -> float:
        value = REGISTRY.get_sample_value(
            "batchllm_prompt_cached_tokens_total", {"model": "/models/fake"}
        )
        return value or 0.0

    before = counted()
    client, job = run(small_commits, tmp_path, FakeEngine())

    with session_scope(small_commits) as session:
        throughput = view_of(session.get(Job, job.id))["throughput"]
    assert throughput["cached_tokens"] == FIRST_RUN_CACHED
    assert throughput["prefix_cache_hit_rate"] == FIRST_RUN_CACHED / 18
    assert client.status(job.id).throughput["prefix_cache_hit_rate"] == FIRST_RUN_CACHED / 18
    assert counted() - before == FIRST_RUN_CACHED
    shown = invoke("status", job.id)
    assert f"18 prompt ({FIRST_RUN_CACHED / 18:.0%} from the prefix cache)" in shown.output
