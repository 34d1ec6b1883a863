"""The Python API (batchllm.Client) on SQLite with the fake engine: run, status, results,
cancel, request dicts streamed to a file, options mapped to the job spec."""

from __future__ import annotations

import pytest

from batchllm import Client, Job
from batchllm.errors import JobStateError
from batchllm.input.job_spec import build_job_spec
from batchllm.settings import get_settings
from tests.support.fake_runs import FakeEngine, FakeEngines, small_commits


def test_job_options_map_to_the_spec_and_unknown_ones_are_refused():
    spec = build_job_spec(
        "m",
        max_tokens=12,
        temperature=0,
        n=2,
        logprobs=3,
        choice=["yes", "no"],
        max_model_len=256,
        lora={"a": "/adapters/a"},
        metadata={"team": "search"},
        settings=get_settings(),
    )
    assert (spec.sampling.max_tokens, spec.sampling.n, spec.sampling.logprobs) == (12, 2, 3)
    assert spec.sampling.structured == {"choice": ["yes", "no"]}
    assert spec.engine.max_model_len == 256 and spec.engine.enable_lora
    assert spec.adapters == {"a": "/adapters/a"} and spec.metadata == {"team": "search"}
    with pytest.raises(TypeError, match="max_tokenz"):
        build_job_spec("m", max_tokenz=3, settings=get_settings())


def test_run_from_request_dicts_then_status_and_results(small_commits, tmp_path):
    client = Client(small_commits)
    requests = [{"prompt": f"the farmer found item {i}", "max_tokens": 4} for i in range(7)]
    requests.append({"prompt": ""})  # an error row, not a failed job

    job = client.run(
        iter(requests), model="/models/fake", max_model_len=64, engines=FakeEngines(FakeEngine())
    )

    assert isinstance(job, Job) and job.done
    assert (job.status, job.total, job.completed, job.failed) == ("completed", 8, 7, 1)
    assert client.status(job.id[:12]) == job
    table = client.results(job).to_table()
    assert sorted(table.column("line").to_pylist()) == list(range(1, 9))
    frame = table.to_pandas()
    assert frame.loc[frame.line == 8, "status"].item() == "error"
    assert set(frame.loc[frame.line < 8, "status"]) == {"ok"}


def test_wait_returns_an_ended_job_and_cancel_refuses_it(small_commits, tmp_path):
    client = Client(small_commits)
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a b c", "max_tokens": 2}\n')
    job = client.run(
        path, model="/models/fake", max_model_len=64, engines=FakeEngines(FakeEngine())
    )

    assert client.wait(job, timeout=5).status == "completed"
    with pytest.raises(JobStateError):
        client.cancel(job)
