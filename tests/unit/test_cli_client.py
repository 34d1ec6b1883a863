"""The job commands over batchllm.Client: `run` (the fake engine in place of vLLM), `submit`
(kombu's in-memory broker), `wait`, `cancel` and `results` give what the Client gives, on a
real SQLite database and storage."""

from __future__ import annotations

import pytest

from batchllm import Client
from batchllm.jobs.create import record_refused_job
from batchllm.settings import get_settings
from batchllm.spec import JobSpec
from batchllm.store import service
from tests.support.cli import invoke
from tests.support.fake_runs import FakeEngine, FakeEngines


@pytest.fixture
def prompts(tmp_path):
    source = tmp_path / "prompts.jsonl"
    lines = [f'{{"custom_id": "q-{i}", "prompt": "the farmer found item {i}"}}' for i in range(5)]
    source.write_text("\n".join([*lines, '{"prompt": ""}']) + "\n")
    return source


def test_run_goes_through_the_client_and_prints_the_ended_job(
    settings, prompts, tmp_path, monkeypatch
):
    monkeypatch.setattr(
        "batchllm.kept_engine.client.EngineCache", lambda settings: FakeEngines(FakeEngine())
    )
    model = tmp_path / "model"
    model.mkdir()

    result = invoke(
        "run", str(prompts), "--model", str(model), "--max-tokens", "4", "--max-model-len", "64"
    )

    assert result.exit_code == 0, result.output
    assert "requests   6/6 done: 5 ok, 1 error" in result.output
    job_id = result.output.split("job        ", 1)[1].split()[0]
    assert f"job {job_id}: 6 requests for {model}" in result.output
    client = Client(settings)
    ended = client.status(job_id)
    assert (ended.status, ended.completed, ended.failed) == ("completed", 5, 1)
    rows = client.results(job_id).to_table().sort_by("line").to_pylist()
    assert [(r["custom_id"], r["status"]) for r in rows] == [
        *[(f"q-{i}", "ok") for i in range(5)],
        ("line-6", "error"),
    ]
    waited = invoke("wait", job_id)
    assert waited.exit_code == 0, waited.output
    assert "status     completed" in waited.output
    head = invoke("results", job_id[:12], "--head", "2")
    assert [line.split()[:3] for line in head.output.splitlines()[1:]] == [
        ["1", "q-0", "ok"],
        ["2", "q-1", "ok"],
    ]


def test_submit_queues_the_shards_and_wait_gives_up_at_its_timeout(settings, prompts, monkeypatch):
    monkeypatch.setenv("BATCHLLM_BROKER_URL", "memory://")  # kombu's broker in this process
    get_settings.cache_clear()

    submitted = invoke("submit", str(prompts), "--model", "/models/fake", "--shard-size", "4")

    assert submitted.exit_code == 0, submitted.output
    job_id = submitted.stdout.strip()
    assert "6 requests: 5 valid, 1 invalid (they become error rows) in 2 shard(s), queued" in (
        submitted.stderr
    )
    job = Client(get_settings()).status(job_id)
    assert (job.status, job.total, job.shards) == ("queued", 6, 2)

    waited = invoke("wait", job_id, "--timeout", "0.5")
    assert waited.exit_code == 1
    assert f"job {job_id} is still queued after 0.5 s" in waited.output

    cancelled = invoke("cancel", job_id[:12])
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.stdout.strip() == f"{job_id}: cancelled"  # queued shards end at once
    assert Client(get_settings()).status(job_id).status == "cancelled"


@pytest.mark.parametrize(
    ("good", "bad", "says"),
    [
        (0, 30, "30 requests: 0 valid, 30 invalid (they become error rows) in 1 shard(s)"),
        (7, 3, "10 requests: 7 valid, 3 invalid (they become error rows) in 1 shard(s)"),
        (4, 0, "4 requests in 1 shard(s), queued"),
    ],
)
def test_submit_says_how_many_lines_are_invalid(settings, tmp_path, monkeypatch, good, bad, says):
    monkeypatch.setenv("BATCHLLM_BROKER_URL", "memory://")
    get_settings.cache_clear()
    source = tmp_path / "mixed.jsonl"
    lines = [f'{{"prompt": "item {i}"}}' for i in range(good)]
    lines += [f'{{"prompt": "item {i}"' for i in range(bad)]  # malformed JSON
    source.write_text("\n".join(lines) + "\n")

    submitted = invoke("submit", str(source), "--model", "/models/fake")

    assert submitted.exit_code == 0, submitted.output
    assert says in submitted.stderr
    assert Client(get_settings()).status(submitted.stdout.strip()).total == good + bad


def test_wait_on_an_ended_job_prints_it_and_exits_by_its_state(settings, prompts):
    failed = record_refused_job(
        str(prompts), JobSpec(model="/models/fake"), "refused for the test", settings=settings
    )

    result = invoke("wait", failed)

    assert result.exit_code == 1
    assert f"job        {failed}" in result.output and "status     failed" in result.output
    assert "error      refused for the test" in result.output
