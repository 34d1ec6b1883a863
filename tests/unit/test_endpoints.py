"""The one endpoint table (input/parsing/endpoints.py) is what the line schema, the Batch API, the
export and the docs go by; a refused line's OpenAI error code is decided by validation and stored
with it; `n` over BATCHLLM_MAX_N is refused at every front door."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from batchllm.api.batches import spec_for
from batchllm.api.batches_routes import CreateBatch, _check_request
from batchllm.api.errors import ApiError
from batchllm.client import Client
from batchllm.input.formats.schemas import LineError, Request
from batchllm.input.job_spec import OptionOverLimit, build_job_spec
from batchllm.input.parsing.endpoints import ENDPOINTS, URLS, OpenAIBatchLine
from batchllm.input.validation.validate import read_row_chunks
from batchllm.jobs.local import run_job
from batchllm.output.openai_files import ERRORS_NAME, export_openai
from batchllm.settings import Settings, get_settings
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import Job as JobRow
from tests.support.fake_runs import FakeEngine, FakeEngines, make_spec, small_commits
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests
from tests.support.openai_export_jobs import export_every_form

REPO = Path(__file__).resolve().parents[2]


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.url)
def test_every_endpoint_of_the_table_is_a_url_a_line_may_name(endpoint):
    line = {"custom_id": "a", "method": "POST", "url": endpoint.url, "body": {}}

    assert OpenAIBatchLine.model_validate(line).endpoint is endpoint


def test_a_url_outside_the_table_is_refused_naming_every_url_of_the_table(tmp_path):
    path = write_lines(
        tmp_path / "in.jsonl",
        [{"custom_id": "a", "method": "POST", "url": "/v1/moderations", "body": {}}],
    )

    [error] = read_requests(source_of(path), settings=get_settings())

    listed = ", ".join(f"'{url}'" for url in URLS[:-1]) + f" or '{URLS[-1]}'"
    assert isinstance(error, LineError)
    assert (error.field, error.message) == ("url", f"url: Input should be {listed}")


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.url)
def test_every_endpoint_is_a_batch_api_endpoint_running_as_its_task(endpoint, settings):
    body = CreateBatch(input_file_id="file-1", endpoint=endpoint.url, completion_window="24h")

    assert _check_request(body) == {}
    assert spec_for("/models/fake", endpoint.url, {}, settings).engine.task == endpoint.task


def test_the_batch_api_refuses_another_endpoint_listing_the_table():
    body = CreateBatch(input_file_id="file-1", endpoint="/v1/moderations", completion_window="24h")

    with pytest.raises(ApiError) as refused:
        _check_request(body)

    assert refused.value.message == f"endpoint '/v1/moderations': one of {', '.join(URLS)}"


def test_the_batch_api_doc_lists_the_endpoints_of_the_table():
    doc = (REPO / "docs" / "batch-api.md").read_text()
    paragraph = doc.split("**Endpoints.**", 1)[1].split("\n\n", 1)[0]

    assert re.findall(r"`(/v1/[a-z/]+)`", paragraph) == list(URLS)


# A chat line whose body has no messages.
NO_MESSAGES = {
    "custom_id": "no-messages",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {},
}


def test_a_line_missing_a_field_is_stored_with_code_missing_required_parameter(tmp_path):
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            {"custom_id": "ok", "prompt": "hello"},
            NO_MESSAGES,
            {"custom_id": "typo", "prompt": "x", "temprature": 0.5},
        ],
    )

    [(table, errors)] = read_row_chunks(source_of(path), settings=get_settings())
    per_line = [(e.custom_id, e.field, e.code) for e in errors]

    assert per_line == [
        ("no-messages", "body.messages", "missing_required_parameter"),
        ("typo", "temprature", "unknown_parameter"),
    ]
    assert table.column("kind").to_pylist() == ["prompt", "invalid", "invalid"]
    assert [json.loads(s) if s else None for s in table.column("sampling").to_pylist()] == [
        None,
        {"error_code": "missing_required_parameter"},
        {"error_code": "unknown_parameter"},
    ]
    # Line by line, the same code with the LineError.
    items = list(read_requests(source_of(path), settings=get_settings()))
    assert isinstance(items[0], Request)
    assert [item.code for item in items[1:]] == [  # type: ignore[union-attr]
        "missing_required_parameter",
        "unknown_parameter",
    ]


def test_the_export_answers_a_line_missing_a_field_with_its_stored_code(settings, tmp_path):
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            {"custom_id": "ok", "prompt": "hello"},
            NO_MESSAGES,
        ],
    )
    job = run_job(
        source_of(path, settings), make_spec(), settings=settings, engines=FakeEngines(FakeEngine())
    )
    export_openai(job, tmp_path / "out", settings=settings)

    [line] = [json.loads(t) for t in (tmp_path / "out" / ERRORS_NAME).read_text().splitlines()]

    assert line["custom_id"] == "no-messages"
    assert line["response"]["status_code"] == 400
    error = line["response"]["body"]["error"]
    assert (error["param"], error["code"]) == ("messages", "missing_required_parameter")
    assert error["message"] == "body.messages: Field required"


def test_shards_stored_without_codes_export_the_same_codes_read_from_the_wording(
    small_commits: Settings, tmp_path
):
    job, out = export_every_form(small_commits, tmp_path)
    coded = (out / ERRORS_NAME).read_bytes()
    storage = Storage.for_job(job, small_commits)
    stored_codes = []
    for name in storage.listdir(storage.input_dir(job.id)):
        if not name.startswith("shard-"):
            continue
        path = str(Path(storage.input_dir(job.id)) / name)
        table = pq.read_table(path)
        invalid = pc.equal(table.column("kind"), "invalid")
        stored_codes += table.filter(invalid).column("sampling").to_pylist()
        settings_text = pc.if_else(invalid, None, table.column("sampling"))
        pq.write_table(table.set_column(5, "sampling", settings_text), path)
    assert len(stored_codes) == 4 and all(stored_codes)  # what the export read until now

    export_openai(job, out, settings=small_commits, overwrite=True)

    assert (out / ERRORS_NAME).read_bytes() == coded


def test_n_over_batchllm_max_n_is_refused_where_the_job_spec_is_built(settings, tmp_path):
    with pytest.raises(OptionOverLimit) as refused:
        build_job_spec("/models/fake", settings=settings, n=settings.max_n + 1)

    assert refused.value.option == "n"
    assert refused.value.reason == f"{settings.max_n + 1} is over BATCHLLM_MAX_N ({settings.max_n})"
    assert build_job_spec("/models/fake", settings=settings, n=settings.max_n).sampling.n == (
        settings.max_n
    )


def test_the_client_refuses_n_over_batchllm_max_n_before_any_job_exists(settings, tmp_path):
    client = Client(settings)

    with pytest.raises(OptionOverLimit, match=r"^n: 17 is over BATCHLLM_MAX_N \(16\)$"):
        client.submit([{"prompt": "hi"}], model="/models/fake", n=17)

    with session_scope(settings) as session:
        assert session.scalar(select(func.count()).select_from(JobRow)) == 0
