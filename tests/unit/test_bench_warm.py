"""The warm part without an engine: its five jobs' settings, the worker's command line as the
real `batchllm worker` parses it, the metrics it reads back, the side-by-side file, and the
report from made-up figures (the real worker runs in tests/integration/test_warm_start.py)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from batchllm.bench.chart import draw_chart
from batchllm.bench.config import DEFAULT_PARTS, PARTS, BenchConfig
from batchllm.bench.figures import BenchFailed
from batchllm.bench.parts.warm import (
    JOBS,
    check_like_for_like,
    require_no_engine_start,
    side_by_side_file,
    speedups,
    summarize,
)
from batchllm.bench.parts.warm_worker import WorkerProcess, worker_command
from batchllm.bench.processes import EngineLimits
from batchllm.bench.report import summary_text
from batchllm.cli import cli
from batchllm.process.ports import free_port

LIMITS = EngineLimits(
    max_model_len=512,
    max_num_seqs=256,
    max_num_batched_tokens=4096,
    dtype="auto",
    enforce_eager=True,
)


def test_the_five_jobs_differ_in_prompt_length_and_settings_and_ask_for_no_other_engine():
    assert len(JOBS) == 5
    specs = [job.spec("/m", 512) for job in JOBS]
    for before, after in itertools.pairwise(JOBS):
        assert (before.prompt_words, before.max_tokens) != (after.prompt_words, after.max_tokens)
    assert {s.sampling.temperature for s in specs} == {0.0, 0.8}
    assert [s.sampling.structured for s in specs if s.sampling.structured] == [
        {"choice": ["yes", "no", "maybe"]}
    ]
    assert [s.sampling.n for s in specs].count(2) == 1
    explicit = [s.engine.max_model_len for s in specs if s.engine.max_model_len is not None]
    assert explicit == [384]  # at or below the worker's 512
    # Otherwise the engine settings a user leaves alone: nothing a worker would have to rebuild for.
    assert all(s.engine.dtype == "auto" and not s.engine.enable_lora for s in specs)
    assert all(s.engine.task == "generate" for s in specs)


def test_the_worker_command_is_one_that_batchllm_worker_parses_with_its_engine_flags():
    command = worker_command("/m", LIMITS, name="bench@host", metrics_port=9400)
    args = command[command.index("worker") + 1 :]
    worker = cli.commands["worker"]
    ctx = worker.make_context("worker", list(args))
    assert ctx.params["model"] == "/m"
    assert ctx.params["max_model_len"] == 512
    assert ctx.params["enforce_eager"] is True
    assert ctx.params["max_num_seqs"] == 256
    assert ctx.params["max_num_batched_tokens"] == 4096
    assert ctx.params["dtype"] == "auto"
    assert ctx.params["metrics_port"] == 9400
    assert ctx.params["allow_rebuild"] is False  # no job may rebuild the engine
    compiled = worker_command(
        "/m", EngineLimits(512, 256, 4096, "float32"), name="b@h", metrics_port=9400
    )
    assert "--enforce-eager" not in compiled and "float32" in compiled


def test_it_reads_the_engine_back_from_the_worker_metrics_modules_own_endpoint():
    from batchllm.execution import metrics

    port = free_port()
    server = metrics.start_metrics_server(port, addr="127.0.0.1")
    try:
        model = "/unit-test/bench-warm"
        metrics.engine_started(model, 21.5)
        metrics.engine_profile(
            {
                "model": model,
                "task": "generate",
                "max_model_len": 512,
                "dtype": "float32",
                "quantization": None,
                "max_lora_rank": None,
            }
        )
        worker = WorkerProcess.__new__(WorkerProcess)  # no process: only its metrics reading
        worker.model, worker.metrics_port = model, port
        assert worker.engine_starts() == 1
        assert worker.engine() == {
            "max_model_len": 512,
            "dtype": "float32",
            "task": "generate",
            "start_seconds": 21.5,
        }
    finally:
        if server is not None:
            server.shutdown()


def test_a_job_that_starts_an_engine_fails_the_part():
    require_no_engine_start("job 1", 0)
    with pytest.raises(BenchFailed, match=r"job 3 .* started 1 engine"):
        require_no_engine_start("job 3 (choice of 3 labels)", 1)


def test_the_side_by_side_file_is_greedy_with_one_fixed_max_tokens(tmp_path: Path):
    path = side_by_side_file(
        tmp_path / "f.jsonl", model="/m", lines=40, prompt_words=(8, 64), max_tokens=64, seed=0
    )
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 40
    assert len({line["custom_id"] for line in lines}) == 40
    for line in lines:
        assert line["url"] == "/v1/chat/completions"
        body = line["body"]
        assert (body["model"], body["temperature"], body["max_tokens"]) == ("/m", 0.0, 64)
        assert body["ignore_eos"] is True


def run(seconds: float, *, requests: int = 100, failed: int = 0, tokens: int = 6400) -> dict:
    return {
        "seconds": seconds,
        "requests": requests,
        "failed": failed,
        "prompt_tokens": 9000,
        "output_tokens": tokens,
        "generation_seconds": seconds / 3,
        "extra": {},
        "load_average": [0.4, 1.9],
    }


def side(**runs: dict) -> dict:
    return {
        "lines": 100,
        "prompt_words": [8, 64],
        "max_tokens": 64,
        "limits": {
            "max_model_len": 512,
            "max_num_seqs": 256,
            "max_num_batched_tokens": 4096,
            "dtype": "float32",
            "enforce_eager": True,
        },
        "target_speedup": 3.0,
        "cpu_count": 2,
        "skipped": {},
        "idle_worker_cpu_seconds": 0.4,
        "warm_worker_engine_starts": 0,
        **runs,
    }


def test_the_side_by_side_compares_only_like_work():
    figures = side(vllm_run_batch=run(60), batchllm_run=run(50), warm_worker=run(15))
    check_like_for_like(figures, lines=100, max_tokens=64)
    for bad in (run(15, failed=1), run(15, tokens=6399), run(15, requests=99)):
        with pytest.raises(BenchFailed, match="warm_worker"):
            check_like_for_like({**figures, "warm_worker": bad}, lines=100, max_tokens=64)


def test_the_speedups_are_each_fresh_process_over_the_warm_worker():
    ratios = speedups(side(vllm_run_batch=run(60), batchllm_run=run(45), warm_worker=run(15)))
    assert ratios == {"run_over_warm": 3.0, "run_batch_over_warm": 4.0, "target_met": True}
    short = speedups(side(vllm_run_batch=run(40), batchllm_run=run(45), warm_worker=run(16)))
    assert short["target_met"] is False
    # run-batch may not run here: then only run/warm.
    assert speedups(side(batchllm_run=run(45), warm_worker=run(15))) == {"run_over_warm": 3.0}


def job(n: int, first: float, *, starts: int = 0, explicit: int | None = None) -> dict:
    return {
        "job_id": f"job_{n}",
        "label": JOBS[n].label,
        "prompt_words": list(JOBS[n].prompt_words),
        "max_tokens": JOBS[n].max_tokens,
        "explicit_max_model_len": explicit,
        "max_model_len": explicit or 128,
        "rows_ok": 50,
        "rows_failed": 0,
        "hardware": "CPU (x86_64, 2 cores), float32",
        "vllm_version": "0.32.0",
        "submit_to_pickup_seconds": 0.05,
        "pickup_to_first_row_seconds": first,
        "submit_to_first_row_seconds": 0.05 + first,
        "submit_to_completed_seconds": 1.0 + first,
        "engine_starts": starts,
    }


def warm_result() -> dict:
    jobs = [job(0, 0.02), job(1, 0.4), job(2, 0.03), job(3, 0.05), job(4, 0.04, explicit=384)]
    return summarize(jobs, lines=50) | {
        "worker": {
            "command": worker_command("/m", LIMITS, name="b@h", metrics_port=9400),
            "ready_seconds": 31.0,
            "load_average": [0.2, 1.1],
            "engine": {
                "max_model_len": 512,
                "dtype": "float32",
                "task": "generate",
                "start_seconds": 24.5,
            },
            "engine_starts": 1,
            "log": "/w/worker.log",
            "pids": [1, 2],
        },
        "side_by_side": side(
            vllm_run_batch=run(60),
            batchllm_run=run(45),
            warm_worker=run(15) | {"extra": {"job_id": "job_f", "submit_process_seconds": 2.5}},
        )
        | {"run_over_warm": 3.0, "run_batch_over_warm": 4.0, "target_met": True},
    }


def test_the_summary_is_over_all_five_jobs():
    result = warm_result()
    assert result["jobs_with_engine_starts"] == 0
    pickup = result["pickup_to_first_row_seconds"]
    assert (pickup["min"], pickup["median"], pickup["max"]) == (0.02, 0.04, 0.4)
    assert result["target_met"] is True
    assert summarize([job(0, 1.5)], lines=50)["target_met"] is False


def test_the_warm_part_is_opt_in_and_reported_with_its_tables_and_chart(tmp_path: Path):
    assert "warm" in PARTS and "warm" not in DEFAULT_PARTS
    result = {"config": {"model": "/m", "requests": 1}, "contenders": {}, "warm": warm_result()}
    text = summary_text(result)
    assert "ready in 31.0 s from process start (the engine build, 24.5 s of it" in text
    assert "--max-model-len 512" in text and "--enforce-eager" in text
    assert "5 jobs of 50 lines in a row" in text
    assert "5: own max_model_len (3/4 the worker's)" in text and "384 (its own)" in text
    assert "0 of 5 jobs started an engine" in text
    assert "one OpenAI chat file of 100 lines end to end, greedy, max_tokens 64" in text
    assert "run-batch/warm 4.00x (45.0 s sooner; target 3x: met)" in text
    assert "run/warm 3.00x (30.0 s sooner)" in text
    assert "the `batchllm submit` process took 2.5 s" in text
    assert "load average before -> after (on 2 cores): vllm run-batch 0.4 -> 1.9" in text
    chart = draw_chart(result, tmp_path / "bench.png")
    assert chart.stat().st_size > 10_000


def test_the_bench_command_hands_the_warm_flags_to_the_config(monkeypatch, tmp_path: Path):
    seen: list[BenchConfig] = []

    def run_bench(config: BenchConfig, say) -> dict:
        seen.append(config)
        raise click.ClickException("stopped before any work")

    monkeypatch.setattr("batchllm.bench.suite.run_bench", run_bench)
    args = ["bench", "--output", str(tmp_path), "--parts", "warm", "--warm-lines", "20"]
    args += ["--warm-file-lines", "100", "--warm-max-tokens", "32", "--warm-max-model-len", "384"]
    args += [
        "--warm-compiled",
        "--warm-max-num-seqs",
        "64",
        "--warm-max-num-batched-tokens",
        "2048",
    ]
    result = CliRunner().invoke(cli, args)
    assert "stopped before any work" in result.output
    (config,) = seen
    assert config.parts == ("warm",)
    assert (config.warm_lines, config.warm_file_lines, config.warm_max_tokens) == (20, 100, 32)
    assert config.warm_max_model_len == 384 and config.warm_enforce_eager is False
    assert (config.warm_max_num_seqs, config.warm_max_num_batched_tokens) == (64, 2048)
    assert BenchConfig(output=tmp_path).warm_enforce_eager is True
