"""One tenant's poison line is that line's error row, never its shard's loop (issue 33, finding
1 and the lone-surrogate part of 7): text no UTF-8 encoder takes is refused at validation
naming the field, and a row the tokenizer or its preparation refuses anyway is its own error
row while the rest of the shard runs."""

from __future__ import annotations

import json
from pathlib import Path

from batchllm.engine.prompts import prepare_prompts
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.execution.stand_in_engines import WordTokenizer
from batchllm.input.formats.rows import InputRow
from batchllm.input.formats.schemas import LineError, Request
from batchllm.input.validation.validate import read_row_chunks
from batchllm.jobs.create import create_job
from batchllm.settings import get_settings
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus
from tests.support.fake_runs import (
    FakeEngine,
    make_spec,
    output_rows,
    small_commits,
    write_items,
)
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests

__all__ = ["small_commits"]

# A JSON line may escape a lone surrogate; json.loads accepts it (the probe's poison line).
POISON_CONTENT = '{"custom_id": "poison", "messages": [{"role": "user", "content": "x\\udc00"}]}'
POISON_ID = '{"custom_id": "id\\udc00", "prompt": "hello there"}'
POISON_OPENAI = (
    '{"custom_id": "poison-2", "method": "POST", "url": "/v1/chat/completions", "body": '
    '{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}}'
)
# A valid surrogate pair is ordinary text (an emoji) and runs.
PAIR = '{"custom_id": "pair", "prompt": "smile \\ud83d\\ude00 please"}'


def poisoned_file(tmp_path: Path) -> Path:
    return write_items(
        tmp_path / "in.jsonl", 6, extra=[POISON_CONTENT, POISON_ID, POISON_OPENAI, PAIR]
    )


def test_lone_surrogates_in_content_or_custom_id_are_error_lines_naming_the_field(tmp_path):
    items = list(read_requests(source_of(poisoned_file(tmp_path)), settings=get_settings()))
    errors = {item.line: item for item in items if isinstance(item, LineError)}
    assert sorted(errors) == [7, 8, 9]
    assert errors[7].field == "messages.0.content"
    assert errors[7].custom_id == "poison"
    assert errors[8].field == "custom_id"
    assert errors[8].custom_id == "line-8"  # its own id cannot be written: the default one
    assert errors[9].field == "body.messages.0.content"
    assert all("not valid Unicode" in e.message for e in errors.values())
    runnable = [item for item in items if isinstance(item, Request)]
    assert [r.custom_id for r in runnable][-1] == "pair"
    assert len(runnable) == 7


def test_the_columnar_reader_stores_poisoned_lines_as_invalid_rows_instead_of_raising(tmp_path):
    tables, errors = [], []
    for table, chunk_errors in read_row_chunks(
        source_of(poisoned_file(tmp_path)), settings=get_settings()
    ):
        tables.append(table)
        errors += chunk_errors
    rows = [row for table in tables for row in table.to_pylist()]
    assert len(rows) == 10
    invalid = {row["line"]: row for row in rows if row["kind"] == "invalid"}
    assert sorted(invalid) == [7, 8, 9]
    assert invalid[8]["custom_id"] == "line-8"
    assert "field 'custom_id'" in invalid[8]["error"]
    assert [e.field for e in errors] == [
        "messages.0.content",
        "custom_id",
        "body.messages.0.content",
    ]


def test_a_job_with_poisoned_lines_is_created_and_runs_the_others(small_commits, tmp_path):
    settings = small_commits
    created = create_job(
        source_of(poisoned_file(tmp_path), settings), make_spec(), shard_size=12, settings=settings
    )
    with session_scope(settings) as session:
        job = session.get(Job, created.job.id)
        assert job.status is JobStatus.QUEUED  # never left validating
        shard_ids = [s.id for s in job.shards]
    outcomes = ShardRunner(FakeEngine(), worker="w1", settings=settings).run(shard_ids)
    assert set(outcomes.values()) == {Outcome.COMPLETED}
    rows = {row["line"]: row for row in output_rows(settings, created.job.id)}
    assert len(rows) == 10
    assert {line for line, row in rows.items() if row["status"] == "error"} == {7, 8, 9}
    assert {rows[line]["error_code"] for line in (7, 8, 9)} == {"invalid_request"}
    assert rows[10]["status"] == "ok" and rows[10]["custom_id"] == "pair"


class RefusingTokenizer(WordTokenizer):
    """A tokenizer that raises on one text, as a Rust tokenizer does (TypeError) on a lone
    surrogate, for the whole batch call it is in."""

    def __call__(self, texts, add_special_tokens):
        if any("poison" in text for text in texts):
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return super().__call__(texts, add_special_tokens)


def test_a_text_the_tokenizer_refuses_fails_only_its_own_row():
    rows = [
        InputRow(line=1, custom_id="a", kind="prompt", prompt="one two"),
        InputRow(line=2, custom_id="b", kind="prompt", prompt="poison here"),
        InputRow(line=3, custom_id="c", kind="prompt", prompt="three"),
    ]
    prepared = prepare_prompts(RefusingTokenizer(), rows, None)
    assert isinstance(prepared[0], list) and len(prepared[0]) == 3  # BOS + two words
    assert isinstance(prepared[2], list) and len(prepared[2]) == 2
    assert isinstance(prepared[1], str)
    assert "could not be tokenized: TypeError" in prepared[1]
    assert prepared[1].code == "invalid_prompt"


def test_a_row_the_engine_cannot_prepare_is_an_error_row_and_its_shard_completes(
    small_commits, tmp_path
):
    settings = small_commits
    extra = [json.dumps({"custom_id": "bad", "prompt": "poison pill"})]
    path = write_items(tmp_path / "in.jsonl", 10, extra=extra)
    created = create_job(source_of(path, settings), make_spec(), shard_size=12, settings=settings)
    with session_scope(settings) as session:
        shard_ids = [s.id for s in session.get(Job, created.job.id).shards]
    engine = FakeEngine()
    engine.tokenizer = RefusingTokenizer()
    outcomes = ShardRunner(engine, worker="w1", settings=settings).run(shard_ids)
    assert set(outcomes.values()) == {Outcome.COMPLETED}
    rows = output_rows(settings, created.job.id)
    assert len(rows) == 11
    (bad,) = [row for row in rows if row["status"] == "error"]
    assert (bad["custom_id"], bad["error_code"]) == ("bad", "invalid_prompt")
    assert "TypeError" in bad["error"]
    with session_scope(settings) as session:
        job = session.get(Job, created.job.id)
        assert (job.status, job.request_completed, job.request_failed) == (
            JobStatus.COMPLETED,
            10,
            1,
        )
