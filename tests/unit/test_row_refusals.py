"""A row refused before the engine carries its error code from where the refusal arose: the
runner writes that code and never reads the message's wording (row_errors.Refusal)."""

from __future__ import annotations

from batchllm.execution.stand_in_engines import FakeEngine
from batchllm.jobs.local import run_job
from batchllm.row_errors import (
    CONTEXT_LENGTH_EXCEEDED,
    REQUEST_REJECTED,
    Refusal,
)
from tests.support.fake_runs import FakeEngines, make_spec, output_rows, write_items
from tests.support.file_jobs import run_file
from tests.support.inputs import source_of


def test_the_prompt_checks_give_their_own_codes(settings, tmp_path):
    engine = FakeEngine()
    long_line = '{"custom_id": "long", "prompt": "' + " ".join(["word"] * 400) + '"}'
    source = write_items(tmp_path / "in.jsonl", 1, extra=[long_line])
    job = run_job(
        source_of(source, settings), make_spec(), settings=settings, engines=FakeEngines(engine)
    )
    rows = output_rows(settings, job.id)
    assert [(r["line"], r["status"], r["error_code"]) for r in rows] == [
        (1, "ok", None),
        (2, "error", CONTEXT_LENGTH_EXCEEDED),
    ]
    assert "max_model_len" in rows[1]["error"]


class _Refusing(FakeEngine):
    """Refuses every other row with a message in the words of a context refusal but another
    code: the row's code must be the refusal's, not one read from its words."""

    def prepare(self, rows, chat_template=None):
        prepared = super().prepare(rows, chat_template)
        return [
            Refusal("prompt is 9 tokens; max_model_len is 8", REQUEST_REJECTED)
            if row.line % 2 == 0
            else ids
            for row, ids in zip(rows, prepared)
        ]


def test_the_runner_writes_the_refusals_code_not_one_read_from_its_words(settings, tmp_path):
    source = write_items(tmp_path / "in.jsonl", 6)
    job = run_file(source, make_spec(), settings, engines=FakeEngines(_Refusing()))
    rows = output_rows(settings, job.id)
    assert [(r["line"], r["status"], r["error_code"]) for r in rows] == [
        (line, "ok", None) if line % 2 else (line, "error", REQUEST_REJECTED)
        for line in range(1, 7)
    ]
