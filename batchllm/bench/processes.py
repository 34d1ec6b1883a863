"""The end-to-end contenders: `vllm run-batch` and `batchllm run`, each a fresh process that
starts its own engine, as a user runs them. Both get the same file and the same engine limits.

Wall time runs from process start to exit. The generation part is read from the contender
itself: for run-batch, from its "Reading batch" log line (the engine is up) to its "Writing
outputs" line; for batchllm, the job's wall time as recorded in its SQL database (first request
fed to job finalized).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from batchllm.bench.config import BenchConfig
from batchllm.bench.figures import BenchFailed, Contender, Run, job_run
from batchllm.bench.memory import PeakRss
from batchllm.bench.own_engine import Say
from batchllm.engine.build_log import note_engine_build
from batchllm.process.stopping import stop_child

# vLLM at INFO in both contenders: run-batch's markers are INFO lines, and both logs then show
# the same engine start-up timeline.
_LOG_ENV = {"VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
_RUN_BATCH_STARTS = "Reading batch from"
_RUN_BATCH_ENDS = "Writing outputs to"
# The variant of the one file both contenders run (the shared engine is sized for it too).
END_TO_END_VARIANT = 0


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings every contender runs with (run-batch's own defaults differ): the
    shared engine's scheduler limits and the dtype it resolved `auto` to."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    dtype: str
    enforce_eager: bool = False

    def flags(self) -> list[str]:
        return [
            *scheduler_flags(self.max_model_len, self.max_num_seqs, self.enforce_eager),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--dtype",
            self.dtype,
        ]


def scheduler_flags(max_model_len: int, max_num_seqs: int, enforce_eager: bool) -> list[str]:
    """The engine flags of `batchllm run` (and run-batch) for a context, a batch size and the
    eager mode, in that order."""
    eager = ["--enforce-eager"] if enforce_eager else []
    return [*eager, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]


@dataclass
class _Finished:
    seconds: float
    marks: dict[str, float]  # marker -> seconds from start to the first log line holding it
    peak_rss: int


def _timed(
    command: list[str],
    *,
    log_path: Path,
    markers: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> _Finished:
    """Run `command` to its end, logging its output and timing the first line of each marker."""
    marks: dict[str, float] = {}
    with log_path.open("w") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

        def pump() -> None:
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                for marker in markers:
                    if marker not in marks and marker in line:
                        marks[marker] = time.perf_counter() - started
                log.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        with PeakRss(proc.pid) as memory:
            try:
                code = proc.wait()
            except BaseException:  # Ctrl-C or a stop signal: the child must not outlive us
                stop_child(proc, grace=30)
                raise
        seconds = time.perf_counter() - started
        reader.join()
    if code != 0:
        raise BenchFailed(f"{' '.join(command[:4])} ... exited {code}; see {log_path}")
    return _Finished(seconds=seconds, marks=marks, peak_rss=memory.peak)


def run_vllm_batch(source: Path, workdir: Path, *, model: str, limits: EngineLimits) -> Run:
    output = workdir / "run-batch-output.jsonl"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.run_batch",
        "-i",
        str(source),
        "-o",
        str(output),
        "--model",
        model,
        "--disable-log-stats",
        *limits.flags(),
    ]
    # run-batch builds an engine of its own in its process, which the engine module never sees.
    note_engine_build(f"vllm run-batch {model}")
    done = _timed(
        command,
        log_path=workdir / "run-batch.log",
        markers=(_RUN_BATCH_STARTS, _RUN_BATCH_ENDS),
        env={**os.environ, **_LOG_ENV},
    )
    requests = failed = prompt = completion = 0
    with output.open() as lines:
        for line in lines:
            record = json.loads(line)
            requests += 1
            response = record.get("response") or {}
            if record.get("error") or response.get("status_code") != 200:
                failed += 1
                continue
            usage = response["body"]["usage"]
            prompt += usage["prompt_tokens"]
            completion += usage["completion_tokens"]
    generation = None
    if _RUN_BATCH_STARTS in done.marks and _RUN_BATCH_ENDS in done.marks:
        generation = done.marks[_RUN_BATCH_ENDS] - done.marks[_RUN_BATCH_STARTS]
    return Run(
        seconds=done.seconds,
        requests=requests,
        prompt_tokens=prompt,
        output_tokens=completion,
        failed=failed,
        peak_rss=done.peak_rss,
        generation_seconds=generation,
    )


def run_batchllm(
    source: Path, workdir: Path, *, model: str, limits: EngineLimits, max_tokens: int
) -> Run:
    from batchllm.bench.contenders import bench_settings
    from batchllm.store import service
    from batchllm.store.db import session_scope

    home = workdir / "batchllm-home"
    command = [
        sys.executable,
        "-m",
        "batchllm",
        "run",
        str(source),
        "--model",
        model,
        "--max-tokens",
        str(max_tokens),
        "--ignore-eos",
        *limits.flags(),
        # Cold, as this contender is measured: its own engine, unloaded at its end (the kept
        # part measures a run on a kept engine).
        "--keep-alive",
        "0",
    ]
    # Only the home: a user's BATCHLLM_DATABASE_URL or BATCHLLM_STORAGE must not be used.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    done = _timed(
        command,
        log_path=workdir / "batchllm-run.log",
        env={**env, **_LOG_ENV, "BATCHLLM_HOME": str(home)},
    )
    with session_scope(bench_settings(home)) as session:
        (job,) = service.list_jobs(session, limit=1)
    return job_run(
        job, seconds=done.seconds, peak_rss=done.peak_rss, generation_seconds=job.wall_seconds
    )


def run_end_to_end(
    config: BenchConfig,
    model: str,
    parts: set[str],
    workdir: Path,
    limits: EngineLimits,
    skipped: dict[str, str],
    say: Say,
) -> dict[str, Contender]:
    """`vllm run-batch` and `batchllm run` as processes. run-batch is a peer that may not run
    here (a vLLM without it, a model it refuses): then it is reported as skipped."""
    from batchllm.bench.workload import write_openai_chat

    workload = config.workload
    # One file for both: each process starts its own engine, with an empty prefix cache.
    source = write_openai_chat(
        workdir / "end-to-end.jsonl", workload, END_TO_END_VARIANT, model=model
    )
    steps = []
    if "run-batch" in parts:
        steps.append(
            (
                Contender("vllm_run_batch", "vllm run-batch (end to end)", end_to_end=True),
                lambda: run_vllm_batch(source, workdir, model=model, limits=limits),
            )
        )
    if "run" in parts:
        steps.append(
            (
                Contender("batchllm_run", "batchllm run (end to end)", end_to_end=True),
                lambda: run_batchllm(
                    source, workdir, model=model, limits=limits, max_tokens=workload.max_output
                ),
            )
        )
    for repeat in range(config.process_repeats):
        for contender, go in steps:
            if contender.key in skipped:
                continue
            try:
                run = go()
            except BenchFailed as exc:
                if contender.key != "vllm_run_batch":
                    raise
                skipped[contender.key] = str(exc)
                say(f"[end to end] {contender.label} did not run: {exc}")
                continue
            contender.runs.append(run)
            say(
                f"[end to end] {contender.label}, repeat {repeat + 1}/{config.process_repeats}: "
                f"{run.seconds:.1f} s wall, "
                f"{run.output_tokens / (run.generation_seconds or run.seconds):,.0f} "
                "output tokens/s generating"
            )
    return {contender.key: contender for contender, _ in steps if contender.runs}
