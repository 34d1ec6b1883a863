"""`batchllm worker --metrics-port`: a real worker (real Redis and PostgreSQL, the instant engine
on the tiny model's tokenizer: the metrics are the subject, not generation) runs a job, then its
/metrics shows the job's rows and tokens as the database has them.

The port is given through BATCHLLM_METRICS_PORT, the flag's environment variable, so the
conftest's Worker starts the process unchanged."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchllm.demo.workload import write_workload
from batchllm.store.models import JobStatus
from tests.support.fleet import INSTANT_ARGS, Worker
from tests.support.job_checks import load_job, wait_for, wait_until_final
from tests.support.ports import free_port

pytestmark = pytest.mark.integration


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_worker_that_ran_a_job_shows_its_rows_and_tokens(
    fleet_env, tiny_model: Path, tmp_path: Path
):
    port = free_port()
    worker = Worker(
        "metrics@test",
        model=tiny_model,
        env=fleet_env.worker_env(BATCHLLM_METRICS_PORT=str(port)),
        log_path=tmp_path / "worker.log",
        engine_args=INSTANT_ARGS,
    )
    try:
        worker.wait_ready()
        # Before any job: the worker's own engine is up (built before `ready.`), with its
        # profile as labels.
        before = samples(scrape(port))
        model = ("model", str(tiny_model))
        assert before[("batchllm_engine_starts_total", frozenset({model}))] == 1
        assert before[("batchllm_engine_up", frozenset({model}))] == 1
        (info,) = [dict(labels) for name, labels in before if name == "batchllm_engine_info"]
        assert info == {
            "model": str(tiny_model),
            "task": "generate",
            "max_model_len": "512",  # tests/support/fleet.py INSTANT_ARGS
            "dtype": "instant",  # a vLLM engine's own dtype: tests/engine/test_run_real_vllm.py
            "quantization": "none",
            "max_lora_rank": "0",
        }
        source = write_workload(
            tmp_path / "prompts.jsonl", requests=30, max_tokens=(4, 24), bad_lines=2, seed=3
        )
        submitted = fleet_env.submit(source, tiny_model, shard_size=12)
        assert submitted.shards_total == 3
        wait_until_final(fleet_env, submitted.id, timeout=120)
        job, shards = load_job(fleet_env, submitted.id)
        assert job.status is JobStatus.COMPLETED, job.error
        assert (job.request_completed, job.request_failed) == (28, 2)  # 2 of the 30 are bad

        text = scrape(port)
        (tmp_path / "metrics.txt").write_text(text)
        found = samples(text)

        def sample(name: str, **labels: str) -> float | None:
            return found.get((name, frozenset({"model": str(tiny_model), **labels}.items())))

        assert sample("batchllm_rows_total", status="ok") == job.request_completed
        assert sample("batchllm_rows_total", status="error") == job.request_failed
        assert sample("batchllm_completion_tokens_total") == job.completion_tokens > 0
        assert sample("batchllm_prompt_tokens_total") == job.prompt_tokens > 0
        assert sample("batchllm_shards_started_total") == len(shards)
        assert sample("batchllm_shards_finished_total") == len(shards)
        assert sample("batchllm_shards_failed_total") == 0
        assert sample("batchllm_shard_duration_seconds_count") == len(shards)
        assert sample("batchllm_engine_starts_total") == 1
        assert sample("batchllm_engine_up") == 1
        assert sample("batchllm_requests_in_flight") == 0
        # The window of whole seconds empties within a few seconds of the last step.
        rate = ("batchllm_output_tokens_per_second", frozenset({("model", str(tiny_model))}))
        wait_for(
            lambda: samples(scrape(port)).get(rate) == 0,
            timeout=30,
            what="output tokens/s to fall back to 0 with nothing running",
        )
    finally:
        worker.stop()
