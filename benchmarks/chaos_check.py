"""The chaos run's checker, in the spirit of Jepsen's total-queue checker: after the run
drained, every input line of every job is in the job's Parquet output exactly once (an `ok` row
or an honest error row), no row the input never asked for, every job completed within a bound
of the last fault, the database's counts (rows and tokens) agree with the rows, the workers'
Prometheus counters agree with the database (benchmarks/chaos_metrics.py), and no process of
the run is left.

It reads what the harness (benchmarks/chaos.py) recorded in `run.json` (the jobs, their inputs
and final states, the faults, the committed-rows timeline, the workers, any process left) and
the jobs' output as batchllm's readers see it (output/parts.py `read_output`: the committed part
files), so it can be run again on a finished run's directory:

    python -m benchmarks.chaos_check .demo/chaos
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from batchllm.output.parts import generated_tokens, read_output
from batchllm.storage import Storage
from benchmarks.chaos_metrics import check_metrics, committed_by, not_checked

SHOWN = 10  # line numbers listed per finding; the counts are whole
RESULT_REASONS = ("stop", "length")  # an `ok` row with another finish reason is no result
RATE_BUCKET_S = 5.0
COLOURS = ["tab:red", "tab:orange", "tab:purple", "tab:blue", "tab:green", "tab:brown"]


# -- the input: what each job was asked ---------------------------------------------------


def custom_id_of(raw: str, number: int) -> str:
    """The custom_id batchllm gives the row of this input line: the line's own when it is a
    string that can be written as UTF-8, else `line-N` (a malformed line, a lone surrogate)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    given = obj.get("custom_id") if isinstance(obj, dict) else None
    if isinstance(given, str) and given:
        try:
            given.encode()
            return given
        except UnicodeEncodeError:
            pass
    return f"line-{number}"


def expected_lines(source: Path) -> dict[int, str]:
    """Every line of a JSONL input (numbered from 1) and the custom_id its row must carry."""
    with source.open(encoding="utf-8", errors="surrogateescape") as lines:
        return {n: custom_id_of(raw.rstrip("\n"), n) for n, raw in enumerate(lines, start=1)}


@dataclass
class Expectation:
    """The status each line's row must have: `default` ("ok" or "error") unless `lines` says
    otherwise for a line ("ok", "error", or "any" where either is honest)."""

    default: str = "ok"
    lines: dict[int, str] = field(default_factory=dict)

    def status_of(self, line: int) -> str:
        return self.lines.get(line, self.default)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Expectation:
        data = data or {}
        return cls(
            default=data.get("default", "ok"),
            lines={int(k): v for k, v in (data.get("lines") or {}).items()},
        )


# -- one job's rows -------------------------------------------------------------------------


@dataclass
class RowsCheck:
    """What one job's output holds against its input. Each list holds the first SHOWN line
    numbers of a finding; the `*_count` fields the whole count."""

    expected: int
    rows: int
    ok_rows: int
    error_rows: int
    lost_count: int = 0
    lost: list[int] = field(default_factory=list)
    duplicated_count: int = 0  # lines with more than one row (each counted once)
    duplicated: list[int] = field(default_factory=list)
    unexpected_count: int = 0  # rows no input line asked for (unknown line or custom_id)
    unexpected: list[int] = field(default_factory=list)
    wrong_status_count: int = 0
    wrong_status: list[int] = field(default_factory=list)
    not_results_count: int = 0  # `ok` rows with a finish reason other than stop/length
    not_results: list[int] = field(default_factory=list)

    @property
    def exactly_once(self) -> bool:
        return not (self.lost_count or self.duplicated_count or self.unexpected_count)

    @property
    def passed(self) -> bool:
        return self.exactly_once and not (self.wrong_status_count or self.not_results_count)


def _note(found: list[int]) -> tuple[int, list[int]]:
    return len(found), sorted(found)[:SHOWN]


def check_rows(
    rows: pa.Table | list[dict[str, Any]],
    expected: dict[int, str],
    expect: Expectation | None = None,
) -> RowsCheck:
    """Check a job's output rows (its Parquet table, or rows as dicts with at least line,
    custom_id, status and finish_reason) against its input lines (line -> custom_id)."""
    if isinstance(rows, pa.Table):
        wanted = [
            c for c in ("line", "custom_id", "status", "finish_reason") if c in rows.schema.names
        ]
        rows = rows.select(wanted).to_pylist()
    expect = expect or Expectation()
    matching: Counter[int] = Counter()
    unexpected, wrong_status, not_results = [], [], []
    for row in rows:
        line = row["line"]
        if expected.get(line) != row["custom_id"]:
            unexpected.append(line)
            continue
        matching[line] += 1
        if matching[line] > 1:
            continue  # the first of a line's rows is the one judged; the others are duplicates
        status, wanted_status = row["status"], expect.status_of(line)
        if wanted_status != "any" and status != wanted_status:
            wrong_status.append(line)
        if status == "ok" and row.get("finish_reason") not in RESULT_REASONS:
            not_results.append(line)
    check = RowsCheck(
        expected=len(expected),
        rows=len(rows),
        ok_rows=sum(r["status"] == "ok" for r in rows),
        error_rows=sum(r["status"] == "error" for r in rows),
    )
    check.lost_count, check.lost = _note([n for n in expected if not matching[n]])
    check.duplicated_count, check.duplicated = _note([n for n, c in matching.items() if c > 1])
    check.unexpected_count, check.unexpected = _note(unexpected)
    check.wrong_status_count, check.wrong_status = _note(wrong_status)
    check.not_results_count, check.not_results = _note(not_results)
    return check


def checked_output(job: dict[str, Any]) -> tuple[str, str]:
    """Where a recorded job's output is read (storage root, output directory): its storage,
    or the run's local copy of it (`checked_root`, `checked_output_dir`) when the storage was
    a bucket of the run's own S3 server, which ended with the run."""
    if job.get("checked_root"):
        return str(job["checked_root"]), str(job["checked_output_dir"])
    return str(job["storage_root"]), str(job["output_dir"])


def job_rows(storage_root: str, output_dir: str) -> pa.Table:
    """A job's committed rows as batchllm's own readers see them (its part files)."""
    return read_output(Storage(storage_root), output_dir)


def output_tokens(table: pa.Table) -> tuple[int, int]:
    """The prompt and completion tokens of a job's rows, counted as a commit counts them
    (output/parts.py part_of): a null (an error row's) as 0, every sample of a row with n > 1."""
    prompt = pc.sum(table["prompt_tokens"]).as_py() or 0
    choices = table["choices"] if "choices" in table.schema.names else None
    if choices is None or choices.null_count == len(choices):  # no row has several samples
        return prompt, pc.sum(table["completion_tokens"]).as_py() or 0
    completion = sum(
        map(generated_tokens, choices.to_pylist(), table["completion_tokens"].to_pylist())
    )
    return prompt, completion


# -- the run --------------------------------------------------------------------------------


def _db_disagrees(job: dict[str, Any], rows: RowsCheck) -> str | None:
    """The database's request counts against the rows the output holds."""
    counts = (job.get("request_total"), job.get("request_completed"), job.get("request_failed"))
    if counts == (rows.expected, rows.ok_rows, rows.error_rows):
        return None
    return (
        f"database total/completed/failed {counts[0]}/{counts[1]}/{counts[2]}, output "
        f"{rows.expected} lines, {rows.ok_rows} ok and {rows.error_rows} error rows"
    )


def _has_token_counts(job: dict[str, Any]) -> bool:
    """Whether run.json recorded the job's token counts (an older harness did not)."""
    return "prompt_tokens" in job and "completion_tokens" in job


def _tokens_disagree(job: dict[str, Any], tokens: tuple[int, int]) -> str | None:
    """The database's token counts against the sums over the rows the output holds."""
    recorded = (job["prompt_tokens"], job["completion_tokens"])
    if recorded == tokens:
        return None
    return (
        f"database prompt/completion tokens {recorded[0]}/{recorded[1]}, output rows "
        f"{tokens[0]}/{tokens[1]}"
    )


def _first_sample_after(timeline: list[list[Any]], since: float, above: int) -> float | None:
    for t, committed in timeline:
        if t > since and committed is not None and committed > above:
            return float(t)
    return None


def _shard_moved(progress: dict[str, list[list[Any]]], held: list[dict[str, Any]], since: float):
    """When the first shard the victim held moved on after `since`: more rows committed, or
    ended."""
    moved = []
    for shard in held:
        for t, done, status in progress.get(str(shard["id"]), []):
            if t > since and (done > shard["done"] or status != "running"):
                moved.append(float(t))
                break
    return min(moved) if moved else None


def fault_recoveries(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each fault with its recovery times: `rows_again_s`, from the fault's start until the
    fleet committed rows again; for a worker's fault `shard_moved_s`, until the shard the
    victim held moved on (taken over, drained, or resumed); for a fault that lasts a while (a
    service down, slow or cut off, a worker paused) `after_heal_s`, from its end (`restored`)
    until the fleet committed rows again."""
    timeline = run.get("timeline", [])
    progress = run.get("shard_progress", {})
    out = []
    for fault in run.get("faults", []):
        began = fault["began"]
        again = _first_sample_after(timeline, began, committed_by(timeline, began))
        moved = _shard_moved(progress, fault.get("held_shards") or [], began)
        restored = fault.get("restored") or began
        healed = None
        if restored - began >= 1:
            healed = _first_sample_after(timeline, restored, committed_by(timeline, restored))
        out.append(
            {
                **fault,
                "rows_again_s": None if again is None else round(again - began, 2),
                "shard_moved_s": None if moved is None else round(moved - began, 2),
                "after_heal_s": None if healed is None else round(healed - restored, 2),
            }
        )
    return out


def rates(timeline: list[list[Any]], bucket: float = RATE_BUCKET_S) -> list[list[float]]:
    """Committed rows per second in buckets of `bucket` seconds: [[bucket start, rows/s]]."""
    known = [[t, c] for t, c in timeline if c is not None]
    if len(known) < 2:
        return []
    out = []
    start, end = known[0][0], known[-1][0]
    t = start
    while t < end:
        out.append(
            [round(t, 1), (committed_by(known, t + bucket) - committed_by(known, t)) / bucket]
        )
        t += bucket
    return out


def _job_entry(job: dict[str, Any], last_fault: float) -> dict[str, Any]:
    """One job's part of the report: its rows' check, when it ended, and how the database's
    counts compare with its rows."""
    table = job_rows(*checked_output(job))
    rows = check_rows(
        table, expected_lines(Path(job["input"])), Expectation.from_json(job.get("expect"))
    )
    final_at = job.get("final_at")
    late = None if final_at is None else round(max(0.0, final_at - last_fault), 1)
    tokens = output_tokens(table)
    tokens_checked = _has_token_counts(job)
    return {
        "id": job["id"],
        "tenant": job["tenant"],
        "status": job.get("status"),
        "final_after_last_fault_s": late,
        "db_disagrees": _db_disagrees(job, rows),
        "tokens_checked": tokens_checked,
        "output_prompt_tokens": tokens[0],
        "output_completion_tokens": tokens[1],
        "tokens_disagree": _tokens_disagree(job, tokens) if tokens_checked else None,
        **asdict(rows),
    }


def _job_problems(entry: dict[str, Any], job: dict[str, Any], bound: float) -> list[str]:
    name = f"{job['tenant']} ({job['id']})"
    problems = []
    late = entry["final_after_last_fault_s"]
    if job.get("status") != "completed":
        problems.append(f"{name} ended {job.get('status')}: {job.get('error')}")
    elif late is None or late > bound:
        problems.append(f"{name} final {late} s after the last fault (bound {bound:.0f} s)")
    for finding in ("lost", "duplicated", "unexpected", "wrong_status", "not_results"):
        count = entry[f"{finding}_count"]
        if count:
            problems.append(f"{name}: {count} {finding} (lines {entry[finding]})")
    for disagreement in ("db_disagrees", "tokens_disagree"):
        if entry[disagreement]:
            problems.append(f"{name}: {entry[disagreement]}")
    return problems


def _metrics_check(run: dict[str, Any]) -> dict[str, Any]:
    """The workers' scraped counters against the database's rows over every job; a run.json
    without scrapes (workers run without --metrics-port, an older harness) is not checked."""
    if not run.get("metrics"):
        return not_checked("run.json has no metrics")
    if run["metrics"].get("all_final") is False:
        # The last scrape was not the last word: the workers committed on while they stopped.
        return not_checked("not every job was final at the last scrape")
    jobs = run["jobs"]
    db_rows = sum((j.get("request_completed") or 0) + (j.get("request_failed") or 0) for j in jobs)
    with_tokens = all("completion_tokens" in j for j in jobs)
    db_tokens = sum(j["completion_tokens"] or 0 for j in jobs) if with_tokens else None
    return check_metrics(
        run["metrics"], run.get("workers", []), run.get("timeline", []), db_rows, db_tokens
    )


def check_run(run: dict[str, Any]) -> dict[str, Any]:
    """The report of a recorded run: per job its rows' check and its end, the faults with
    their recovery times, rows/s over time, the workers' metrics against the database, the
    processes left, and the verdict."""
    config = run.get("config", {})
    bound = float(config.get("final_within", 120))
    faults = fault_recoveries(run)
    last_fault = max((f.get("restored") or f["began"] for f in faults), default=0.0)
    jobs, problems = [], []
    for job in run["jobs"]:
        entry = _job_entry(job, last_fault)
        jobs.append(entry)
        problems += _job_problems(entry, job, bound)
    metrics = _metrics_check(run)
    if not metrics["passed"]:
        problems.append(metrics["problem"])
    orphans = run.get("orphans", [])
    if orphans:
        problems.append(f"{len(orphans)} process(es) of the run left: {orphans}")
    running = [w["name"] for w in run.get("workers", []) if w.get("exit") is None]
    if running:
        problems.append(f"workers never seen to end: {running}")
    # A worker that died on its own lost no row if the checks above pass, but the fleet was a
    # worker short until it was replaced (the harness does so, as a supervisor would): a
    # warning, named in the summary, not a failure of exactly-once.
    warnings = [
        f"{w['name']} exited on its own (exit {w['exit']}): {w['last_complaint']}"
        for w in run.get("unplanned_exits", [])
    ]
    by_kind = Counter(f["kind"] for f in faults)
    return {
        "passed": not problems,
        "problems": problems,
        "warnings": warnings,
        "totals": {
            key: sum(j[key] for j in jobs)
            for key in ("expected", "rows", "lost_count", "duplicated_count", "unexpected_count")
        },
        "jobs": jobs,
        "metrics": metrics,
        "faults": faults,
        "faults_by_kind": dict(sorted(by_kind.items())),
        "rows_per_s": rates(run.get("timeline", [])),
        "orphans": orphans,
        "workers": run.get("workers", []),
        "seconds": run.get("ended"),
        "config": config,
    }


# -- the report -----------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary(report: dict[str, Any]) -> str:
    """One screen: the verdict, each job's counts, the faults by kind with recovery times."""
    lines = [
        f"chaos run: {'PASSED' if report['passed'] else 'FAILED'} in "
        f"{_seconds(report.get('seconds'))} s; {report['totals']['expected']:,} lines, "
        f"{len(report['faults'])} faults, {len(report['orphans'])} processes left",
        f"{'job':<22} {'tenant':<10} {'status':<10} {'lines':>7} {'ok':>7} {'error':>6} "
        f"{'lost':>5} {'dup':>5} {'unexp':>5} {'final+s':>8}",
    ]
    for job in report["jobs"]:
        lines.append(
            f"{job['id']:<22} {job['tenant']:<10} {job['status']!s:<10} {job['expected']:>7,} "
            f"{job['ok_rows']:>7,} {job['error_rows']:>6,} {job['lost_count']:>5} "
            f"{job['duplicated_count']:>5} {job['unexpected_count']:>5} "
            f"{_seconds(job['final_after_last_fault_s']):>8}"
        )
    lines.append(
        f"{'fault':<14} {'count':>5} {'rows again s (median/max)':>26} "
        f"{'after heal s (max)':>19} {'shard moved s (max)':>20}"
    )
    for kind, count in report["faults_by_kind"].items():
        of_kind = [f for f in report["faults"] if f["kind"] == kind]
        again = sorted(f["rows_again_s"] for f in of_kind if f["rows_again_s"] is not None)
        healed = [f["after_heal_s"] for f in of_kind if f.get("after_heal_s") is not None]
        moved = [f["shard_moved_s"] for f in of_kind if f["shard_moved_s"] is not None]
        shown = f"{again[len(again) // 2]:.1f}/{again[-1]:.1f}" if again else "-"
        lines.append(
            f"{kind:<14} {count:>5} {shown:>26} {_seconds(max(healed) if healed else None):>19} "
            f"{_seconds(max(moved) if moved else None):>20}"
        )
    peak = max((r for _, r in report["rows_per_s"]), default=0.0)
    lines.append(f"rows/s: peak {peak:,.0f} over {RATE_BUCKET_S:.0f} s buckets")
    lines.append(_tokens_line(report["jobs"]))
    lines.append(_metrics_line(report.get("metrics") or not_checked("no metrics in the report")))
    lines += [f"PROBLEM: {p}" for p in report["problems"][:10]]
    lines += [f"WARNING: {w[:200]}" for w in report.get("warnings", [])[:5]]
    return "\n".join(lines)


def _tokens_line(jobs: list[dict[str, Any]]) -> str:
    unchecked = sum(not j.get("tokens_checked") for j in jobs)
    disagree = sum(bool(j.get("tokens_disagree")) for j in jobs)
    if unchecked == len(jobs):
        return "tokens vs rows: not checked (run.json has no token counts)"
    line = f"tokens vs rows: {len(jobs) - unchecked - disagree} of {len(jobs)} jobs agree"
    if disagree:
        line += f", {disagree} DISAGREE"
    if unchecked:
        line += f", {unchecked} not checked"
    return line


def _metrics_line(metrics: dict[str, Any]) -> str:
    if not metrics["checked"]:
        return f"metrics vs database: {metrics['note']}"
    tokens = metrics["db_completion_tokens"]
    return (
        f"metrics vs database: {'ok' if metrics['passed'] else 'FAILED'}; rows "
        f"{metrics['metrics_rows']:,} of {metrics['db_rows']:,} ({metrics['unscraped_rows']:,} "
        f"unscraped, slack {metrics['allowed_slack']:,}); completion tokens "
        f"{metrics['metrics_completion_tokens']:,} of {'-' if tokens is None else f'{tokens:,}'}"
    )


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Rows/s over time with each fault marked; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    kinds = sorted(report["faults_by_kind"])
    colours = dict(zip(kinds, COLOURS * (1 + len(kinds) // len(COLOURS))))
    figure, axes = plt.subplots(figsize=(10, 4))
    if report["rows_per_s"]:
        times, values = zip(*report["rows_per_s"])
        axes.step(times, values, where="post", color="black", linewidth=1.2, label="rows/s")
    labelled = set()
    for fault in report["faults"]:
        end = fault.get("restored") or fault["began"]
        axes.axvspan(
            fault["began"],
            max(end, fault["began"] + 0.5),
            color=colours[fault["kind"]],
            alpha=0.35,
            label=None if fault["kind"] in labelled else fault["kind"],
        )
        labelled.add(fault["kind"])
    axes.set_xlabel("seconds since the jobs were submitted")
    axes.set_ylabel(f"rows committed per second ({RATE_BUCKET_S:.0f} s buckets)")
    axes.set_title(f"chaos run: {'passed' if report['passed'] else 'FAILED'}")
    axes.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_report(run_dir: Path, run: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check the run recorded in `run_dir` (its run.json unless `run` is given); writes
    report.json and rows.png there, returns the report."""
    if run is None:
        run = json.loads((run_dir / "run.json").read_text())
    report = check_run(run)
    (run_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, run_dir / "rows.png")
    return report


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check a chaos run (benchmarks/chaos.py).")
    parser.add_argument("run_dir", type=Path, help="the run's --output directory")
    args = parser.parse_args(list(argv) if argv is not None else None)
    report = write_report(args.run_dir)
    print(summary(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
