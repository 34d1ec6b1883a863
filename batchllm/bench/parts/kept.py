"""The kept part: what a kept engine saves a user's `batchllm run`, by file size. A cold run
(`--keep-alive 0`: it starts vLLM itself) and a warm one (a kept engine of the same model and
flags is up) against llama.cpp's server with 1 slot and with N, the server's start counted as
a user waits for it, on the peers part's real questions, greedy, the same max_tokens: the
wall time from the command to its last answer, and from the command to its first answer
(batchllm's first committed Parquet part; llama.cpp's first response).

Each contender is a fresh process as a user starts it; the kept engine is started once before
the sizes (`batchllm engine start`, its time reported apart) and stopped at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from batchllm.bench.figures import BenchFailed
from batchllm.bench.own_engine import Say
from batchllm.bench.parts.llama_cpp import LlamaServer, find_llama_server
from batchllm.bench.processes import scheduler_flags
from batchllm.bench.workload import Workload, iter_requests, write_openai_chat

LLAMA_1, LLAMA_N, COLD, WARM = "llama_cpp_1_slot", "llama_cpp_slots", "run_cold", "run_warm"
_RUN_TIMEOUT = 3600.0


@dataclass(frozen=True)
class KeptConfig:
    model: str  # the demo's chat model directory
    gguf: Path  # llama.cpp's Q4_1 GGUF of it
    workload: Workload  # natural questions; its `requests` is replaced by each size
    sizes: tuple[int, ...]
    slots: int  # llama.cpp's N slots (and requests in flight)
    one_slot_max: int  # llama.cpp's 1 slot answers at most this many (one by one: slow)
    max_model_len: int
    max_num_seqs: int
    enforce_eager: bool
    workdir: Path
    say: Say
    llama_server: str | None = None
    threads: int = os.cpu_count() or 1

    def engine_flags(self) -> list[str]:
        return scheduler_flags(self.max_model_len, self.max_num_seqs, self.enforce_eager)


def run_kept(config: KeptConfig) -> dict[str, Any]:
    binary = find_llama_server(config.llama_server)
    say, workdir = config.say, config.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    warm_home, cold_home = workdir / "warm-home", workdir / "cold-home"
    result: dict[str, Any] = {"sizes": [], "slots": config.slots, "load_average": {}}
    result["load_average"]["start"] = os.getloadavg()
    say("[kept] starting the kept engine (`batchllm engine start`, not counted below)")
    started = time.perf_counter()
    _batchllm(
        ["engine", "start", "--model", config.model, *config.engine_flags(), "--keep-alive", "-1"],
        warm_home,
        workdir / "engine-start.log",
    )
    result["engine_start_seconds"] = time.perf_counter() - started
    try:
        for size in config.sizes:
            workload = replace(config.workload, requests=size)
            source = write_openai_chat(workdir / f"q{size}.jsonl", workload, 1, model=config.model)
            row: dict[str, Any] = {"requests": size}
            for key, slots in ((LLAMA_1, 1), (LLAMA_N, config.slots)):
                if slots == 1 and size > config.one_slot_max:
                    row[key] = {"skipped": f"more than {config.one_slot_max} requests one by one"}
                    continue
                row[key] = _llama(
                    config, binary, workload, slots, workdir / f"llama-{slots}-{size}.log"
                )
                say(f"[kept] {size} requests: {key} {_said(row[key])}")
            for key, home, keep in ((COLD, cold_home, "0"), (WARM, warm_home, "-1")):
                row[key] = _run(config, source, home, keep, workdir / f"{key}-{size}.log")
                say(f"[kept] {size} requests: {key} {_said(row[key])}")
            row["warm_answers_equal_cold"] = _agreement(
                row[WARM].pop("texts"), row[COLD].pop("texts")
            )
            result["sizes"].append(row)
    finally:
        _batchllm(["engine", "stop", "--all", "--force"], warm_home, workdir / "engine-stop.log")
    result["load_average"]["end"] = os.getloadavg()
    return result


def _said(figures: dict[str, Any]) -> str:
    return f"{figures['wall_seconds']:.1f} s, first answer at {figures['first_seconds']:.1f} s"


def _env(home: Path) -> dict[str, str]:
    # Only the home: a user's BATCHLLM_DATABASE_URL, STORAGE or KEEP_ALIVE must not be used.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
    return {**env, "BATCHLLM_HOME": str(home)}


def _batchllm(args: list[str], home: Path, log_path: Path) -> None:
    with log_path.open("w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "batchllm", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(home),
            timeout=_RUN_TIMEOUT,
        )
    if done.returncode != 0:
        raise BenchFailed(f"batchllm {' '.join(args[:2])} exited {done.returncode}; see {log_path}")


def _run(config: KeptConfig, source: Path, home: Path, keep: str, log_path: Path) -> dict[str, Any]:
    """One `batchllm run` as a user types it: the wall time to its exit, and to its first
    committed part (the first answers `results --follow` shows)."""
    from batchllm.bench.contenders import bench_settings
    from batchllm.bench.parts.peers import job_output
    from batchllm.store import service
    from batchllm.store.db import session_scope

    began_wall, began = time.time(), time.perf_counter()
    _batchllm(
        [
            "run",
            str(source),
            "--model",
            config.model,
            "--temperature",
            "0",
            "--max-tokens",
            str(config.workload.max_output),
            *config.engine_flags(),
            "--keep-alive",
            keep,
        ],
        home,
        log_path,
    )
    wall = time.perf_counter() - began
    settings = bench_settings(home)
    with session_scope(settings) as session:
        (job,) = service.list_jobs(session, limit=1)
        job_id, tokens = job.id, job.completion_tokens
    texts, first = job_output(job_id, settings)
    return {
        "wall_seconds": wall,
        "first_seconds": (first - began_wall) if first else wall,
        "output_tokens": tokens,
        "job_id": job_id,
        "texts": texts,
    }


def _llama(
    config: KeptConfig, binary: Path, workload: Workload, slots: int, log_path: Path
) -> dict[str, Any]:
    """A fresh llama-server (its start counted) answering the questions, `slots` at a time."""
    requests = list(iter_requests(workload, 1))
    with LlamaServer(
        binary,
        config.gguf,
        slots=slots,
        slot_context=config.max_model_len,
        threads=config.threads,
        log_path=log_path,
    ) as server:
        run = server.run(requests)
    return {
        "wall_seconds": server.start_seconds + run.seconds,
        "first_seconds": server.start_seconds + run.first_seconds,
        "start_seconds": server.start_seconds,
        "output_tokens": run.output_tokens,
    }


def _agreement(warm: dict[str, str], cold: dict[str, str]) -> str:
    same = sum(1 for key, text in cold.items() if warm.get(key) == text)
    return f"{same}/{len(cold)}"


def kept_table(result: dict[str, Any]) -> str:
    """The part's figures as a terminal table: each size's wall and first-answer times, and
    the warm run's ratio to each llama.cpp server (above 1: batchllm is faster)."""
    lines = [
        f"kept engine: cold and warm `batchllm run` vs llama.cpp (1 and {result['slots']} slots, "
        "start counted); seconds, wall / first answer",
        f"{'requests':>8}  {'llama 1':>13}  {'llama N':>13}  {'run cold':>13}  {'run warm':>13}"
        f"  {'warm vs 1':>10}  {'warm vs N':>10}",
    ]
    for row in result["sizes"]:
        cells, ratios = [], []
        for key in (LLAMA_1, LLAMA_N, COLD, WARM):
            figures = row[key]
            cells.append(
                "skipped"
                if "skipped" in figures
                else f"{figures['wall_seconds']:.1f} / {figures['first_seconds']:.1f}"
            )
        warm = row[WARM]["wall_seconds"]
        for key in (LLAMA_1, LLAMA_N):
            figures = row[key]
            ratios.append("-" if "skipped" in figures else f"{figures['wall_seconds'] / warm:.2f}x")
        lines.append(
            f"{row['requests']:>8}  "
            + "  ".join(f"{c:>13}" for c in cells)
            + "  "
            + "  ".join(f"{r:>10}" for r in ratios)
        )
    lines.append(
        f"the kept engine started in {result['engine_start_seconds']:.1f} s, once, before the sizes"
    )
    return "\n".join(lines)


def draw_kept(ax: Any, result: dict[str, Any]) -> None:
    """Wall time per file size, each contender a bar (log scale: seconds to minutes)."""
    labels = {
        LLAMA_1: "llama.cpp 1 slot",
        LLAMA_N: f"llama.cpp {result['slots']} slots",
        COLD: "batchllm run, cold",
        WARM: "batchllm run, kept engine",
    }
    sizes = [row["requests"] for row in result["sizes"]]
    width = 0.2
    for i, key in enumerate(labels):
        walls = [row[key].get("wall_seconds", 0.0) for row in result["sizes"]]
        ax.bar([n + (i - 1.5) * width for n in range(len(sizes))], walls, width, label=labels[key])
    ax.set_xticks(range(len(sizes)), [f"{n:,}" for n in sizes])
    ax.set_yscale("log")
    ax.set_xlabel("questions in the file")
    ax.set_ylabel("seconds from the command to the last answer")
    ax.set_title("kept engine: run end to end", fontsize=9)
    ax.legend(fontsize=7)
