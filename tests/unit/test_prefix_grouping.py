"""Prefix grouping (EngineOptions.group_prefixes, on by default): a shard's rows are fed in
prompt order, so the lines that share a document or a system prompt run next to each other
while the prefix cache holds it; every line still gets exactly one row, found by its `line`.
The jobs here are one shard each (BATCHLLM_SHARD_SIZE 100): the order holds within a shard."""

from __future__ import annotations

import collections
import json
import random
from datetime import timedelta
from pathlib import Path

import pytest

from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.jobs.create import create_job
from batchllm.jobs.local import run_job
from batchllm.output import commit
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, utcnow
from tests.support.fake_runs import (
    FakeEngine,
    FakeEngines,
    crash_on_checkpoint,
    make_spec,
    output_rows,
    read_output_file,
    small_commits,
)
from tests.support.file_jobs import create_from_file, run_file
from tests.support.inputs import source_of

DOCUMENTS, QUESTIONS = 4, 6


def document_lines(seed: int = 7) -> list[dict]:
    """Each of DOCUMENTS short documents asked QUESTIONS questions, the lines shuffled as a
    file of extraction requests comes."""
    rng = random.Random(seed)
    lines = [
        {
            "custom_id": f"d{d}-q{q}",
            "prompt": f"doc-{d} alpha beta gamma delta epsilon question-{q} about x",
        }
        for d in range(DOCUMENTS)
        for q in range(QUESTIONS)
    ]
    rng.shuffle(lines)
    return lines


def write_lines(path: Path, lines: list[dict | str]) -> Path:
    with path.open("w") as out:
        for line in lines:
            out.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def runs_of(labels: list[str]) -> list[str]:
    """The labels with repeats collapsed: ['a', 'a', 'b', 'a'] -> ['a', 'b', 'a']."""
    return [label for i, label in enumerate(labels) if i == 0 or labels[i - 1] != label]


def document_of(prompt: str) -> str:
    return next(word for word in prompt.split() if word.startswith("doc-"))


def custom_id_of(prompt: str) -> str:
    """A document_lines prompt's custom_id: 'doc-2 ... question-0 ...' -> 'd2-q0'."""
    words = prompt.split()
    question = next(word for word in words if word.startswith("question-"))
    return f"d{document_of(prompt)[4:]}-q{question[9:]}"


def assert_contiguous(labels: list[str]) -> None:
    """Each label's items form one run (a prefix's lines ran together)."""
    runs = runs_of(labels)
    assert len(runs) == len(set(runs)), runs


def test_grouping_runs_each_documents_lines_together_and_keeps_every_line_once_by_line(
    small_commits, tmp_path
):
    small_commits.shard_size = 100
    lines = document_lines()
    assert len(runs_of([line["custom_id"].split("-")[0] for line in lines])) > DOCUMENTS
    source = write_lines(tmp_path / "in.jsonl", [*lines, "{not json"])
    engine = FakeEngine()

    job = run_file(source, make_spec(), small_commits, engines=FakeEngines(engine))

    assert job.status is JobStatus.COMPLETED
    fed = [document_of(prompt) for prompt in engine.prompts_added]
    assert sorted(fed) == sorted(f"doc-{d}" for d in range(DOCUMENTS) for _ in range(QUESTIONS))
    assert_contiguous(fed)
    rows = output_rows(small_commits, job.id)  # sorted by line: the file's order
    assert [r["line"] for r in rows] == list(range(1, len(lines) + 2))
    assert [r["custom_id"] for r in rows[:-1]] == [line["custom_id"] for line in lines]
    assert [r["status"] for r in rows] == ["ok"] * len(lines) + ["error"]
    assert all(row["text"] == "echo about x" for row in rows[:-1])  # the prompts' last words
    with session_scope(small_commits) as session:
        stored = session.get(Job, job.id)
        # Every line after each document's first finds the document in the (fake) cache.
        assert stored.cached_tokens >= (DOCUMENTS * (QUESTIONS - 1)) * 7


def test_a_job_mixing_prefixed_and_unprefixed_lines_groups_the_prefixed_and_runs_all(
    small_commits, tmp_path
):
    small_commits.shard_size = 100
    rng = random.Random(3)
    system = "you are a careful extractor of dates"
    chats = [
        {
            "custom_id": f"chat-{i}",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"text-{i} find dates"},
            ],
        }
        for i in range(8)
    ]
    documents = document_lines()[:12]
    loose = [{"custom_id": f"loose-{i}", "prompt": f"unrelated-{i} words here"} for i in range(8)]
    lines = chats + documents + loose
    rng.shuffle(lines)
    source = write_lines(tmp_path / "in.jsonl", lines)
    engine = FakeEngine()

    job = run_file(source, make_spec(), small_commits, engines=FakeEngines(engine))

    assert job.status is JobStatus.COMPLETED
    fed = engine.prompts_added
    assert len(fed) == len(lines)
    chat_positions = [i for i, prompt in enumerate(fed) if system in prompt]
    assert chat_positions == list(range(chat_positions[0], chat_positions[0] + len(chats)))
    assert_contiguous([document_of(p) for p in fed if "doc-" in p])
    assert sum("unrelated-" in p for p in fed) == len(loose)
    rows = output_rows(small_commits, job.id)
    assert [r["custom_id"] for r in rows] == [line["custom_id"] for line in lines]
    assert collections.Counter(r["status"] for r in rows) == {"ok": len(lines)}


def test_resume_after_a_kill_mid_shard_with_grouping_runs_the_rest_grouped_exactly_once(
    small_commits, tmp_path, monkeypatch
):
    settings = small_commits
    settings.shard_size = 100
    lines = document_lines(seed=11)
    created = create_from_file(
        write_lines(tmp_path / "in.jsonl", lines),
        make_spec(),
        settings,
        shard_size=settings.shard_size,
    )
    job_id = created.job.id
    with session_scope(settings) as session:
        (shard_id,) = [s.id for s in session.get(Job, job_id).shards]

    first = FakeEngine()
    crash_on_checkpoint(monkeypatch, crash_at=3)  # two checkpoints of 5 rows land, then death
    with pytest.raises(KeyboardInterrupt):
        ShardRunner(first, worker="dead", settings=settings).run([shard_id])
    monkeypatch.undo()
    storage = Storage.of(settings)
    with session_scope(settings) as session:
        parts = [c.path for c in commit.checkpoints_of(session, shard_id)]
    committed = {r["custom_id"] for part in parts for r in read_output_file(storage, part)}
    assert len(parts) == 2 and 10 <= len(committed) < len(lines)
    assert_contiguous([document_of(p) for p in first.prompts_added])

    with session_scope(settings) as session:  # the dead worker's heartbeat goes stale
        session.get(Job, job_id).shards[0].heartbeat_at = utcnow() - timedelta(hours=1)
    resumed = FakeEngine()
    outcomes = ShardRunner(resumed, worker="alive", settings=settings).run([shard_id])

    assert outcomes == {shard_id: Outcome.COMPLETED}
    redone = resumed.prompts_added
    assert len(redone) == len(lines) - len(committed)
    assert {custom_id_of(prompt) for prompt in redone}.isdisjoint(committed)
    assert_contiguous([document_of(p) for p in redone])
    rows = output_rows(settings, job_id)
    assert [r["custom_id"] for r in rows] == [line["custom_id"] for line in lines]
    with session_scope(settings) as session:
        job = session.get(Job, job_id)
        assert job.status is JobStatus.COMPLETED
        assert (job.request_completed, job.request_failed) == (len(lines), 0)
