"""What job-wide prefix placement costs at intake: the same file created as a job with placement
on and off (BATCHLLM_PLACE_PREFIXES), side by side in one run, at several sizes: seconds, lines
per second and the intake process's peak memory (each create runs in a process of its own, so
its peak is its own). Placement must keep intake within 10% of file order and memory flat in
the file's size (issue 62): past BATCHLLM_PLACEMENT_MEMORY_MB it spills sorted runs to disk.

    python -m benchmarks.placement_intake --lines 1000000,4000000 --repeats 5

Intake on two cores varies by +-10% from one run to the next, as much as the difference
measured: each size is created `--repeats` times each way, alternating, and the medians
compared.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batchllm.bench.parts.overhead import peak_rss, write_lines

MODEL = "bench/placement"  # no engine runs: intake only


def _create(source: str, home: str, place: bool, out: Any) -> None:
    """One job created from `source` in a fresh home; (seconds, peak RSS, shards) to `out`."""
    from batchllm.input.files.source import resolve_input
    from batchllm.jobs.create import create_job
    from batchllm.settings import Settings
    from batchllm.spec import JobSpec

    settings = Settings(home=Path(home), place_prefixes=place)
    started = time.perf_counter()
    created = create_job(
        resolve_input(source, s3_endpoint=settings.resolved_s3_endpoint),
        JobSpec(model=MODEL),
        shard_size=settings.shard_size,
        settings=settings,
    )
    out.send((time.perf_counter() - started, peak_rss(), len(created.stored.shards)))


def measure(source: Path, work: Path, place: bool) -> dict[str, Any]:
    home = work / ("placed" if place else "file-order")
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("spawn").Process(
        target=_create, args=(str(source), str(home), place, send)
    )
    child.start()
    seconds, rss, shards = receive.recv()
    child.join()
    shutil.rmtree(home, ignore_errors=True)
    return {"seconds": seconds, "peak_rss_mib": rss / 2**20, "shards": shards}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median seconds, with every run's seconds beside it."""
    ordered = sorted(runs, key=lambda run: run["seconds"])
    return {**ordered[len(ordered) // 2], "all_seconds": [run["seconds"] for run in runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", default="1000000,4000000", help="file sizes, comma-separated")
    parser.add_argument(
        "--repeats", type=int, default=5, help="creates each way per size (medians compared)"
    )
    parser.add_argument("--output", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="batchllm-placement-bench-") as scratch:
        work = Path(scratch)
        for lines in (int(n) for n in args.lines.split(",")):
            source = write_lines(
                work / f"{lines}.jsonl",
                lines,
                model=MODEL,
                prompt_words=(8, 24),
                output_tokens=(8, 64),
            )
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for _ in range(args.repeats):
                for place in (False, True):
                    runs[place].append(measure(source, work, place=place))
            off, on = _median(runs[False]), _median(runs[True])
            row = {
                "lines": lines,
                "file_order": off,
                "placed": on,
                "placed_vs_file_order_seconds": on["seconds"] / off["seconds"],
            }
            results.append(row)
            print(
                f"{lines:>10,} lines: file order {off['seconds']:6.1f} s "
                f"({lines / off['seconds']:,.0f}/s, peak {off['peak_rss_mib']:,.0f} MiB); "
                f"placed {on['seconds']:6.1f} s ({lines / on['seconds']:,.0f}/s, peak "
                f"{on['peak_rss_mib']:,.0f} MiB): {row['placed_vs_file_order_seconds']:.2f}x "
                f"(medians of {args.repeats})",
                flush=True,
            )
            source.unlink()
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
