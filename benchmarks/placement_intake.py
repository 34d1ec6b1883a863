"""What job-wide prefix placement costs at intake: the same file created as a job with placement
on and off (BATCHLLM_PLACE_PREFIXES), side by side in one run, at several sizes: seconds, lines
per second and the intake process's peak memory (each create runs in a process of its own, so
its peak is its own). Placement must keep intake within 10% of file order and memory flat in
the file's size (issue 62): past BATCHLLM_PLACEMENT_MEMORY_MB it spills sorted runs to disk.

    python -m benchmarks.placement_intake --lines 1000000,4000000 --repeats 5
    python -m benchmarks.placement_intake --lines 1000000 --baseline /tmp/before

With --baseline, an older checkout's intake (file order: the tree before placement) is measured
in the same turns, so placed intake is compared with what intake cost before placement existed.

Intake on two cores varies by +-10% from one run to the next, as much as the difference
measured: each size is created `--repeats` times each way, alternating, and the medians
compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from batchllm.bench.parts.overhead import write_lines

MODEL = "bench/placement"  # no engine runs: intake only


# Run in a process of its own, with the tree under test first on the path: this tree, or with
# --baseline an older checkout, which may predate placement (no place_prefixes setting), the
# spec module or resolve_input's move, so the script looks each one up where it may be.
_CHILD = """
import json, sys, time
from pathlib import Path
source, home, place = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
try:
    from batchllm.spec import JobSpec
except ImportError:
    from batchllm.input.schemas import JobSpec
from batchllm.jobs.create import create_job
from batchllm.settings import Settings
placement = {"place_prefixes": place} if "place_prefixes" in Settings.model_fields else {}
settings = Settings(home=Path(home), **placement)
try:  # where the front doors resolve the input before create_job
    from batchllm.input.files.source import resolve_input
    source = resolve_input(source, s3_endpoint=settings.s3_endpoint or "")
except ImportError:
    pass
started = time.perf_counter()
created = create_job(source, JobSpec(model=sys.argv[4]), shard_size=settings.shard_size,
                     settings=settings)
seconds = time.perf_counter() - started
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
print(json.dumps([seconds, peak, len(created.stored.shards)]))
"""


def measure(source: Path, work: Path, place: bool, tree: str | None = None) -> dict[str, Any]:
    """One job created from `source` in a fresh home, in a process of its own (so its peak
    memory is its own), by this checkout or by the one at `tree`."""
    home = work / ("placed" if place else "file-order")
    env = dict(os.environ, PYTHONPATH=tree or str(Path(__file__).resolve().parents[1]))
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(source), str(home), "1" if place else "0", MODEL],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    shutil.rmtree(home, ignore_errors=True)
    if child.returncode != 0:
        raise SystemExit(f"a create failed ({tree or 'this checkout'}):\n{child.stderr}")
    seconds, rss, shards = json.loads(child.stdout.strip().splitlines()[-1])
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
    parser.add_argument(
        "--baseline",
        type=Path,
        help="an older checkout (a git worktree): its file-order intake measured beside, in turn",
    )
    args = parser.parse_args(argv)
    baseline = str(args.baseline.resolve()) if args.baseline else None
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
            before: list[dict[str, Any]] = []
            for _ in range(args.repeats):
                for place in (False, True):
                    runs[place].append(measure(source, work, place=place))
                if baseline is not None:
                    before.append(measure(source, work, place=False, tree=baseline))
            off, on = _median(runs[False]), _median(runs[True])
            row = {
                "lines": lines,
                "file_order": off,
                "placed": on,
                "placed_vs_file_order_seconds": on["seconds"] / off["seconds"],
            }
            if before:
                then = _median(before)
                row["baseline"] = {**then, "tree": baseline}
                row["placed_vs_baseline_seconds"] = on["seconds"] / then["seconds"]
            results.append(row)
            print(
                f"{lines:>10,} lines: file order {off['seconds']:6.1f} s "
                f"({lines / off['seconds']:,.0f}/s, peak {off['peak_rss_mib']:,.0f} MiB); "
                f"placed {on['seconds']:6.1f} s ({lines / on['seconds']:,.0f}/s, peak "
                f"{on['peak_rss_mib']:,.0f} MiB): {row['placed_vs_file_order_seconds']:.2f}x "
                f"(medians of {args.repeats})",
                flush=True,
            )
            if before:
                print(
                    f"{'':>10}        baseline's file order {row['baseline']['seconds']:6.1f} s "
                    f"(peak {row['baseline']['peak_rss_mib']:,.0f} MiB): placed "
                    f"{row['placed_vs_baseline_seconds']:.2f}x the baseline",
                    flush=True,
                )
            source.unlink()
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
