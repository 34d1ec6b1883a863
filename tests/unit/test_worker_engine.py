"""A fleet worker owns its engine: built at start-up from the operator's settings, kept for every
job whose requirements it meets, never rebuilt by a job unless the operator allowed it; jobs go
to the queue of the engine kind they need; `status` says why a job waits. vLLM is replaced by a
fake engine class that records builds; the delivery test runs on SQLite."""

from __future__ import annotations

import logging
import os
from typing import ClassVar

import pytest
from click.testing import CliRunner

from batchllm.cli import cli
from batchllm.errors import EngineMismatch
from batchllm.execution.engines import WorkerEngine
from batchllm.execution.profile import EngineProfile, unmet_requirements
from batchllm.execution.runner import Outcome
from batchllm.settings import get_settings
from batchllm.spec import EngineOptions, JobSpec
from batchllm.store.db import session_scope
from batchllm.store.models import JobStatus, Shard, ShardStatus
from batchllm.worker.celery_app import queue_for_job, queue_for_model, worker_queues
from batchllm.worker.delivery import process_shard
from batchllm.worker.registry import waiting_reason
from tests.support.cli import capture_supervised
from tests.support.fake_runs import create_items_job, small_commits

__all__ = ["small_commits"]

MODEL = "/models/fake"


class FakeVllmEngine:
    """Built like VllmEngine: -1 asks vLLM to fit the context, which here is 4096."""

    built: ClassVar[list[FakeVllmEngine]] = []
    fitted_context = 4096

    def __init__(
        self, *, model: str, options: EngineOptions, max_model_len: int | None, **_named
    ) -> None:
        self.model, self.options = model, options
        self.max_model_len = self.fitted_context if max_model_len == -1 else max_model_len
        self.dtype = "bfloat16" if options.dtype == "auto" else options.dtype
        self.shut_down = False
        FakeVllmEngine.built.append(self)

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.fixture
def fake_vllm(monkeypatch) -> type[FakeVllmEngine]:
    FakeVllmEngine.built = []
    monkeypatch.setattr("batchllm.engine.vllm_engine.VllmEngine", FakeVllmEngine)
    return FakeVllmEngine


def job(**engine: object) -> JobSpec:
    return JobSpec(model=MODEL, engine=EngineOptions(**engine))


def profile(**fields: object) -> EngineProfile:
    values: dict[str, object] = {
        "model": MODEL,
        "task": "generate",
        "max_model_len": 2048,
        "dtype": "bfloat16",
        "quantization": None,
        "enable_lora": False,
        "max_lora_rank": None,
        "compact_json": False,
    }
    values.update(fields)
    return EngineProfile(**values)  # type: ignore[arg-type]


# -- requirements ---------------------------------------------------------------------------


def test_settings_that_are_the_workers_to_choose_are_no_requirements():
    spec = job(
        gpu_memory_utilization=0.5,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        enforce_eager=True,
        enable_prefix_caching=False,
        tensor_parallel_size=4,
        kv_cache_memory_bytes=10**9,
        max_model_len=2048,
        dtype="bfloat16",
    )
    assert unmet_requirements(spec, profile()) == []


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        ({"max_model_len": 4096}, "max_model_len 4096 (this worker's context is 2048)"),
        ({"dtype": "float16"}, "dtype float16 (this worker runs bfloat16)"),
        ({"quantization": "fp8"}, "quantization fp8 (this worker runs unquantized)"),
        ({"compact_json": True}, "compact JSON (this worker runs without --compact-json)"),
        ({"task": "embed"}, "task embed (this worker's engine is for generate)"),
        ({"enable_lora": True}, "LoRA adapters (this worker runs without --enable-lora)"),
    ],
)
def test_each_requirement_the_worker_does_not_meet_is_named(engine, expected):
    assert unmet_requirements(job(**engine), profile()) == [expected]


def test_lora_rank_is_a_requirement_only_when_the_job_gives_one():
    lora_worker = profile(enable_lora=True, max_lora_rank=16)
    assert unmet_requirements(job(enable_lora=True), lora_worker) == []
    assert unmet_requirements(job(enable_lora=True, max_lora_rank=16), lora_worker) == []
    assert unmet_requirements(job(enable_lora=True, max_lora_rank=64), lora_worker) == [
        "max_lora_rank 64 (this worker serves adapters up to rank 16)"
    ]


def test_dtype_aliases_and_another_model_are_compared_as_vllm_means_them():
    assert unmet_requirements(job(dtype="half"), profile(dtype="float16")) == []
    other = JobSpec(model="/models/other")
    assert unmet_requirements(other, profile()) == [
        f"model /models/other (this worker serves {MODEL})"
    ]


def test_a_profile_survives_the_registry_round_trip():
    built = profile(enable_lora=True, max_lora_rank=32, quantization="fp8")
    assert EngineProfile.from_dict(built.as_dict()) == built
    assert built.describe() == (
        f"{MODEL}, generate, max_model_len 2048, bfloat16, quantization fp8, LoRA up to rank 32"
    )


# -- routing ---------------------------------------------------------------------------------


def test_jobs_go_to_the_queue_of_the_engine_kind_they_need():
    base = queue_for_model(MODEL)
    assert queue_for_job(job()) == base
    assert queue_for_job(job(max_model_len=8192, dtype="float16")) == base
    assert queue_for_job(job(enable_lora=True)) == base + ".lora"
    assert queue_for_job(JobSpec(model=MODEL, adapters={"a": "/x"})) == base + ".lora"
    assert queue_for_job(job(task="embed")) == base + ".embed"


def test_a_worker_consumes_the_kinds_its_engine_serves():
    base = queue_for_model(MODEL)
    plain = worker_queues(MODEL, task="generate", enable_lora=False, allow_rebuild=False)
    lora = worker_queues(MODEL, task="generate", enable_lora=True, allow_rebuild=False)
    embed = worker_queues(MODEL, task="embed", enable_lora=False, allow_rebuild=False)
    anything = worker_queues(MODEL, task="generate", enable_lora=False, allow_rebuild=True)
    assert plain == [base]
    assert lora == [base, base + ".lora"]
    assert embed == [base + ".embed"]
    classify = worker_queues(MODEL, task="classify", enable_lora=False, allow_rebuild=False)
    assert classify == [base + ".classify"]
    assert anything == [base, base + ".lora", base + ".embed", base + ".classify"]


def test_status_says_why_a_job_waits_from_the_live_workers_profiles():
    plain = {"node": "w1@a", "models": [MODEL], "engine": profile().as_dict()}
    lora = {"node": "w2@a", "models": [MODEL], "engine": profile(enable_lora=True).as_dict()}
    other = {"node": "w3@a", "models": ["/models/other"], "engine": None}
    lora_job = job(enable_lora=True)

    assert waiting_reason(lora_job, []) == f"no live worker serves model {MODEL}"
    assert waiting_reason(lora_job, [other]) == f"no live worker serves model {MODEL}"
    assert waiting_reason(lora_job, [plain, other]) == (
        f"none of the 1 live worker(s) of {MODEL} can run it (w1@a: needs LoRA adapters "
        "(this worker runs without --enable-lora))"
    )
    assert waiting_reason(lora_job, [plain, lora]) is None
    assert waiting_reason(job(), [plain]) is None


# -- the engine a worker owns -------------------------------------------------------------


def test_the_worker_builds_its_engine_once_and_every_fitting_job_gets_it(fake_vllm):
    worker = WorkerEngine(MODEL, EngineOptions(enforce_eager=True), settings=get_settings())
    built = worker.start()
    (engine,) = fake_vllm.built
    assert built.max_model_len == 4096  # vLLM's fit, not a job's size
    # Jobs of other sizes, sampling and worker-side settings: the same engine, no build.
    for spec, sized in [
        (job(), 300),
        (job(max_model_len=1024), 1024),
        (job(gpu_memory_utilization=0.3, max_num_seqs=4), 4096),
        (job(), 9000),  # longer than the engine: its long rows become error rows
    ]:
        assert worker.get(spec, sized) is engine
    assert fake_vllm.built == [engine] and not engine.shut_down


def test_a_job_the_engine_cannot_run_is_refused_without_a_rebuild(fake_vllm):
    worker = WorkerEngine(MODEL, EngineOptions(max_model_len=512), settings=get_settings())
    worker.start()
    with pytest.raises(EngineMismatch) as refused:
        worker.get(job(max_model_len=1024, enable_lora=True), 1024)
    assert refused.value.unmet == [
        "LoRA adapters (this worker runs without --enable-lora)",
        "max_model_len 1024 (this worker's context is 512)",
    ]
    assert len(fake_vllm.built) == 1 and not fake_vllm.built[0].shut_down


def test_allow_rebuild_builds_for_the_job_and_gives_the_operators_engine_back(fake_vllm):
    worker = WorkerEngine(
        MODEL, EngineOptions(max_model_len=512), allow_rebuild=True, settings=get_settings()
    )
    worker.start()
    own = fake_vllm.built[0]
    for_job = worker.get(job(max_model_len=1024), 1024)
    assert for_job is not own and own.shut_down
    assert for_job.max_model_len == 1024
    back = worker.get(job(), 200)
    assert back.max_model_len == 512 and for_job.shut_down
    assert len(fake_vllm.built) == 3


def test_after_the_engine_died_the_next_job_gets_the_operators_engine_again(fake_vllm):
    worker = WorkerEngine(MODEL, EngineOptions(max_model_len=512), settings=get_settings())
    worker.start()
    worker.close()  # what delivery does when the engine died mid-shard
    assert worker.engine is None
    again = worker.get(job(), 100)
    assert again.max_model_len == 512 and len(fake_vllm.built) == 2


def test_a_shard_the_engine_cannot_run_stays_queued_and_unclaimed(small_commits, tmp_path):
    settings = small_commits
    _, (shard_id,) = create_items_job(settings, tmp_path, 6, shard_size=10)

    class Refusing:
        engine = None

        def get(self, spec, max_model_len):
            raise EngineMismatch(["LoRA adapters (this worker runs without --enable-lora)"])

        def close(self) -> None:
            pass

    outcome = process_shard(shard_id, worker="w1", engines=Refusing(), settings=settings)

    assert outcome is Outcome.WAITING
    with session_scope(settings) as session:
        shard = session.get(Shard, shard_id)
        assert (shard.status, shard.worker, shard.attempts) == (ShardStatus.QUEUED, None, 0)
        assert shard.job.status is JobStatus.QUEUED


# -- the worker command -------------------------------------------------------------------


def test_concurrency_children_get_the_engine_flags_given(monkeypatch):
    monkeypatch.setattr("batchllm.engine.preflight.check_worker_concurrency", lambda *a, **k: None)
    started = capture_supervised(monkeypatch)
    result = CliRunner().invoke(
        cli,
        [
            "worker",
            "-m",
            MODEL,
            "--concurrency",
            "2",
            "--max-model-len",
            "8192",
            "--enforce-eager",
            "--no-prefix-caching",
            "--max-lora-rank",
            "32",
            "--allow-rebuild",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len(started) == 2
    for argv in started:
        given = argv[argv.index("worker") + 1 :]
        assert given[:4] == ["--model", MODEL, "--loglevel", "INFO"]
        assert "--allow-rebuild" in given
        pairs = " ".join(given)
        assert "--max-model-len 8192" in pairs and "--max-lora-rank 32" in pairs
        assert "--enforce-eager" in given and "--no-prefix-caching" in given
        # Defaults are not forwarded: the child's own defaults are the same.
        assert "--gpu-memory-utilization" not in given and "--dtype" not in given


def test_concurrency_children_get_the_log_format_as_an_argument_not_the_environment(monkeypatch):
    for name in ("BATCHLLM_LOG_FORMAT", "BATCHLLM_WORKER_MODELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("batchllm.engine.preflight.check_worker_concurrency", lambda *a, **k: None)
    started = capture_supervised(monkeypatch)

    result = CliRunner().invoke(
        cli, ["worker", "-m", MODEL, "--concurrency", "2", "--log-format", "json"]
    )

    assert result.exit_code == 0, result.output
    assert len(started) == 2
    for argv in started:
        given = argv[argv.index("worker") + 1 :]
        assert given[given.index("--log-format") + 1] == "json"
    # Nothing is handed on through this process's environment.
    assert "BATCHLLM_LOG_FORMAT" not in os.environ
    assert "BATCHLLM_WORKER_MODELS" not in os.environ


def test_start_engine_keeps_the_model_to_announce_and_the_log_format_for_celery(monkeypatch):
    from batchllm.process.log_format import JsonFormatter
    from batchllm.worker import tasks

    monkeypatch.setattr(tasks, "_json_logs_wanted", False)
    engine = _start_instant(monkeypatch, get_settings(), json_logs=True)

    assert tasks._engines is engine and tasks._served_models == [MODEL]
    logger = logging.getLogger("test-celery-worker")
    handler = logging.StreamHandler()
    logger.addHandler(handler)
    try:
        tasks._json_logs(logger=logger)  # Celery's after_setup_logger
        assert isinstance(handler.formatter, JsonFormatter)
    finally:
        logger.removeHandler(handler)


def _start_instant(monkeypatch, settings, **named):
    """tasks.start_engine with an instant engine class that only records its model."""
    from batchllm.worker import tasks

    class Started:
        def __init__(self, model, options, **_named) -> None:
            self.model = model

        def start(self) -> None:
            pass

    monkeypatch.setattr(tasks, "InstantWorkerEngine", Started)
    monkeypatch.setattr(tasks, "_engines", None)
    monkeypatch.setattr(tasks, "_served_models", [])
    return tasks.start_engine(
        MODEL, EngineOptions(), settings=settings, allow_rebuild=False, instant=True, **named
    )


def test_a_worker_opens_and_checks_its_database_before_its_first_task(monkeypatch):
    """Issue 37's profile: the first task paid ~0.5 s of imports and migration reading inside
    a job's time; the worker now pays it while it starts."""
    from batchllm.store import db

    monkeypatch.setattr(db, "_engines", {})
    settings = get_settings()
    _start_instant(monkeypatch, settings)
    assert list(db._engines) == [settings.resolved_database_url]


def test_a_worker_whose_database_is_down_still_starts_and_says_why(monkeypatch, caplog):
    from batchllm.store import db

    monkeypatch.setattr(db, "_engines", {})
    down = get_settings().model_copy(
        update={"database_url": "postgresql+psycopg://nobody@127.0.0.1:1/none"}
    )
    with caplog.at_level(logging.WARNING, logger="batchllm.worker.tasks"):
        engine = _start_instant(monkeypatch, down)
    assert engine.model == MODEL
    assert db._engines == {}  # opened again by the first task, once the database is back
    assert any("the database is not usable yet" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("task", ["embed", "classify"])
def test_an_instant_worker_refuses_a_task_it_cannot_simulate(tiny_model, task) -> None:
    """As `run --engine instant` refuses such a job: a worker that took it would complete
    every row with no vector or class at all (issue 64, item 5)."""
    from batchllm.errors import BatchLLMError
    from batchllm.execution.instant import InstantWorkerEngine

    engine = InstantWorkerEngine(str(tiny_model), EngineOptions(task=task))
    with pytest.raises(BatchLLMError, match=f"generation only: --task {task} needs --engine vllm"):
        engine.start()
    assert engine.engine is None


def test_the_worker_command_says_so_and_exits_1(tiny_model, tmp_path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    env["BATCHLLM_HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-m", "batchllm", "worker", "--model", str(tiny_model)]
        + ["--engine", "instant", "--task", "embed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "the worker's engine could not start" in done.stderr
    assert "--task embed needs --engine vllm" in done.stderr
