"""Table input (input/validation/table.py): Parquet and CSV rows become the stored rows JSONL lines
become, with error rows naming row and column, ids joined back, local and on S3 (moto)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from batchllm import Client
from batchllm.errors import InputError
from batchllm.input.job_spec import build_job_spec
from batchllm.input.shards import validated_chunks
from batchllm.input.validation import table as table_module
from batchllm.settings import get_settings
from batchllm.spec import TableColumns
from batchllm.store.db import session_scope
from batchllm.store.models import Job
from tests.support.fake_runs import FakeEngine, FakeEngines, small_commits
from tests.support.inputs import source_of
from tests.support.s3server import moto_server


def stored(source: str | Path, **columns: str) -> tuple[list[dict], list[str]]:
    rows: list[dict] = []
    errors: list[str] = []
    for chunk, problems in validated_chunks(
        source_of(source), table=TableColumns(**columns), settings=get_settings()
    ):
        rows += chunk.to_pylist()
        errors += [str(p) for p in problems]
    return rows, errors


def stored_jsonl(path: Path, lines: list[dict]) -> list[dict]:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return [
        row
        for chunk, _ in validated_chunks(source_of(path), settings=get_settings())
        for row in chunk.to_pylist()
    ]


def test_a_parquet_row_is_stored_as_the_same_row_its_jsonl_line_becomes(tmp_path):
    texts = ["What is 2+2?", 'Say "hi" in Fran\u00e7ais\n', "   x  "]
    pq.write_table(pa.table({"doc": ["a", "b", "c"], "text": texts}), tmp_path / "d.parquet")
    system = "Answer in one word."

    plain, _ = stored(tmp_path / "d.parquet", prompt_column="text", id_column="doc")
    chat, _ = stored(tmp_path / "d.parquet", prompt_column="text", id_column="doc", system=system)

    assert plain == stored_jsonl(
        tmp_path / "p.jsonl",
        [{"custom_id": i, "prompt": t} for i, t in zip("abc", texts, strict=True)],
    )
    assert chat == stored_jsonl(
        tmp_path / "c.jsonl",
        [
            {
                "custom_id": i,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": t},
                ],
            }
            for i, t in zip("abc", texts, strict=True)
        ],
    )


def test_null_and_blank_prompts_and_ids_are_error_rows_naming_row_and_column(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.table(
            {
                "id": [10, 11, 12, None, 10, 15],
                "text": ["ok", None, " \t", "no id", "same id", "fine"],
            }
        ),
        path,
    )

    rows, errors = stored(path, prompt_column="text", id_column="id")

    assert [(r["line"], r["custom_id"], r["kind"]) for r in rows] == [
        (1, "10", "prompt"),
        (2, "11", "invalid"),
        (3, "12", "invalid"),
        (4, "line-4", "invalid"),
        (5, "10", "invalid"),
        (6, "15", "prompt"),
    ]
    assert errors == [
        f"{path}:2 field 'text': row 2: column 'text' is null",
        f"{path}:3 field 'text': row 3: column 'text' is blank",
        f"{path}:4 field 'id': row 4: no id in column 'id'",
        f"{path}:5 field 'custom_id': duplicate custom_id '10' (first on line 1)",
    ]
    assert rows[1]["error"] == "field 'text': row 2: column 'text' is null"


def test_a_csv_keeps_its_ids_as_text_and_numbers_rows_without_an_id_column(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('id,text,other\n007,hello,1\n008,,2\n009,"a, b",3\n')

    with_ids, errors = stored(path, prompt_column="text", id_column="id")
    numbered, _ = stored(path, prompt_column="text")

    assert [(r["custom_id"], r["kind"], r["prompt"]) for r in with_ids] == [
        ("007", "prompt", "hello"),
        ("008", "invalid", None),
        ("009", "prompt", "a, b"),
    ]
    assert errors == [f"{path}:2 field 'text': row 2: column 'text' is blank"]
    assert [r["custom_id"] for r in numbered] == ["1", "2", "3"]


def test_rows_are_read_a_record_batch_at_a_time_and_numbered_across_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(table_module, "_BATCH_ROWS", 3)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [f"p{i}" for i in range(8)]}), path, row_group_size=3)

    chunks = list(
        validated_chunks(
            source_of(path), table=TableColumns(prompt_column="text"), settings=get_settings()
        )
    )

    assert [c.num_rows for c, _ in chunks] == [3, 3, 2]
    rows = [r for c, _ in chunks for r in c.to_pylist()]
    assert [(r["line"], r["custom_id"], r["prompt"]) for r in rows] == [
        (i + 1, str(i + 1), f"p{i}") for i in range(8)
    ]


def test_a_messages_column_of_structs_or_json_text_is_validated_as_chat_lines(tmp_path):
    messages = [
        [{"role": "user", "content": "hi"}],
        [{"role": "wizard", "content": "abracadabra"}],
        None,
    ]
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"msgs": messages}), path)
    csv = tmp_path / "m.csv"
    pacsv.write_csv(pa.table({"msgs": [json.dumps(m) for m in messages[:2]] + ["[not json"]}), csv)

    rows, errors = stored(path, messages_column="msgs", system="Be brief.")
    from_csv, csv_errors = stored(csv, messages_column="msgs")

    assert rows[0]["kind"] == "chat"
    assert json.loads(rows[0]["messages"]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert [r["kind"] for r in rows] == ["chat", "invalid", "invalid"]
    assert errors[0].startswith(f"{path}:2 field 'msgs.0.role': row 2: column 'msgs': ")
    assert errors[1] == f"{path}:3 field 'msgs': row 3: column 'msgs' is null"
    assert json.loads(from_csv[0]["messages"]) == [{"role": "user", "content": "hi"}]
    assert [r["kind"] for r in from_csv] == ["chat", "invalid", "invalid"]
    assert "is not a JSON list of messages" in csv_errors[1]


def test_a_wrong_column_is_refused_up_front_naming_the_file_and_its_columns(tmp_path, settings):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": [1], "body": ["x"]}), path)

    with pytest.raises(InputError) as refused:
        Client(settings).submit(path, model="m", prompt_column="text")

    assert str(refused.value) == (
        f"{path}: no column 'text' (the prompt column); its columns: id, body"
    )
    with pytest.raises(InputError, match=r"column 'id' .* holds int64, not text"):
        build_job_spec("m", requests=source_of(path), prompt_column="id", settings=settings)
    with pytest.raises(InputError, match="needs prompt_column"):
        build_job_spec("m", requests=source_of(path), settings=settings)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "x"}\n')
    with pytest.raises(InputError, match="this one is read as JSONL"):
        build_job_spec("m", requests=source_of(jsonl), prompt_column="text", settings=settings)
    with session_scope(settings) as session:
        assert session.query(Job).count() == 0  # nothing was created


def test_client_run_of_a_parquet_file_joins_the_output_back_on_the_id(small_commits, tmp_path):
    path = tmp_path / "docs.parquet"
    docs = pa.table({"doc_id": ["d-7", "d-3", "d-9"], "text": ["red fox", None, "blue sky"]})
    pq.write_table(docs, path)
    client = Client(small_commits)

    job = client.run(
        path,
        model="/models/fake",
        prompt_column="text",
        id_column="doc_id",
        max_model_len=64,
        max_tokens=3,
        engines=FakeEngines(FakeEngine()),
    )

    assert (job.status, job.total, job.completed, job.failed) == ("completed", 3, 2, 1)
    output = client.results(job).to_table(columns=["custom_id", "line", "status", "text"])
    output = output.rename_columns(["custom_id", "line", "status", "answer"])
    joined = docs.join(output, keys="doc_id", right_keys="custom_id").sort_by("doc_id")
    assert joined.column("doc_id").to_pylist() == ["d-3", "d-7", "d-9"]
    assert joined.column("status").to_pylist() == ["error", "ok", "ok"]
    assert joined.column("line").to_pylist() == [2, 1, 3]
    assert all(joined.column("answer").to_pylist()[1:])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with moto_server(tmp_path_factory.mktemp("moto")) as running:
        yield running


def test_a_parquet_and_a_csv_on_s3_read_as_the_same_local_files(
    server, settings, tmp_path, monkeypatch
):
    bucket = server.new_bucket()
    for name, value in server.env(bucket).items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    local = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["one", None]}), local)
    local_csv = tmp_path / "d.csv"
    local_csv.write_text("id,text\na,one\nb,\n")
    fs = server.filesystem()
    for source in (local, local_csv):
        with fs.open_output_stream(f"{bucket}/in/{source.name}") as out:
            out.write(source.read_bytes())

    for source in (local, local_csv):
        uri = f"s3://{bucket}/in/{source.name}"
        from_s3, s3_errors = stored(uri, prompt_column="text", id_column="id")
        here, errors = stored(source, prompt_column="text", id_column="id")
        assert from_s3 == here
        assert [e.replace(uri, "FILE") for e in s3_errors] == [
            e.replace(str(source), "FILE") for e in errors
        ]
        assert [r["kind"] for r in here] == ["prompt", "invalid"]
    with pytest.raises(InputError, match=r"no column 'prompt'.*its columns: id, text"):
        stored(f"s3://{bucket}/in/d.parquet", prompt_column="prompt")
    get_settings.cache_clear()
