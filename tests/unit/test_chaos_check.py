"""The chaos run's checker (benchmarks/chaos_check.py) on hand-made output: it passes a job
whose every input line came out exactly once, and catches a lost, a duplicated and an
unexpected row, a row of the wrong status, and an `ok` row that is no result; a recorded run
read back from Parquet part files on disk is judged the same way, its database token counts
against the rows' tokens and its workers' scraped counters against the database."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from batchllm.output.parts import OUTPUT_SCHEMA, part_name, write_table
from batchllm.storage import Storage
from benchmarks.chaos_check import (
    Expectation,
    check_rows,
    check_run,
    custom_id_of,
    expected_lines,
    fault_recoveries,
    output_tokens,
    summary,
)


def _input(tmp_path: Path, count: int = 5) -> Path:
    source = tmp_path / "input.jsonl"
    lines = [json.dumps({"custom_id": f"c-{n}", "prompt": f"p {n}"}) for n in range(1, count + 1)]
    source.write_text("\n".join(lines) + "\n")
    return source


def _row(line: int, custom_id: str | None = None, status: str = "ok", reason: str = "length"):
    return {
        "custom_id": custom_id or f"c-{line}",
        "line": line,
        "status": status,
        "text": "x" if status == "ok" else None,
        "finish_reason": reason if status == "ok" else None,
        "error": None if status == "ok" else "bad line",
        # An ok row of line N used N + 10 prompt and N completion tokens; an error row none.
        "prompt_tokens": line + 10 if status == "ok" else None,
        "completion_tokens": line if status == "ok" else None,
    }


def _table(rows: list[dict]) -> pa.Table:
    columns = {name: [row.get(name) for row in rows] for name in OUTPUT_SCHEMA.names}
    return pa.Table.from_pydict(columns, schema=OUTPUT_SCHEMA)


def test_a_job_whose_every_line_came_out_once_passes(tmp_path):
    expected = expected_lines(_input(tmp_path))
    check = check_rows(_table([_row(n) for n in (3, 1, 5, 2, 4)]), expected)
    assert check.passed and check.exactly_once
    assert (check.expected, check.rows, check.ok_rows, check.error_rows) == (5, 5, 5, 0)


def test_a_lost_line_is_caught(tmp_path):
    expected = expected_lines(_input(tmp_path))
    check = check_rows(_table([_row(n) for n in (1, 2, 4, 5)]), expected)
    assert not check.passed
    assert (check.lost_count, check.lost) == (1, [3])
    assert check.duplicated_count == check.unexpected_count == 0


def test_a_duplicated_line_is_caught(tmp_path):
    expected = expected_lines(_input(tmp_path))
    check = check_rows(_table([_row(n) for n in (1, 2, 2, 3, 4, 5)]), expected)
    assert not check.passed
    assert (check.duplicated_count, check.duplicated) == (1, [2])
    assert check.lost_count == check.unexpected_count == 0


def test_an_unexpected_row_is_caught_by_line_or_by_custom_id(tmp_path):
    expected = expected_lines(_input(tmp_path))
    rows = [_row(n) for n in range(1, 6)] + [_row(9, "c-9")]
    check = check_rows(_table(rows), expected)
    assert (check.unexpected_count, check.unexpected, check.lost_count) == (1, [9], 0)
    # Line 2's row carries another custom_id: no input line asked for it, and line 2 is lost.
    rows = [_row(n) for n in (1, 3, 4, 5)] + [_row(2, "someone-else")]
    check = check_rows(_table(rows), expected)
    assert (check.unexpected_count, check.lost, check.duplicated_count) == (1, [2], 0)
    assert not check.passed


def test_statuses_are_judged_against_the_expectation(tmp_path):
    expected = expected_lines(_input(tmp_path))
    rows = [_row(1), _row(2, status="error"), _row(3, status="error"), _row(4), _row(5)]
    expect = Expectation(default="ok", lines={2: "error", 3: "any"})
    assert check_rows(_table(rows), expected, expect).passed
    check = check_rows(_table(rows), expected, Expectation())
    assert (check.wrong_status_count, check.wrong_status) == (2, [2, 3])
    assert check.exactly_once and not check.passed


def test_an_ok_row_cut_short_is_no_result(tmp_path):
    expected = expected_lines(_input(tmp_path))
    rows = [_row(n) for n in (1, 2, 4, 5)] + [_row(3, reason="abort")]
    check = check_rows(_table(rows), expected)
    assert (check.not_results_count, check.not_results) == (1, [3])
    assert not check.passed


def test_custom_ids_follow_batchllms_defaults_for_lines_that_cannot_carry_their_own():
    assert custom_id_of(json.dumps({"custom_id": "a", "prompt": "x"}), 4) == "a"
    assert custom_id_of(json.dumps({"custom_id": "a\udc00", "prompt": "x"}), 4) == "line-4"
    assert custom_id_of('{"custom_id": "a", "prompt": ', 7) == "line-7"
    assert custom_id_of(json.dumps({"prompt": "x"}), 2) == "line-2"


def _run(tmp_path: Path, parts: list[list[dict]]) -> dict:
    """A recorded run of one job whose output holds these part files."""
    storage = Storage(str(tmp_path / "storage"))
    out_dir = storage.output_dir("job_1")
    storage.makedirs(out_dir)
    for seq, rows in enumerate(parts):
        write_table(storage, out_dir, part_name(0, seq, attempt=1), _table(rows))
    return {
        "config": {"final_within": 30},
        "jobs": [
            {
                "id": "job_1",
                "tenant": "tenant-1",
                "input": str(_input(tmp_path)),
                "expect": {"default": "ok"},
                "status": "completed",
                "final_at": 50.0,
                "request_total": 5,
                "request_completed": 5,
                "request_failed": 0,
                "storage_root": storage.root,
                "output_dir": out_dir,
            }
        ],
        "faults": [
            {
                "kind": "kill9",
                "began": 10.0,
                "restored": 12.0,
                "victim": "w1@x",
                "held_shards": [{"id": 1, "done": 2}],
            },
            {"kind": "pg-outage", "began": 30.0, "restored": 35.0, "victim": None},
        ],
        "timeline": [[9.5, 2], [10.5, 2], [11.0, 3], [30.5, 3], [35.5, None], [38.0, 5]],
        "shard_progress": {"1": [[5.0, 2, "running"], [24.0, 3, "running"]]},
        "workers": [{"name": "w1@x", "exit": -9}],
        "orphans": [],
        "ended": 60.0,
    }


def test_a_recorded_run_is_read_back_from_its_part_files(tmp_path):
    run = _run(tmp_path, [[_row(1), _row(2)], [_row(3), _row(4), _row(5)]])
    report = check_run(run)
    assert report["passed"], report["problems"]
    assert report["totals"] == {
        "expected": 5,
        "rows": 5,
        "lost_count": 0,
        "duplicated_count": 0,
        "unexpected_count": 0,
    }
    assert report["faults_by_kind"] == {"kill9": 1, "pg-outage": 1}
    assert "PASSED" in summary(report)


def test_a_part_file_committed_twice_fails_the_run(tmp_path):
    run = _run(tmp_path, [[_row(1), _row(2)], [_row(3), _row(4), _row(5)], [_row(2)]])
    report = check_run(run)
    assert not report["passed"]
    assert report["jobs"][0]["duplicated"] == [2]
    # The database counted five rows, the output holds six.
    assert any("database total/completed/failed 5/5/0" in p for p in report["problems"])
    assert "FAILED" in summary(report)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"status": "failed", "error": "boom"}, "ended failed: boom"),
        ({"final_at": 90.0}, "final 55.0 s after the last fault (bound 30 s)"),
    ],
)
def test_a_job_not_completed_in_time_fails_the_run(tmp_path, change, problem):
    run = _run(tmp_path, [[_row(n) for n in range(1, 6)]])
    run["jobs"][0].update(change)
    report = check_run(run)
    assert not report["passed"]
    assert any(problem in p for p in report["problems"]), report["problems"]


def test_a_process_left_behind_fails_the_run(tmp_path):
    run = _run(tmp_path, [[_row(n) for n in range(1, 6)]])
    run["orphans"] = [{"pid": 4242, "cmdline": "python -m batchllm worker --name w2@x"}]
    assert not check_run(run)["passed"]


def test_recovery_times_come_from_the_timeline_and_the_victims_shard():
    run = _run_faults_only()
    kill, outage = fault_recoveries(run)
    # Rows committed again 1 s after the kill; the victim's shard moved 14 s after it.
    assert (kill["rows_again_s"], kill["shard_moved_s"]) == (1.0, 14.0)
    # The database was away: rows again only once it was back (8 s after the outage began).
    assert (outage["rows_again_s"], outage["shard_moved_s"]) == (8.0, None)


def _run_faults_only() -> dict:
    return {
        "faults": [
            {
                "kind": "kill9",
                "began": 10.0,
                "restored": 12.0,
                "held_shards": [{"id": 1, "done": 2}],
            },
            {"kind": "pg-outage", "began": 30.0, "restored": 35.0},
        ],
        "timeline": [[9.5, 2], [10.5, 2], [11.0, 3], [30.5, 3], [35.5, None], [38.0, 5]],
        "shard_progress": {"1": [[5.0, 2, "running"], [24.0, 3, "running"]]},
    }


# -- tokens: the database's counts against the rows' ------------------------------------------


def test_tokens_count_every_sample_and_error_rows_as_none():
    rows = [_row(1), _row(2, status="error"), _row(3)]
    rows[2]["choices"] = [
        {"index": 0, "text": "a", "finish_reason": "length", "completion_tokens": 3},
        {"index": 1, "text": "b", "finish_reason": "stop", "completion_tokens": 5},
    ]
    # Prompt 11 + 13; completion 1 for line 1, both samples (3 + 5) for line 3.
    assert output_tokens(_table(rows)) == (24, 9)
    assert output_tokens(_table([_row(1), _row(2, status="error")])) == (11, 1)


def _with_tokens(run: dict, prompt: int, completion: int) -> dict:
    run["jobs"][0].update(prompt_tokens=prompt, completion_tokens=completion)
    return run


def test_token_counts_equal_to_the_rows_pass(tmp_path):
    # Lines 1-5: prompt 11 + ... + 15 = 65, completion 1 + ... + 5 = 15.
    run = _with_tokens(_run(tmp_path, [[_row(n) for n in range(1, 6)]]), 65, 15)
    report = check_run(run)
    assert report["passed"], report["problems"]
    job = report["jobs"][0]
    assert job["tokens_checked"] and job["tokens_disagree"] is None
    assert (job["output_prompt_tokens"], job["output_completion_tokens"]) == (65, 15)
    assert "tokens vs rows: 1 of 1 jobs agree" in summary(report)


def test_a_token_count_the_rows_do_not_add_up_to_fails_the_run(tmp_path):
    run = _with_tokens(_run(tmp_path, [[_row(n) for n in range(1, 6)]]), 65, 17)
    report = check_run(run)
    assert not report["passed"]
    message = "database prompt/completion tokens 65/17, output rows 65/15"
    assert report["jobs"][0]["tokens_disagree"] == message
    assert report["problems"] == [f"tenant-1 (job_1): {message}"]
    text = summary(report)
    assert "FAILED" in text and message in text and "1 DISAGREE" in text


def test_a_run_json_without_token_counts_passes_with_tokens_not_checked(tmp_path):
    run = _run(tmp_path, [[_row(n) for n in range(1, 6)]])
    assert "prompt_tokens" not in run["jobs"][0]
    report = check_run(run)
    assert report["passed"], report["problems"]
    assert report["jobs"][0]["tokens_checked"] is False
    assert report["jobs"][0]["tokens_disagree"] is None
    assert "tokens vs rows: not checked" in summary(report)


# -- metrics: the workers' scraped counters against the database ------------------------------


def _metrics(rows: int, at: float = 40.0) -> dict:
    return {
        "workers": {"w1@x": {"rows": rows, "prompt_tokens": 0, "completion_tokens": 15, "at": at}},
        "final_scrape_at": at,
    }


def test_a_run_json_without_metrics_passes_with_metrics_not_checked(tmp_path):
    report = check_run(_run(tmp_path, [[_row(n) for n in range(1, 6)]]))
    assert report["passed"], report["problems"]
    assert report["metrics"]["checked"] is False
    assert "metrics vs database: not checked" in summary(report)


def test_metrics_agreeing_with_the_database_pass(tmp_path):
    run = _with_tokens(_run(tmp_path, [[_row(n) for n in range(1, 6)]]), 65, 15)
    run["workers"] = [{"name": "w1@x", "started": -1.0, "ended": 55.0, "exit": 0}]
    run["metrics"] = _metrics(rows=5)
    report = check_run(run)
    assert report["passed"], report["problems"]
    assert report["metrics"]["checked"] and report["metrics"]["passed"]
    assert (report["metrics"]["metrics_rows"], report["metrics"]["db_rows"]) == (5, 5)
    assert report["metrics"]["db_completion_tokens"] == 15
    assert "metrics vs database: ok; rows 5 of 5" in summary(report)


def test_metrics_counting_more_rows_than_the_database_fail_the_run(tmp_path):
    run = _run(tmp_path, [[_row(n) for n in range(1, 6)]])
    run["workers"] = [{"name": "w1@x", "started": -1.0, "ended": 55.0, "exit": 0}]
    run["metrics"] = _metrics(rows=7)
    report = check_run(run)
    assert not report["passed"]
    assert report["problems"] == ["metrics count 7 rows, the database 5: 2 counted twice"]
    assert "metrics vs database: FAILED" in summary(report)
