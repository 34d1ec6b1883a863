"""Pipelines (issue 35): prompt templates on tables and JSONL keys, a job's rows as the next
job's input (`--from`), and pipeline files that resume from the database. Jobs run on the
instant engine in this process: the subject is what reaches the engine and what joins back."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchllm import Client, JobRows
from batchllm.errors import InputError, JobStateError
from batchllm.execution.instant import InstantEngines
from batchllm.input.formats.prompt_template import PromptTemplate
from batchllm.input.shards import validated_chunks
from batchllm.jobs.create import create_job
from batchllm.jobs.parent_rows import asked_text
from batchllm.settings import get_settings
from batchllm.spec import TableColumns
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobParent
from tests.support.cli import invoke
from tests.support.inputs import source_of


def stored(path: Path, **table: str) -> tuple[list[dict], list[str]]:
    """The rows the file is stored as, and its problems as they print."""
    rows: list[dict] = []
    errors: list[str] = []
    for chunk, problems in validated_chunks(
        source_of(path), table=TableColumns(**table), settings=get_settings()
    ):
        rows += chunk.to_pylist()
        errors += [str(p) for p in problems]
    return rows, errors


def input_rows(job_id: str) -> list[dict]:
    """A job's stored input rows, in line order."""
    with session_scope(get_settings()) as session:
        storage = Storage.for_job(service.get_job(session, job_id), get_settings())
    directory = Path(storage.input_dir(job_id))
    tables = [pq.read_table(p) for p in sorted(directory.glob("shard-*.parquet"))]
    return pa.concat_tables(tables).sort_by("line").to_pylist()


def output(job_id: str) -> list[dict]:
    row = Client().status(job_id)
    return ds.dataset(row.output_dir).to_table().sort_by("line").to_pylist()


# --- the template syntax -------------------------------------------------------------------


def test_a_template_names_its_fields_once_each_in_order_with_braces_escaped():
    template = PromptTemplate.parse("{{json}} Q: {question} A: {answer} again {question}")
    assert template.fields == ("question", "answer")
    rendered = template.render(
        {"question": pa.array(["2+2?", None]), "answer": pa.array(["4", "5"])}
    )
    assert rendered.to_pylist() == ["{json} Q: 2+2? A: 4 again 2+2?", None]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("Q: {}", "positional field {}"),
        ("Q: {0}", "positional field {0}"),
        ("Q: {row.text}", "attribute and index access"),
        ("Q: {row[0]}", "attribute and index access"),
        ("Q: {text!r}", "conversion or format spec (!r)"),
        ("Q: {text:>10}", "conversion or format spec (:>10)"),
        ("Q: {text", "{{ and }} for literal braces"),
        ("no fields at all", "names no field"),
    ],
)
def test_a_template_it_cannot_take_is_refused_naming_the_flag(text, says):
    with pytest.raises(InputError) as refused:
        PromptTemplate.parse(text)
    assert str(refused.value).startswith("--prompt-template: ")
    assert says in str(refused.value)


def test_non_text_fields_are_placed_as_their_json():
    template = PromptTemplate.parse("{n} {flag} {vector} {call}")
    rendered = template.render(
        {
            "n": pa.array([3]),
            "flag": pa.array([True]),
            "vector": pa.array([[0.5, 1.0]], pa.list_(pa.float32())),
            "call": pa.array([{"name": "f", "arguments": "{}"}]),
        }
    )
    assert rendered.to_pylist() == ['3 true [0.5, 1.0] {"name": "f", "arguments": "{}"}']


# --- templates on tables and JSONL keys ----------------------------------------------------


def test_a_table_template_builds_each_prompt_and_a_null_field_is_that_rows_error(
    settings, tmp_path
):
    path = tmp_path / "docs.parquet"
    table = {"id": ["a", "b", "c"], "title": ["T1", None, "T3"], "year": [2001, 2002, None]}
    pq.write_table(pa.table(table), path)

    rows, errors = stored(
        path, prompt_template="Title: {title} ({year})", id_column="id", system="Be brief."
    )

    assert [r["custom_id"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["kind"] == "chat"
    assert json.loads(rows[0]["messages"]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Title: T1 (2001)"},
    ]
    assert [r["kind"] for r in rows[1:]] == ["invalid", "invalid"]
    assert errors == [
        f"{path}:2 field 'title': row 2: no value for the template's {{title}}",
        f"{path}:3 field 'year': row 3: no value for the template's {{year}}",
    ]


def test_a_field_no_column_holds_is_refused_before_any_job_naming_it(settings, tmp_path):
    path = tmp_path / "docs.csv"
    path.write_text("id,title\na,T1\n")
    result = invoke(
        "run", str(path), "--model", "/models/x", "--prompt-template", "{title}: {body}"
    )
    assert result.exit_code == 1
    assert (
        f"{path}: no column 'body' (a field of the prompt template); its columns: id, title"
        in result.output
    )
    with session_scope(settings) as session:
        assert session.query(Job).count() == 0


def test_jsonl_keys_feed_a_template_keeping_each_lines_custom_id(settings, tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"custom_id": "q1", "question": "2+2?", "tags": ["math"]}\n'
        '{"question": "Capital of France?", "tags": []}\n'
        "not json\n"
        "\n"
        '{"custom_id": "q4", "tags": ["none"]}\n'
        '["a list"]\n'
    )
    rows, errors = stored(path, prompt_template="Q: {question} tags={tags}")

    assert [(r["line"], r["custom_id"], r["prompt"]) for r in rows] == [
        (1, "q1", 'Q: 2+2? tags=["math"]'),
        (2, "line-2", "Q: Capital of France? tags=[]"),
        (3, "line-3", None),
        (5, "q4", None),
        (6, "line-6", None),
    ]
    assert errors == [
        f"{path}:3: malformed JSON: Expecting value (column 1)",
        f"{path}:5 field 'question': line 5: no value for the template's {{question}}",
        f"{path}:6: a line must be a JSON object, got list",
    ]


def test_a_jsonl_key_none_of_its_lines_has_is_refused_listing_the_keys(settings, tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"custom_id": "q1", "question": "2+2?"}\n')
    result = invoke("run", str(path), "--model", "/m", "--prompt-template", "{answer}")
    assert result.exit_code == 1
    assert "no line among the first 65,536 has key 'answer'" in result.output
    assert "their keys: custom_id, question" in result.output


# --- a job's rows as the next job's input --------------------------------------------------


@pytest.fixture
def parent(settings, tokenizer, tmp_path) -> str:
    """A completed job with two ok rows (a prompt line and a chat line) and one error row."""
    path = tmp_path / "parent.jsonl"
    path.write_text(
        '{"custom_id": "p1", "prompt": "What is 2+2?"}\n'
        '{"custom_id": "p2", "messages": [{"role": "system", "content": "Be brief."}, '
        '{"role": "user", "content": "Capital of France?"}]}\n'
        '{"custom_id": "p3", "prompt": ""}\n'
    )
    model = tokenizer.name_or_path
    result = invoke("run", str(path), "--model", model, "--engine", "instant", "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    with session_scope(settings) as session:
        return session.query(Job).one().id


def test_run_from_a_job_reads_its_ok_rows_and_keeps_their_custom_ids(settings, tokenizer, parent):
    template = "Question: {prompt}\nAnswer: {text}\nRight?"
    result = invoke(
        "run", "--from", parent, "--prompt-template", template,
        "--model", tokenizer.name_or_path, "--engine", "instant", "--max-tokens", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    parent_rows = {r["custom_id"]: r for r in output(parent)}
    with session_scope(settings) as session:
        child = session.query(Job).filter(Job.id != parent).one()
        assert child.input_file == f"from:{parent}?status=ok"
        assert [link.parent_id for link in child.parent_links] == [parent]
        child_id = child.id

    asked = input_rows(child_id)
    assert [r["custom_id"] for r in asked] == ["p1", "p2"]  # the ok rows, in line order
    assert [r["prompt"] for r in asked] == [
        f"Question: What is 2+2?\nAnswer: {parent_rows['p1']['text']}\nRight?",
        f"Question: Capital of France?\nAnswer: {parent_rows['p2']['text']}\nRight?",
    ]
    answered = output(child_id)
    assert [(r["custom_id"], r["status"]) for r in answered] == [("p1", "ok"), ("p2", "ok")]

    shown = invoke("status", child_id)
    assert f"from       {parent}" in shown.output
    assert f"children   {child_id}" in invoke("status", parent).output


def test_from_status_widens_to_error_rows_which_become_the_childs_errors(tokenizer, parent):
    result = invoke(
        "run", "--from", parent, "--from-status", "ok,error",
        "--model", tokenizer.name_or_path, "--engine", "instant", "--max-tokens", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "requests   3/3 done: 2 ok, 1 error" in result.output
    child = next(j for j in invoke("jobs").output.split() if j.startswith("job_") and j != parent)
    rows = output(child)
    assert [(r["custom_id"], r["status"]) for r in rows] == [
        ("p1", "ok"),
        ("p2", "ok"),
        ("p3", "error"),
    ]
    assert rows[2]["error"] == "field 'text': row 3: column 'text' is null"


def test_the_client_runs_a_child_on_a_parents_rows(settings, tokenizer, parent):
    child = Client().run(
        JobRows(parent),
        model=tokenizer.name_or_path,
        engines=InstantEngines(),
        prompt_template="{text}",
        max_tokens=2,
    )
    assert child.status == "completed"
    assert [r["custom_id"] for r in output(child.id)] == ["p1", "p2"]
    with session_scope(settings) as session:
        assert session.query(JobParent).filter_by(child_id=child.id).one().parent_id == parent


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["FILE", "--from", "PARENT"], "give FILE"),
        ([], "give FILE, or --from JOB"),
        (["--from", "job_nope"], "no job 'job_nope'"),
        (["--from", "PARENT", "--from-status", "done"], "row statuses are ok, error"),
        (["--from", "PARENT", "--id-column", "x"], "each row keeps its parent's custom_id"),
        (["--from", "PARENT", "--prompt-template", "{nope}"], "no column 'nope'"),
    ],
)
def test_a_from_the_run_cannot_take_is_refused_creating_no_job(
    settings, tokenizer, parent, tmp_path, args, says
):
    given = tmp_path / "f.jsonl"
    given.write_text('{"prompt": "x"}\n')
    args = [str(given) if a == "FILE" else parent if a == "PARENT" else a for a in args]
    result = invoke("run", *args, "--model", tokenizer.name_or_path, "--engine", "instant")
    assert result.exit_code != 0
    assert says in result.output
    with session_scope(settings) as session:
        assert session.query(Job).count() == 1  # the parent only


def test_a_parent_not_completed_is_refused(settings, parent):
    with session_scope(settings) as session:
        session.get(Job, parent).status = service.JobStatus.FAILED
    with pytest.raises(JobStateError, match=f"--from {parent}: the job is failed"):
        Client().run(JobRows(parent), model="/m", engines=InstantEngines())


def test_the_prompt_a_parent_row_asked_is_its_prompt_last_user_message_or_inputs():
    chat = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]},
    ]
    base = {"prompt": None, "messages": None, "inputs": None}
    assert asked_text({**base, "prompt": "p"}) == "p"
    assert asked_text({**base, "messages": json.dumps(chat)}) == "look"
    assert asked_text({**base, "inputs": json.dumps(["a", "b"])}) == "a\nb"
    assert asked_text(base) is None


# --- pipeline files ------------------------------------------------------------------------


def _pipeline(tmp_path: Path, model: str, judge_tokens: int = 2) -> Path:
    questions = tmp_path / "q.jsonl"
    if not questions.exists():  # rewritten, the file would make the first stage run again
        questions.write_text(
            '{"custom_id": "q1", "question": "2+2?"}\n{"custom_id": "q2", "question": "Sky?"}\n'
            '{"custom_id": "q3"}\n'
        )
    path = tmp_path / "qa.toml"
    path.write_text(
        f"""
[[stage]]
name = "answer"
input = "q.jsonl"
model = "{model}"
prompt_template = "Q: {{question}}"
max_tokens = 3

[[stage]]
name = "judge"
from = "answer"
model = "{model}"
prompt_template = "Q: {{prompt}} A: {{text}} Right?"
max_tokens = {judge_tokens}

[[stage]]
name = "summary"
from = "answer"
model = "{model}"
max_tokens = 1
"""
    )
    return path


def _stage_jobs(output_text: str) -> dict[str, str]:
    """stage -> job id, from `pipeline status`'s table."""
    lines = output_text.strip().splitlines()[1:]
    return {line.split()[0]: line.split()[1] for line in lines}


def test_a_pipeline_runs_its_stages_joined_on_custom_id_and_resumes(settings, tokenizer, tmp_path):
    model = tokenizer.name_or_path
    path = _pipeline(tmp_path, model)
    first = invoke("pipeline", "run", str(path), "--engine", "instant")
    assert first.exit_code == 0, first.output
    jobs = _stage_jobs(invoke("pipeline", "status", str(path)).output)
    answer, judge, summary = jobs["answer"], jobs["judge"], jobs["summary"]
    ok_answers = [r["custom_id"] for r in output(answer) if r["status"] == "ok"]
    assert ok_answers == ["q1", "q2"]  # q3 has no question: an error row
    for child in (judge, summary):
        assert [r["custom_id"] for r in output(child)] == ok_answers
    assert input_rows(judge)[0]["prompt"].startswith("Q: Q: 2+2? A: ")
    with session_scope(settings) as session:
        labels = session.get(Job, judge).job_metadata
        assert (labels["pipeline"], labels["stage"]) == ("qa", "judge")

    again = invoke("pipeline", "run", str(path), "--engine", "instant")
    assert again.exit_code == 0, again.output
    assert again.output.count("completed before: not run again") == 3
    assert _stage_jobs(invoke("pipeline", "status", str(path)).output) == jobs

    _pipeline(tmp_path, model, judge_tokens=3)  # the judge's settings change
    assert "runs again" in invoke("pipeline", "status", str(path)).output
    third = invoke("pipeline", "run", str(path), "--engine", "instant")
    assert third.exit_code == 0, third.output
    now = _stage_jobs(invoke("pipeline", "status", str(path)).output)
    assert (now["answer"], now["summary"]) == (answer, summary)
    assert now["judge"] != judge
    with session_scope(settings) as session:
        assert session.query(Job).count() == 4

    questions = tmp_path / "q.jsonl"
    questions.write_text(questions.read_text() + '{"custom_id": "q4", "question": "Sea?"}\n')
    edited = invoke("pipeline", "status", str(path)).output
    assert edited.count("runs again") == 3  # the answers' input changed: every stage re-runs


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('[[stage]]\ninput = "q.jsonl"\nmodel = "m"\n', "stage 1: needs a name"),
        ('[[stage]]\nname = "a"\nmodel = "m"\n', "give one of input (a file) and from"),
        ('[[stage]]\nname = "a"\nfrom = "b"\nmodel = "m"\n', "from = 'b' names no earlier stage"),
        ('[[stage]]\nname = "a"\ninput = "q.jsonl"\n', "stage 'a': needs a model"),
        ("name = 'x'\n", "no [[stage]] table"),
        ("[[stage]\n", "not valid TOML"),
        ('[[stage]]\nname = "a"\ninput = "q.jsonl"\nmodel = "m"\nmax_tokenz = 3\n', "max_tokenz"),
    ],
)
def test_a_pipeline_file_it_cannot_take_is_refused_naming_the_stage(settings, tmp_path, body, says):
    (tmp_path / "q.jsonl").write_text('{"prompt": "x"}\n')
    path = tmp_path / "bad.toml"
    path.write_text(body)
    result = invoke("pipeline", "run", str(path), "--engine", "instant")
    assert result.exit_code == 1
    assert str(path) in result.output and says in result.output


# --- jobs after jobs (the fleet's side: tests/integration/test_pipeline_fleet.py) -----------


def test_after_is_refused_on_a_local_run_and_for_an_unknown_or_failed_parent(
    settings, tokenizer, parent, tmp_path
):
    given = tmp_path / "f.jsonl"
    given.write_text('{"prompt": "x"}\n')
    with pytest.raises(InputError, match="--after is for jobs submitted to the fleet"):
        Client().run(given, model=tokenizer.name_or_path, engines=InstantEngines(), after=[parent])
    unknown = invoke("submit", str(given), "--model", tokenizer.name_or_path, "--after", "job_x")
    assert unknown.exit_code == 1 and "no job 'job_x'" in unknown.output
    with session_scope(settings) as session:
        session.get(Job, parent).status = service.JobStatus.FAILED
    failed = invoke("submit", str(given), "--model", tokenizer.name_or_path, "--after", parent)
    assert failed.exit_code == 1
    assert f"--after {parent}: the job failed; a job after it would never start" in failed.output
    with session_scope(settings) as session:
        assert session.query(Job).count() == 1  # the parent only


@pytest.mark.parametrize("task", ["embed", "classify"])
def test_a_templated_table_row_of_a_pooling_job_is_its_tasks_row(settings, tmp_path, task):
    """An embedding or classification job embeds or classifies each templated text as it is
    (the export then writes that task's body); a system message is refused for it."""
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"title": ["T1"], "body": ["B1"]}), path)
    rows = [
        row
        for chunk, _ in validated_chunks(
            source_of(path),
            table=TableColumns(prompt_template="{title}: {body}"),
            settings=get_settings(),
            task=task,
        )
        for row in chunk.to_pylist()
    ]
    assert [(r["kind"], r["prompt"]) for r in rows] == [(task, "T1: B1")]
    with pytest.raises(InputError, match="a messages column or a system message"):
        list(
            validated_chunks(
                source_of(path),
                table=TableColumns(prompt_template="{title}", system="x"),
                settings=get_settings(),
                task=task,
            )
        )


def test_a_parent_of_many_shards_is_read_one_shard_at_a_time_in_line_order(
    settings, tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("BATCHLLM_SHARD_SIZE", "4")
    get_settings.cache_clear()
    path = tmp_path / "many.jsonl"
    lines = [
        json.dumps({"custom_id": f"bad-{i}", "prompt": ""})
        if i % 7 == 3
        else json.dumps(
            {"custom_id": f"c{i}", "messages": [{"role": "user", "content": f"ask {i}"}]}
        )
        for i in range(25)
    ]
    path.write_text("\n".join(lines) + "\n")
    parent = Client().run(
        path, model=tokenizer.name_or_path, engines=InstantEngines(), max_tokens=2
    )
    assert parent.shards == 7
    with session_scope(get_settings()) as session:
        storage = Storage.for_job(service.get_job(session, parent.id), get_settings())
    target = tmp_path / "rows.parquet"

    from batchllm.jobs.parent_rows import write_parent_rows

    assert write_parent_rows(storage, parent.id, ("ok",), target) == 21
    table = pq.read_table(target)
    ok = [i for i in range(25) if i % 7 != 3]
    assert table.column("custom_id").to_pylist() == [f"c{i}" for i in ok]
    assert table.column("parent_line").to_pylist() == [i + 1 for i in ok]
    assert table.column("prompt").to_pylist() == [f"ask {i}" for i in ok]
    assert write_parent_rows(storage, parent.id, ("error",), tmp_path / "e.parquet") == 4


def test_a_waiting_job_is_cancelled_at_once_and_one_without_parents_left_is_released(
    settings, tmp_path
):
    from batchllm.input.job_spec import build_job_spec
    from batchllm.store import dependencies
    from batchllm.store.models import Shard

    given = tmp_path / "f.jsonl"
    given.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    spec = build_job_spec("/models/m", settings=settings, max_tokens=2)
    held = [
        create_job(
            source_of(given, settings), spec, shard_size=2, settings=settings, hold=True
        ).job.id
        for _ in range(2)
    ]
    assert {Client().status(job).status for job in held} == {"waiting"}
    assert Client().cancel(held[0]).status == "cancelled"
    with session_scope(settings) as session:
        moved = dependencies.move_waiting_jobs(session)
    assert (moved.released, moved.failed) == ([held[1]], [])
    assert len(moved.shards) == 2  # its two shards, whose tasks the reconciler sends
    assert Client().status(held[1]).status == "queued"
    with session_scope(settings) as session:
        shards = session.query(Shard).filter_by(job_id=held[1]).all()
        assert all(s.dispatched_at is not None for s in shards)
