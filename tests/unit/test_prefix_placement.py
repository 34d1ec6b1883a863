"""Job-wide prefix placement (input/shards.py): a generation job's rows are stored in prompt
order across the whole file, so the lines sharing a prefix fill the fewest shards wherever they
were in the file; a job still answers, exports, resumes and retries every line exactly once.
Through create_job and the runner on the fake engine."""

from __future__ import annotations

import collections
import json
import random
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import update

from batchllm import row_errors
from batchllm.engine.protocol import Finished
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.external_sort import ExternalSort
from batchllm.input import shards as input_shards
from batchllm.jobs.create import create_job
from batchllm.jobs.local import run_job
from batchllm.jobs.retry import retry_job
from batchllm.output import commit
from batchllm.output.openai_files import ERRORS_NAME, OUTPUT_NAME, export_openai
from batchllm.spec import EngineOptions, JobSpec
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, utcnow
from tests.support.fake_runs import (
    FakeEngine,
    FakeEngines,
    crash_on_checkpoint,
    make_spec,
    output_rows,
    read_output_file,
)
from tests.support.inputs import source_of

# -- input files and what the shards hold -----------------------------------------------------


def document_lines(
    documents: int, questions: int, *, seed: int, words: int = 0, first: int = 0
) -> list[dict]:
    """Every document asked every question (`Document d : <words> Question q : why q ?`), the
    lines shuffled; `words`: the document's text, that many words of its own."""
    lines = []
    for d in range(first, first + documents):
        text = "".join(f"d{d}w{i} " for i in range(words))
        for q in range(questions):
            prompt = f"Document {d} : {text}Question {q} : why {q} ?"
            lines.append({"custom_id": f"doc{d}-q{q}", "prompt": prompt})
    random.Random(seed).shuffle(lines)
    return lines


def write_jsonl(path: Path, lines: list[dict | str]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def document_of(custom_id: str) -> int:
    return int(custom_id.split("-")[0].removeprefix("doc"))


@dataclass
class StoredShard:
    index: int
    rows: int
    first_line: int
    last_line: int
    lines: list[int]  # in stored order
    custom_ids: list[str]
    kinds: list[str]


def stored_shards(settings, job_id: str) -> list[StoredShard]:
    """The job's shards as recorded, each with the rows its Parquet file holds."""
    with session_scope(settings) as session:
        recorded = [
            (s.index, s.rows, s.first_line, s.last_line, s.input_path)
            for s in session.get(Job, job_id).shards
        ]
    shards = []
    for index, rows, first_line, last_line, path in recorded:
        table = pq.read_table(path, columns=["line", "custom_id", "kind"])
        shards.append(
            StoredShard(
                index,
                rows,
                first_line,
                last_line,
                table.column("line").to_pylist(),
                table.column("custom_id").to_pylist(),
                table.column("kind").to_pylist(),
            )
        )
    return shards


def placed_order(shards: list[StoredShard]) -> list[str]:
    """The custom_ids in the order the shards store them, shard after shard."""
    return [custom_id for shard in shards for custom_id in shard.custom_ids]


def runs_of(values: list) -> list:
    """`values` with consecutive repeats collapsed: each value once when its rows are together."""
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def shards_of_each_document(shards: list[StoredShard]) -> dict[int, list[int]]:
    found: dict[int, set[int]] = collections.defaultdict(set)
    for shard in shards:
        for custom_id in shard.custom_ids:
            found[document_of(custom_id)].add(shard.index)
    return {doc: sorted(indexes) for doc, indexes in found.items()}


def assert_every_line_once_and_bounds_recorded(shards: list[StoredShard], total: int) -> None:
    every = [line for shard in shards for line in shard.lines]
    assert sorted(every) == list(range(1, total + 1))
    for shard in shards:
        assert (shard.rows, shard.first_line, shard.last_line) == (
            len(shard.lines),
            min(shard.lines),
            max(shard.lines),
        )


def assert_documents_fill_fewest_shards(shards: list[StoredShard], documents: int) -> None:
    """Each document's lines together in the placed order, so in consecutive shards: at most
    two for a document no larger than a shard, and at most one shared edge per shard."""
    order = [document_of(c) for c in placed_order(shards)]
    assert sorted(runs_of(order)) == sorted(set(order))  # no document comes back later
    spans = shards_of_each_document(shards)
    assert len(spans) == documents
    for indexes in spans.values():
        assert len(indexes) <= 2
        assert indexes == list(range(indexes[0], indexes[-1] + 1))
    assert sum(len(i) for i in spans.values()) <= documents + len(shards) - 1


@pytest.fixture
def placements(monkeypatch) -> list[ExternalSort]:
    """Every placement sort store_input makes (to see whether it spilled)."""
    made: list[ExternalSort] = []

    class Recorded(ExternalSort):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(input_shards, "ExternalSort", Recorded)
    return made


def create(settings, path: Path, *, shard_size: int, spec: JobSpec | None = None) -> str:
    return create_job(
        source_of(path, settings), spec or make_spec(), shard_size=shard_size, settings=settings
    ).job.id


def fake_prompt(line: dict) -> str:
    """The prompt as the fake engine reports it (its BOS first)."""
    return "<s> " + line["prompt"]


# -- where the rows go ------------------------------------------------------------------------


def test_a_shuffled_file_places_each_documents_questions_in_the_fewest_shards(
    settings, tmp_path, placements
):
    lines = document_lines(12, 7, seed=11)
    job_id = create(settings, write_jsonl(tmp_path / "in.jsonl", lines), shard_size=10)

    shards = stored_shards(settings, job_id)
    assert [s.rows for s in shards] == [10] * 8 + [4]
    assert_every_line_once_and_bounds_recorded(shards, 84)
    assert_documents_fill_fewest_shards(shards, 12)
    # Each shard holds what the file's line numbers say it holds.
    for shard in shards:
        assert [lines[line - 1]["custom_id"] for line in shard.lines] == shard.custom_ids
    # Placed in memory: nothing was spilled.
    assert [len(p.runs) for p in placements] == [0]
    # Stored in file order, the documents would have been spread over far more shards.
    by_file_order = collections.defaultdict(set)
    for i, line in enumerate(lines):
        by_file_order[document_of(line["custom_id"])].add(i // 10)
    assert sum(len(s) for s in by_file_order.values()) > 2 * (12 + 9 - 1)


def test_a_file_too_big_for_placement_memory_is_placed_through_spilled_runs_alike(
    settings, tmp_path, placements
):
    # ~9 MB: three 4 MB chunks of validated rows, each over the 1 MiB the placement may hold.
    lines = document_lines(100, 30, seed=12, words=460)
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    assert path.stat().st_size > 8 << 20

    spilled_id = create(settings.model_copy(update={"placement_memory_mb": 1}), path, shard_size=40)
    in_memory_id = create(settings, path, shard_size=40)

    spilled, in_memory = placements
    assert len(spilled.runs) >= 3 and in_memory.runs == []
    assert not any(run.exists() for run in spilled.runs)  # removed once the shards were written
    shards = stored_shards(settings, spilled_id)
    assert len(shards) == 75
    assert_every_line_once_and_bounds_recorded(shards, 3000)
    assert_documents_fill_fewest_shards(shards, 100)
    assert [s.lines for s in shards] == [s.lines for s in stored_shards(settings, in_memory_id)]


def test_identical_prompts_keep_their_line_order_however_much_placement_spills(
    settings, tmp_path, placements
):
    # One prompt asked 80,000 times (e.g. sampled with as many seeds): every key is equal, so
    # placement is file order, whether it sorted in memory or merged runs of 16,384+ rows.
    lines = [{"custom_id": f"c{i}", "prompt": "the same prompt, again"} for i in range(80_000)]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    job_id = create(settings.model_copy(update={"placement_memory_mb": 1}), path, shard_size=20_000)

    assert len(placements[0].runs) >= 2
    shards = stored_shards(settings, job_id)
    assert_every_line_once_and_bounds_recorded(shards, 80_000)
    assert [s.lines for s in shards] == [
        list(range(i * 20_000 + 1, (i + 1) * 20_000 + 1)) for i in range(4)
    ]


def test_a_group_larger_than_a_shard_fills_consecutive_shards_split_only_at_their_edges(
    settings, tmp_path
):
    # Document 3 is asked 24 questions (three shards' worth), the others 5 each, shuffled.
    lines = document_lines(3, 5, seed=13) + document_lines(2, 5, seed=14, first=4)
    lines += document_lines(1, 24, seed=15, first=3)
    random.Random(16).shuffle(lines)
    job_id = create(settings, write_jsonl(tmp_path / "in.jsonl", lines), shard_size=8)

    shards = stored_shards(settings, job_id)
    assert_every_line_once_and_bounds_recorded(shards, 49)
    big = shards_of_each_document(shards)[3]
    # After documents 0-2's 15 rows: the last row of shard 1, all of 2 and 3, 7 rows of 4.
    assert big == [1, 2, 3, 4]
    order = [document_of(c) for c in placed_order(shards)]
    start = order.index(3)
    assert order[start : start + 24] == [3] * 24  # in one piece
    for index in big[1:-1]:
        assert {document_of(c) for c in shards[index].custom_ids} == {3}
        assert shards[index].rows == 8
    edges = [shards[big[0]], shards[big[-1]]]
    assert sum(c.startswith("doc3-") for shard in edges for c in shard.custom_ids) == 24 - 8 * (
        len(big) - 2
    )
    # The small documents sort around it and still take at most two shards each.
    assert all(len(i) <= 2 for doc, i in shards_of_each_document(shards).items() if doc != 3)


SYSTEM = {"role": "system", "content": "You answer in one word."}
PLAIN_WORDS = ["zebra", "apple", "mango", "kiwi", "yak", "banana", "cherry", "fig", "lemon"]


def mixed_lines() -> list[dict | str]:
    """Chat lines sharing a system prompt, plain prompts sharing nothing, refused lines."""
    lines: list[dict | str] = [
        {"custom_id": f"chat-{i}", "messages": [SYSTEM, {"role": "user", "content": f"ask {i}"}]}
        for i in range(9)
    ]
    lines += [{"custom_id": f"plain-{w}", "prompt": f"{w} stands alone"} for w in PLAIN_WORDS]
    lines += ["{broken json", "{broken json again", '{"custom_id": "bad", "prompt": 3}']
    random.Random(17).shuffle(lines)
    return lines


def test_mixed_chat_plain_and_invalid_lines_are_each_stored_and_answered_exactly_once(
    settings, tmp_path
):
    settings.shard_size, settings.commit_rows = 5, 3
    lines = mixed_lines()
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    engine = FakeEngine()

    job = run_job(
        source_of(path, settings), make_spec(), settings=settings, engines=FakeEngines(engine)
    )

    shards = stored_shards(settings, job.id)
    assert_every_line_once_and_bounds_recorded(shards, 21)
    # By kind, then prompt: the chats (their system prompt first) together, then the refused
    # lines, then the plain prompts by their text.
    kinds = [kind for shard in shards for kind in shard.kinds]
    assert kinds == ["chat"] * 9 + ["invalid"] * 3 + ["prompt"] * 9
    assert placed_order(shards)[:9] == [f"chat-{i}" for i in range(9)]
    assert placed_order(shards)[12:] == [f"plain-{w}" for w in sorted(PLAIN_WORDS)]
    assert [s.kinds.count("chat") for s in shards] == [5, 4, 0, 0, 0]
    rows = output_rows(settings, job.id)
    assert [r["line"] for r in rows] == list(range(1, 22))
    line_of = {
        (x if isinstance(x, str) else x["custom_id"]): n for n, x in enumerate(lines, start=1)
    }
    errors = {r["custom_id"]: r["error"] for r in rows if r["status"] == "error"}
    broken = [f"line-{line_of['{broken json']}", f"line-{line_of['{broken json again']}"]
    assert sorted(errors) == sorted(["bad", *broken])
    assert all("malformed JSON" in errors[b] for b in broken)
    assert errors["bad"] == "field 'prompt': prompt: Input should be a valid string"
    ok = {r["custom_id"]: r for r in rows if r["status"] == "ok"}
    assert {c: r["line"] for c, r in ok.items()} == {c: n for c, n in line_of.items() if c in ok}
    assert len(ok) == 18 == len(engine.prompts_added)
    assert ok["chat-4"]["text"] == "echo 4 assistant:"
    assert ok["plain-fig"]["text"] == "echo stands alone"
    assert job.status is JobStatus.COMPLETED
    assert (job.request_completed, job.request_failed) == (18, 3)


def embed_spec() -> JobSpec:
    return JobSpec(model="/models/embedder", engine=EngineOptions(task="embed"))


def no_grouping_spec() -> JobSpec:
    spec = make_spec()
    spec.engine.group_prefixes = False
    return spec


@pytest.mark.parametrize(
    ("place_prefixes", "spec", "line_key"),
    [
        (False, make_spec, "prompt"),
        (True, no_grouping_spec, "prompt"),
        (True, embed_spec, "input"),
    ],
    ids=["placement_off", "group_prefixes_off", "embed_task"],
)
def test_without_placement_shards_hold_the_file_in_order(
    settings, tmp_path, placements, place_prefixes, spec, line_key
):
    lines = [
        {"custom_id": x["custom_id"], line_key: x["prompt"]} for x in document_lines(5, 5, seed=18)
    ]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    job_id = create(
        settings.model_copy(update={"place_prefixes": place_prefixes}),
        path,
        shard_size=7,
        spec=spec(),
    )

    shards = stored_shards(settings, job_id)
    assert [s.lines for s in shards] == [
        list(range(i * 7 + 1, min((i + 1) * 7, 25) + 1)) for i in range(4)
    ]
    assert [(s.first_line, s.last_line) for s in shards] == [(1, 7), (8, 14), (15, 21), (22, 25)]
    assert placed_order(shards) == [x["custom_id"] for x in lines]
    assert placements == []


# -- running placed jobs ----------------------------------------------------------------------


def test_a_placed_job_answers_each_line_under_its_own_id_and_exports_in_file_order(
    settings, tmp_path
):
    settings.shard_size, settings.commit_rows = 7, 4
    lines = document_lines(6, 5, seed=19)
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    engine = FakeEngine()

    job = run_job(
        source_of(path, settings), make_spec(), settings=settings, engines=FakeEngines(engine)
    )

    assert job.status is JobStatus.COMPLETED
    shards = stored_shards(settings, job.id)
    assert any(s.lines != list(range(s.first_line, s.last_line + 1)) for s in shards)  # placed
    rows = output_rows(settings, job.id)
    assert [(r["line"], r["custom_id"]) for r in rows] == [
        (n, x["custom_id"]) for n, x in enumerate(lines, start=1)
    ]
    assert [r["text"] for r in rows] == [
        "echo " + " ".join(x["prompt"].split()[-2:]) for x in lines
    ]
    assert {r["status"] for r in rows} == {"ok"}
    assert sorted(engine.prompts_added) == sorted(fake_prompt(x) for x in lines)

    out = tmp_path / "export"
    counts = export_openai(job, out, settings=settings)

    assert (counts.output, counts.errors, counts.not_run) == (30, 0, 0)
    exported = [json.loads(x) for x in (out / OUTPUT_NAME).read_text().splitlines()]
    assert [x["custom_id"] for x in exported] == [x["custom_id"] for x in lines]
    assert [x["response"]["body"]["choices"][0]["text"] for x in exported] == [
        r["text"] for r in rows
    ]
    assert (out / ERRORS_NAME).read_text() == ""


def test_a_placed_shard_killed_mid_run_resumes_with_only_its_missing_rows(
    settings, tmp_path, monkeypatch
):
    settings.commit_rows = 5
    lines = document_lines(8, 5, seed=20)
    job_id = create(settings, write_jsonl(tmp_path / "in.jsonl", lines), shard_size=20)
    shards = stored_shards(settings, job_id)
    with session_scope(settings) as session:
        shard_ids = [s.id for s in session.get(Job, job_id).shards]
    assert len(shard_ids) == 2

    crash_on_checkpoint(monkeypatch, crash_at=3)  # dies recording shard 0's third commit
    with pytest.raises(KeyboardInterrupt):
        ShardRunner(FakeEngine(), worker="dead", settings=settings).run(shard_ids)
    monkeypatch.undo()
    storage = Storage.of(settings)
    with session_scope(settings) as session:
        paths = [c.path for i in shard_ids for c in commit.checkpoints_of(session, i)]
        session.execute(
            update(Shard)
            .where(Shard.job_id == job_id)
            .values(heartbeat_at=utcnow() - timedelta(hours=1))
        )
    committed = [r["line"] for p in paths for r in read_output_file(storage, p)]
    assert 0 < len(committed) < 20 and set(committed) < set(shards[0].lines)  # mid-shard

    resumed = FakeEngine()
    outcomes = ShardRunner(resumed, worker="alive", settings=settings).run(shard_ids)

    assert outcomes == dict.fromkeys(shard_ids, Outcome.COMPLETED)
    line_of = {fake_prompt(x): n for n, x in enumerate(lines, start=1)}
    rerun = [line_of[p] for p in resumed.prompts_added]
    assert sorted(rerun) == sorted(set(range(1, 41)) - set(committed))
    rows = output_rows(settings, job_id)
    assert [(r["line"], r["custom_id"]) for r in rows] == [
        (n, x["custom_id"]) for n, x in enumerate(lines, start=1)
    ]
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED
        assert (job.request_completed, job.request_failed) == (40, 0)


class FailingEngine(FakeEngine):
    """Ends the requests for the `failing` prompts with finish reason "error", as vLLM
    reports a request it could not finish (a retryable engine error)."""

    def __init__(self, failing: set[str]) -> None:
        super().__init__()
        self.failing = failing
        self.prompt_of: dict[str, str] = {}

    def add(self, request_id, token_ids, params, adapter=None) -> None:
        super().add(request_id, token_ids, params, adapter)
        self.prompt_of[request_id] = self.prompts_added[-1]

    def step(self) -> list[Finished]:
        return [
            Finished(out.request_id, "", "error", out.prompt_tokens, 0)
            if self.prompt_of[out.request_id] in self.failing
            else out
            for out in super().step()
        ]


def test_a_retry_of_a_placed_job_reruns_its_failed_lines_into_the_same_job_once_each(
    settings, tmp_path
):
    settings.shard_size, settings.commit_rows = 7, 4
    lines = document_lines(6, 5, seed=21)
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    # Question 2 of every document: placed in four of the job's five shards.
    failing = {n for n, x in enumerate(lines, start=1) if x["custom_id"].endswith("-q2")}
    engine = FailingEngine({fake_prompt(lines[n - 1]) for n in failing})
    job = run_job(
        source_of(path, settings), make_spec(), settings=settings, engines=FakeEngines(engine)
    )
    shards = stored_shards(settings, job.id)
    assert [len(failing & set(s.lines)) for s in shards] == [1, 2, 1, 2, 0]
    first = output_rows(settings, job.id)
    assert {r["line"] for r in first if r["error_code"] == row_errors.ENGINE_ERROR} == failing
    assert (job.request_completed, job.request_failed) == (24, 6)

    healthy = FakeEngine()
    retried = retry_job(job.id, settings=settings, engines=FakeEngines(healthy))

    assert sorted(healthy.prompts_added) == sorted(fake_prompt(lines[n - 1]) for n in failing)
    rows = output_rows(settings, job.id)
    assert [(r["line"], r["custom_id"], r["status"]) for r in rows] == [
        (n, x["custom_id"], "ok") for n, x in enumerate(lines, start=1)
    ]
    assert {rows[n - 1]["text"] for n in failing} == {"echo 2 ?"}  # the last two words
    assert [r for r in rows if r["line"] not in failing] == [
        r for r in first if r["line"] not in failing
    ]
    assert retried.status is JobStatus.COMPLETED
    assert (retried.request_completed, retried.request_failed) == (30, 0)
