"""The smoke run's checks and its one table (scripts/smoke.sh, `make gpu-smoke`/`cpu-smoke`).

    python -m batchllm.bench.smoke --job-json JOB.json --lines N      # check the job, print its line
    python -m batchllm.bench.smoke BENCH.json [--job-json JOB.json --lines N]   # ... and the table

The job check reads the job's Parquet output back (not only its SQL counts), so a smoke run
passes only when every input line became exactly one output row. The table is the engine part
of `batchllm bench`: raw vLLM, the fixed batches and batchllm on one shared engine, as output
tokens/s and as a ratio to raw vLLM, which is the figure a user reports.

Exit code 1, with a line saying what is wrong, when a check fails or a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from batchllm.bench.display import format_table, spread

RAW = "vllm_generate"
BATCHLLM = "batchllm_engine"
_BATCHES = "vllm_batches_"


class SmokeFailed(Exception):
    """A smoke check failed; the message says which and why."""


def _load(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise SmokeFailed(f"{what} {path}: cannot be read ({exc.strerror})") from exc
    except ValueError as exc:
        raise SmokeFailed(f"{what} {path}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise SmokeFailed(f"{what} {path}: not a JSON object")
    return data


def check_job(job: dict[str, Any], lines: int) -> dict[str, int]:
    """The job completed with one output row per input line; its Parquet rows agree with the
    counts in its SQL record. Returns the rows read back: total, ok, error, output tokens."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    if job.get("status") != "completed":
        raise SmokeFailed(f"job {job.get('id')} ended {job.get('status')}: {job.get('error')}")
    counts = job["request_counts"]
    if counts["total"] != lines:
        raise SmokeFailed(f"job {job['id']} holds {counts['total']:,} requests, not {lines:,}")
    output = Path(job["output_dir"])
    if not (output / "_SUCCESS").exists():
        raise SmokeFailed(f"job {job['id']}: no _SUCCESS in {output}")
    table = ds.dataset(str(output), format="parquet").to_table(
        columns=["line", "status", "completion_tokens"]
    )
    distinct = len(pc.unique(table["line"]))
    statuses = table["status"].to_pylist()
    read = {
        "rows": table.num_rows,
        "ok": statuses.count("ok"),
        "error": statuses.count("error"),
        "output_tokens": int(pc.sum(table["completion_tokens"]).as_py() or 0),
    }
    if read["rows"] != lines or distinct != lines:
        raise SmokeFailed(
            f"job {job['id']}: {read['rows']:,} output rows for {distinct:,} distinct lines in "
            f"{output}, expected {lines:,} of each"
        )
    if (read["ok"], read["error"]) != (counts["completed"], counts["failed"]):
        raise SmokeFailed(
            f"job {job['id']}: Parquet holds {read['ok']:,} ok and {read['error']:,} error "
            f"rows, its record {counts['completed']:,} and {counts['failed']:,}"
        )
    if read["ok"] == 0:
        raise SmokeFailed(f"job {job['id']}: every row is an error row")
    if read["output_tokens"] != job["throughput"]["completion_tokens"]:
        raise SmokeFailed(
            f"job {job['id']}: {read['output_tokens']:,} output tokens in Parquet, "
            f"{job['throughput']['completion_tokens']:,} in its record"
        )
    return read


def job_line(job: dict[str, Any], read: dict[str, int], process_seconds: float | None) -> str:
    rates = job["throughput"]
    line = (
        f"job: {read['rows']:,} rows ({read['ok']:,} ok, {read['error']:,} error), "
        f"{rates['requests_per_s']:,.1f} rows/s, {rates['output_tokens_per_s']:,.0f} output "
        f"tok/s over {rates['wall_seconds']:,.1f} s"
    )
    if process_seconds is not None:
        line += f" ({process_seconds:,.0f} s for the whole `batchllm run`, engine start included)"
    return line + f"; {rates['hardware']}"


def _rows(contenders: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Raw vLLM, the fixed batches by size, batchllm; fails when one of them is missing."""
    batches = sorted(
        (key for key in contenders if key.startswith(_BATCHES)),
        key=lambda key: int(key.removeprefix(_BATCHES)),
    )
    missing = [key for key in (RAW, BATCHLLM) if key not in contenders]
    if missing or not batches:
        raise SmokeFailed(
            "bench.json lacks the engine part's contenders "
            f"{', '.join(missing or ['vllm_batches_N'])}: was it run with --parts engine?"
        )
    rows = [(key, contenders[key]) for key in (RAW, *batches, BATCHLLM)]
    for _key, figures in rows:
        if not figures["output_tokens_per_s"]["median"] > 0:
            raise SmokeFailed(f"{figures['label']}: no output tokens/s in bench.json")
    return rows


_NAMES = {RAW: "raw vLLM", BATCHLLM: "batchllm"}


def _name(key: str) -> str:
    return _NAMES.get(key) or f"fixed {key.removeprefix(_BATCHES)}"


def bench_table(bench: dict[str, Any]) -> str:
    contenders = bench.get("contenders") or {}
    rows = _rows(contenders)
    base = contenders[RAW]["output_tokens_per_s"]["median"]
    cells = [("contender", "output tok/s", "spread", "req/s", "vs raw vLLM")]
    for key, figures in rows:
        tok = figures["output_tokens_per_s"]
        cells.append(
            (
                _name(key),
                f"{tok['median']:,.0f}",
                spread(tok) if figures["repeats"] > 1 else "1 run",
                f"{figures['requests_per_s']['median']:,.1f}",
                f"{tok['median'] / base:.2f}x",
            )
        )
    config = bench["config"]
    engine = bench.get("engine") or {}
    limits = engine.get("limits") or {}
    repeats = config["repeats"]
    head = (
        f"smoke: {config['model']} on {engine.get('hardware', '?')}, vLLM "
        f"{engine.get('version', '?')}\n"
        f"bench engine part: {config['requests']:,} requests, outputs "
        f"{config['output_tokens'][0]}-{config['output_tokens'][1]} tokens, {repeats} "
        f"{'repeat' if repeats == 1 else 'repeats'}, max_model_len "
        f"{limits.get('max_model_len', '?')}, max_num_seqs {limits.get('max_num_seqs', '?')}"
    )
    return head + "\n\n" + format_table(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchllm.bench.smoke",
        description="Check a smoke run's job and print the smoke table.",
    )
    parser.add_argument("bench_json", nargs="?", type=Path, help="OUT/bench/bench.json")
    parser.add_argument("--job-json", type=Path, help="`batchllm status JOB --json` output")
    parser.add_argument("--lines", type=int, help="input lines of the job: its output rows")
    parser.add_argument(
        "--process-seconds", type=float, help="wall time of the whole `batchllm run`"
    )
    args = parser.parse_args(argv)
    if args.bench_json is None and args.job_json is None:
        parser.error("give BENCH_JSON, --job-json, or both")
    if args.job_json is not None and args.lines is None:
        parser.error("--job-json needs --lines")
    try:
        out = []
        if args.bench_json is not None:
            out.append(bench_table(_load(args.bench_json, "bench figures")))
        if args.job_json is not None:
            job = _load(args.job_json, "job status")
            out.append(job_line(job, check_job(job, args.lines), args.process_seconds))
    except SmokeFailed as exc:
        print(f"smoke check failed: {exc}", file=sys.stderr)
        return 1
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
