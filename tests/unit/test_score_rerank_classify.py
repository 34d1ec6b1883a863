"""Score, rerank and classify lines (issue 35, item 5) without vLLM: how the lines validate and
which task a file infers, the rows a job over them writes (the package's fake engine embeds
bag-of-words vectors and classifies by word ids), and the bodies `batchllm export` gives them
(vLLM run-batch's ScoreResponse, RerankResponse and ClassificationResponse)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from batchllm.execution.stand_in_engines import FAKE_LABELS, FakeEngine
from batchllm.input.formats.schemas import LineError, Request
from batchllm.input.formats.scoring import ScoreShape, pair_scores, ranked
from batchllm.input.validation.validate import infer_task
from batchllm.jobs.local import run_job
from batchllm.output.openai_files import export_openai
from batchllm.output.parts import OUTPUT_SCHEMA, SCHEMA_VERSION
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults
from tests.support.fake_runs import FakeEngines, output_rows
from tests.support.file_jobs import run_file
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests

QUERY = "the cat sat on the mat"
PARAPHRASE = "a cat sat on a mat"
UNRELATED = "stocks fell sharply in early trading"


def score_line(custom_id: str, body: dict, url: str = "/v1/score") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


GOOD_LINES = [
    score_line("one-many", {"model": "m", "text_1": QUERY, "text_2": [PARAPHRASE, UNRELATED]}),
    score_line("pairs", {"text_1": [QUERY, UNRELATED], "text_2": [PARAPHRASE, PARAPHRASE]}),
    score_line("strings", {"text_1": QUERY, "text_2": PARAPHRASE}),
    score_line(
        "rerank",
        {"model": "m", "query": QUERY, "documents": [UNRELATED, PARAPHRASE], "top_n": 1},
        "/v1/rerank",
    ),
    score_line("rerank-all", {"query": QUERY, "documents": [UNRELATED, PARAPHRASE]}, "/v1/rerank"),
]
# custom_id -> the field its error names
BAD_LINES = {
    "no-text-2": (score_line("no-text-2", {"text_1": QUERY}), "body.text_2"),
    "empty-text-2": (score_line("empty-text-2", {"text_1": QUERY, "text_2": []}), "body.text_2"),
    "number": (score_line("number", {"text_1": 7, "text_2": PARAPHRASE}), "body.text_1"),
    "unpaired": (
        score_line("unpaired", {"text_1": [QUERY, QUERY], "text_2": [PARAPHRASE] * 3}),
        "body.text_1",
    ),
    "no-documents": (
        score_line("no-documents", {"query": QUERY, "documents": []}, "/v1/rerank"),
        "body.documents",
    ),
    "no-query": (
        score_line("no-query", {"documents": [PARAPHRASE]}, "/v1/rerank"),
        "body.query",
    ),
    "negative-top-n": (
        score_line(
            "negative-top-n", {"query": QUERY, "documents": [PARAPHRASE], "top_n": -1}, "/v1/rerank"
        ),
        "body.top_n",
    ),
    "unknown-field": (
        score_line("unknown-field", {"text_1": QUERY, "text_2": QUERY, "text_3": QUERY}),
        "body.text_3",
    ),
}


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _read_by_id(source, task: str, settings) -> dict:
    """The file's lines as read for a job of `task`, by custom_id."""
    return {
        r.custom_id: r
        for r in read_requests(source_of(source, settings), task=task, settings=settings)
    }


def test_score_and_rerank_lines_make_an_embedding_job(tmp_path, settings):
    source = write_jsonl(tmp_path / "score.jsonl", GOOD_LINES)
    rerank_first = write_jsonl(tmp_path / "rerank.jsonl", GOOD_LINES[3:])

    assert infer_task(source_of(source, settings), settings) == "embed"
    assert infer_task(source_of(rerank_first, settings), settings) == "embed"


def test_classify_lines_make_a_classification_job(tmp_path, settings):
    lines = [score_line("a", {"model": "m", "input": QUERY}, "/v1/classify")]
    source = write_jsonl(tmp_path / "classify.jsonl", lines)

    assert infer_task(source_of(source, settings), settings) == "classify"


def test_score_lines_store_their_texts_queries_first_and_their_shape(tmp_path, settings):
    source = write_jsonl(tmp_path / "score.jsonl", GOOD_LINES)
    read = _read_by_id(source, "embed", settings)

    assert all(isinstance(r, Request) and r.kind == "score" for r in read.values())
    assert read["one-many"].inputs == [QUERY, PARAPHRASE, UNRELATED]
    assert read["one-many"].sampling == {"score": {"queries": 1}}
    assert read["pairs"].inputs == [QUERY, UNRELATED, PARAPHRASE, PARAPHRASE]
    assert read["pairs"].sampling == {"score": {"queries": 2}}
    assert read["strings"].inputs == [QUERY, PARAPHRASE]
    assert read["rerank"].inputs == [QUERY, UNRELATED, PARAPHRASE]
    assert read["rerank"].sampling == {"score": {"queries": 1, "rerank": True, "top_n": 1}}
    assert read["rerank-all"].sampling == {"score": {"queries": 1, "rerank": True}}


@pytest.mark.parametrize("custom_id", sorted(BAD_LINES))
def test_a_bad_score_or_rerank_line_is_an_error_naming_its_line_and_field(
    custom_id, tmp_path, settings
):
    line, field = BAD_LINES[custom_id]
    source = write_jsonl(tmp_path / "bad.jsonl", [GOOD_LINES[0], line])
    read = list(read_requests(source_of(source, settings), task="embed", settings=settings))

    assert isinstance(read[0], Request)
    error = read[1]
    assert isinstance(error, LineError), error
    assert (error.line, error.custom_id, error.field) == (2, custom_id, field)
    assert str(error).startswith(f"{source}:2 field '{field}': ")


def test_score_lines_in_a_generation_job_are_error_rows_naming_the_url(tmp_path, settings):
    source = write_jsonl(tmp_path / "score.jsonl", GOOD_LINES[:1] + GOOD_LINES[3:4])
    read = list(read_requests(source_of(source, settings), task="generate", settings=settings))

    assert [type(r) for r in read] == [LineError, LineError]
    assert {r.field for r in read} == {"url"}
    assert "--task embed" in read[0].message and "--task classify" in read[0].message


def test_a_classification_job_takes_score_lines_for_a_cross_encoder(tmp_path, settings):
    source = write_jsonl(tmp_path / "score.jsonl", GOOD_LINES)
    read = _read_by_id(source, "classify", settings)

    assert all(isinstance(r, Request) and r.kind == "score" for r in read.values())
    assert read["rerank"].inputs == [QUERY, UNRELATED, PARAPHRASE]


def test_classify_lines_outside_a_classification_job_are_error_rows(tmp_path, settings):
    lines = [score_line("c", {"input": QUERY}, "/v1/classify")]
    source = write_jsonl(tmp_path / "c.jsonl", lines)
    for task in ("generate", "embed"):
        (error,) = read_requests(source_of(source, settings), task=task, settings=settings)
        assert isinstance(error, LineError)
        assert error.field == "url" and "--task classify" in error.message


def test_a_classification_job_takes_input_lines_and_refuses_others(tmp_path, settings):
    lines = [
        {"custom_id": "plain", "input": QUERY},
        score_line("oai", {"model": "m", "input": UNRELATED}, "/v1/classify"),
        {"custom_id": "list", "input": [QUERY, UNRELATED]},
        {"custom_id": "prompt", "prompt": QUERY},
    ]
    source = write_jsonl(tmp_path / "c.jsonl", lines)
    read = _read_by_id(source, "classify", settings)

    assert (read["plain"].kind, read["plain"].prompt) == ("classify", QUERY)
    assert (read["oai"].kind, read["oai"].prompt) == ("classify", UNRELATED)
    assert isinstance(read["list"], LineError) and read["list"].field == "input"
    assert isinstance(read["prompt"], LineError) and read["prompt"].field == "prompt"


def test_pair_scores_are_cosines_and_rerank_orders_best_first():
    one, two = [1.0, 0.0], [0.6, 0.8]

    assert pair_scores(ScoreShape(1), [one, one, two]) == pytest.approx([1.0, 0.6])
    assert pair_scores(ScoreShape(2), [one, two, two, two]) == pytest.approx([0.6, 1.0])
    assert pair_scores(ScoreShape(1), [one, [0.0, 0.0]]) == [0.0]
    assert ranked([0.2, 0.9, 0.2, 0.5], None) == [1, 3, 0, 2]
    assert ranked([0.2, 0.9, 0.2, 0.5], 2) == [1, 3]
    assert ranked([0.2, 0.9], 0) == [1, 0]


def spec(task: str) -> JobSpec:
    return JobSpec(
        model="/models/fake",
        sampling=SamplingDefaults(max_tokens=4),
        engine=EngineOptions(task=task, max_model_len=64),
    )


@pytest.fixture
def score_job(tmp_path, settings):
    bad = [line for line, _ in BAD_LINES.values()][:2]
    embed = {"custom_id": "vector", "input": QUERY}
    source = write_jsonl(tmp_path / "score.jsonl", [*GOOD_LINES, *bad, embed])
    engine = FakeEngine(max_model_len=64)
    job = run_job(
        source_of(source, settings), spec("embed"), settings=settings, engines=FakeEngines(engine)
    )
    rows = {r["custom_id"]: r for r in output_rows(settings, job.id)}
    return job, rows


def test_a_score_job_writes_one_score_per_document_and_ranks_the_paraphrase_first(score_job):
    job, rows = score_job

    assert job.status.value == "completed"
    one_many = rows["one-many"]
    assert one_many["status"] == "ok" and len(one_many["scores"]) == 2
    assert one_many["scores"][0] > one_many["scores"][1]  # the paraphrase above the unrelated
    assert rows["pairs"]["scores"][0] > rows["pairs"]["scores"][1]
    assert rows["strings"]["scores"] == pytest.approx([one_many["scores"][0]])
    rerank = rows["rerank"]["scores"]  # in document order: unrelated, paraphrase
    assert rerank == pytest.approx(one_many["scores"][::-1])
    for key in ("one-many", "pairs", "strings", "rerank", "rerank-all"):
        row = rows[key]
        assert row["prompt_tokens"] > 0
        assert (row["text"], row["embedding"], row["embeddings"], row["label"]) == (None,) * 4
    assert len(rows["vector"]["embedding"]) > 0 and rows["vector"]["scores"] is None


def test_bad_score_lines_become_error_rows_and_the_job_completes(score_job):
    job, rows = score_job
    bad = [custom_id for custom_id in BAD_LINES][:2]

    assert job.status.value == "completed"
    for custom_id in bad:
        row = rows[custom_id]
        assert row["status"] == "error" and row["scores"] is None
        assert row["error"].startswith(f"field '{BAD_LINES[custom_id][1]}': "), row["error"]


def test_output_schema_version_5_adds_scores_label_and_probs():
    assert SCHEMA_VERSION == 5
    assert OUTPUT_SCHEMA.field("scores").type == pa.list_(pa.float64())
    assert OUTPUT_SCHEMA.field("label").type == pa.string()
    assert OUTPUT_SCHEMA.field("probs").type == pa.list_(pa.float32())
    assert OUTPUT_SCHEMA.names[-3:] == ["scores", "label", "probs"]  # appended, nothing moved


def exported(job, settings, out: Path) -> dict[str, dict]:
    export_openai(job, out, settings=settings)
    lines = [json.loads(line) for line in (out / "output.jsonl").read_text().splitlines()]
    return {line["custom_id"]: line for line in lines}


def test_export_gives_score_and_rerank_bodies_like_run_batch(score_job, settings, tmp_path):
    job, rows = score_job
    lines = exported(job, settings, tmp_path / "export")

    score = lines["one-many"]["response"]["body"]
    assert score["object"] == "list" and score["model"] == "/models/fake"
    assert score["id"].startswith("embd-")
    assert score["data"] == [
        {"index": i, "object": "score", "score": s}
        for i, s in enumerate(rows["one-many"]["scores"])
    ]
    assert score["usage"]["prompt_tokens"] == rows["one-many"]["prompt_tokens"]
    rerank = lines["rerank"]["response"]["body"]
    assert rerank["id"].startswith("rerank-")
    assert rerank["results"] == [  # top_n 1: the paraphrase, document 1
        {
            "index": 1,
            "document": {"text": PARAPHRASE},
            "relevance_score": rows["rerank"]["scores"][1],
        }
    ]
    every = lines["rerank-all"]["response"]["body"]["results"]
    assert [(r["index"], r["document"]["text"]) for r in every] == [(1, PARAPHRASE), (0, UNRELATED)]
    assert set(lines) == {line["custom_id"] for line in GOOD_LINES} | {"vector"}


def test_a_classification_job_writes_labels_and_probs_and_exports_them(settings, tmp_path):
    lines = [
        {"custom_id": "a", "input": QUERY},
        score_line("b", {"input": UNRELATED}, "/v1/classify"),
        {"custom_id": "bad", "input": ""},
    ]
    source = write_jsonl(tmp_path / "c.jsonl", lines)
    engine = FakeEngine(max_model_len=64)
    job = run_file(source, spec("classify"), settings, engines=FakeEngines(engine))
    rows = {r["custom_id"]: r for r in output_rows(settings, job.id)}

    assert job.status.value == "completed"
    for key in ("a", "b"):
        row = rows[key]
        assert row["status"] == "ok" and row["label"] in FAKE_LABELS
        assert len(row["probs"]) == len(FAKE_LABELS)
        assert sum(row["probs"]) == pytest.approx(1.0)
        assert row["label"] == FAKE_LABELS[row["probs"].index(max(row["probs"]))]
        assert row["scores"] is None and row["text"] is None
    assert rows["bad"]["status"] == "error" and rows["bad"]["error"].startswith("field 'input'")
    body = exported(job, settings, tmp_path / "export")["a"]["response"]["body"]
    assert body["id"].startswith("classify-") and body["object"] == "list"
    assert body["data"] == [
        {
            "index": 0,
            "label": rows["a"]["label"],
            "probs": rows["a"]["probs"],
            "num_classes": len(FAKE_LABELS),
        }
    ]


def test_a_cross_encoder_job_writes_a_score_per_pair(settings, tmp_path):
    source = write_jsonl(tmp_path / "score.jsonl", GOOD_LINES)
    engine = FakeEngine(max_model_len=64)
    job = run_file(source, spec("classify"), settings, engines=FakeEngines(engine))
    rows = {r["custom_id"]: r for r in output_rows(settings, job.id)}

    assert job.status.value == "completed"
    # The fake cross-encoder sees each pair as one prompt: query then document.
    assert engine.prompts_added[:2] == [f"<s> {QUERY} {PARAPHRASE}", f"<s> {QUERY} {UNRELATED}"]
    assert [len(rows[k]["scores"]) for k in ("one-many", "pairs", "strings", "rerank")] == [
        2,
        2,
        1,
        2,
    ]
    for row in rows.values():
        assert row["status"] == "ok" and row["label"] is None and row["probs"] is None
    lines = exported(job, settings, tmp_path / "export")
    assert len(lines["rerank"]["response"]["body"]["results"]) == 1  # top_n 1


@pytest.mark.parametrize(
    ("endpoint", "metadata", "task"),
    [
        ("/v1/score", {}, "embed"),
        ("/v1/rerank", {}, "embed"),
        ("/v1/rerank", {"task": "classify"}, "classify"),  # a cross-encoder's
        ("/v1/classify", {}, "classify"),
        ("/v1/embeddings", {"task": "classify"}, "embed"),
    ],
)
def test_a_batch_api_batch_takes_its_task_from_its_endpoint(endpoint, metadata, task, settings):
    from batchllm.api.batches import spec_for
    from batchllm.input.parsing.endpoints import URLS as ENDPOINTS

    assert endpoint in ENDPOINTS
    assert spec_for("/models/fake", endpoint, metadata, settings).engine.task == task


class _Params:
    """Stands in for vLLM's PoolingParams: clone() and extra_kwargs."""

    def __init__(self, extra: dict | None = None) -> None:
        self.extra_kwargs = extra

    def clone(self) -> _Params:
        return _Params(dict(self.extra_kwargs or {}))


def test_each_cross_encoder_pair_carries_its_own_token_types_to_the_engine():
    from batchllm.engine.cross_encoder import CrossEncoder, PairIds

    shared = _Params({"other": 1})
    typed, untyped = PairIds([101, 7, 102, 9, 102], 3), PairIds([1, 7, 9], None)

    ids, params = CrossEncoder.request(typed, shared)
    assert type(ids) is list and ids == [101, 7, 102, 9, 102]
    assert params.extra_kwargs == {"other": 1, "compressed_token_type_ids": 3}
    assert shared.extra_kwargs == {"other": 1}  # the row's params are shared: never changed
    ids, params = CrossEncoder.request(untyped, shared)
    assert (type(ids), ids, params) == (list, [1, 7, 9], shared)
    # The same pair in two rows carries its types to both (nothing is used up).
    assert CrossEncoder.request(typed, shared)[1].extra_kwargs["compressed_token_type_ids"] == 3
