"""Model names are exact (issue 33, finding 3): a look-alike name never shares another model's
queue, and a worker never sizes (loads the config or tokenizer of) a job of another model."""

from __future__ import annotations

import pytest

from batchllm.execution.engines import WorkerEngine
from batchllm.execution.runner import Outcome
from batchllm.jobs.create import create_job
from batchllm.settings import get_settings
from batchllm.spec import EngineOptions, JobSpec
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, Shard, ShardStatus
from batchllm.worker.celery_app import queue_for_job, queue_for_model, worker_queues
from batchllm.worker.delivery import process_shard
from tests.support.fake_runs import write_items
from tests.support.file_jobs import create_from_file
from tests.support.inputs import source_of

SERVED = "/models/tiny"


@pytest.mark.parametrize(
    "look_alike", ["models_tiny", "models/tiny", "/models/tiny/", "/models//tiny"]
)
def test_a_look_alike_model_name_has_a_queue_of_its_own(look_alike):
    assert queue_for_model(look_alike) != queue_for_model(SERVED)
    served_queues = worker_queues(SERVED, task="generate", enable_lora=True, allow_rebuild=True)
    spec = JobSpec(model=look_alike)
    assert queue_for_job(spec) not in served_queues
    for kind in (EngineOptions(enable_lora=True), EngineOptions(task="embed")):
        assert queue_for_job(JobSpec(model=look_alike, engine=kind)) not in served_queues


def test_the_same_name_always_has_the_same_readable_queue():
    assert queue_for_model(SERVED) == queue_for_model(SERVED)
    assert queue_for_model(SERVED).startswith("batchllm.models_tiny#")
    assert queue_for_job(JobSpec(model=SERVED)) in worker_queues(
        SERVED, task="generate", enable_lora=False, allow_rebuild=False
    )


def test_a_worker_never_sizes_a_job_of_another_model(settings, tmp_path, monkeypatch):
    sized: list[str] = []

    def resolve_max_model_len(job_id, **_kwargs):
        sized.append(job_id)  # would load AutoConfig/AutoTokenizer of the job's model name
        raise OSError("models_tiny is not a local folder and not a model on the hub")

    monkeypatch.setattr("batchllm.worker.delivery.resolve_max_model_len", resolve_max_model_len)
    created = create_from_file(
        write_items(tmp_path / "in.jsonl", 3), JobSpec(model="models_tiny"), settings, shard_size=10
    )
    with session_scope(settings) as session:
        (shard_id,) = [s.id for s in session.get(Job, created.job.id).shards]
    worker_engine = WorkerEngine(
        SERVED, EngineOptions(), settings=settings
    )  # never started: never asked for

    outcome = process_shard(shard_id, worker="w1", engines=worker_engine, settings=settings)

    assert outcome is Outcome.WAITING
    assert sized == []
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_id)
        assert (shard.status, shard.attempts, shard.failures) == (ShardStatus.QUEUED, 0, 0)
