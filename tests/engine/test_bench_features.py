"""`batchllm bench --parts features` and `--parts embed` on a tiny workload: every contender row
is printed with positive figures, and bench.json holds every figure and agrees with the workload.

Both run in this process on the session's engines (tests/engine/conftest.py `run_here`), the
features part on the tiny model (its own engine: compact_json, no prefix caching), the embed part
on the real embedding model, MiniLM, whose pooling engine (no prefix caching) the embedding jobs
of test_embedding_jobs.py share. As in test_bench.py, timings are the benchmark's business:
nothing here checks how fast anything was, only that every job did its whole work with its
feature.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchllm.bench.parts import embed, features
from batchllm.bench.suite import DEFAULT_PARTS, BenchConfig

# The features engine is built here; the embed part's pooling engine too, unless another
# module built it first.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

REQUESTS = 40
# Room for the compact JSON answer (about 35 tokens of the demo model's tokenizer), so the
# JSON rows stop by themselves and satisfy the schema.
MAX_TOKENS = 48
TEXTS = 100


@dataclass
class Bench:
    result: dict  # both parts' sections of bench.json
    outputs: list[Path]  # each run's --output folder
    stdout: str  # both runs' printed tables


def run_bench(run_here, out: Path, model: Path, *args: str) -> tuple[dict, str]:
    done = run_here(
        "bench",
        *("--output", str(out)),
        *("--model", str(model)),
        *("--repeats", "1"),
        "--enforce-eager",  # no torch.compile at the engine's start
        *args,
        home=out / "home",
    )
    assert done.exit_code == 0, done.output[-5000:]
    return json.loads((out / "bench.json").read_text()), done.stdout


@pytest.fixture(scope="module")
def bench(tiny_model, embed_model, run_here, tmp_path_factory) -> Bench:
    outputs = [tmp_path_factory.mktemp("bench-features"), tmp_path_factory.mktemp("bench-embed")]
    featured, features_said = run_bench(
        run_here,
        outputs[0],
        tiny_model,
        *("--parts", "features"),
        *("--feature-requests", str(REQUESTS)),
        *("--feature-max-tokens", str(MAX_TOKENS)),
    )
    embedded, embed_said = run_bench(
        run_here, outputs[1], embed_model, *("--parts", "embed", "--embed-texts", str(TEXTS))
    )
    return Bench(
        {"features": featured["features"], "embed": embedded["embed"]},
        outputs,
        features_said + embed_said,
    )


def cells_after(stdout: str, label: str) -> list[str]:
    """The cells of the printed table row that starts with `label`."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(label + "  ")]
    return line[len(label) :].split()


def number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x%"))


def test_the_features_and_embed_parts_are_opt_in():
    assert "features" not in DEFAULT_PARTS and "embed" not in DEFAULT_PARTS
    assert BenchConfig(output=Path("x")).parts == DEFAULT_PARTS


def test_every_feature_job_ran_every_request_with_its_feature(bench):
    result = bench.result
    jobs = result["features"]["jobs"]

    assert set(jobs) == set(features.JOBS)
    for key, figures in jobs.items():
        assert figures["requests"] == REQUESTS, key
        assert figures["failed"] == 0, key
        for name in ("requests_per_s", "output_tokens_per_s", "wall_seconds"):
            assert figures[name]["median"] > 0, (key, name)
        assert figures["requests_ratio_to_plain"] > 0 and figures["tokens_ratio_to_plain"] > 0
    assert jobs["plain"]["requests_ratio_to_plain"] == 1.0
    # Each job's raw vLLM twin ran the same requests with the same settings.
    raw = result["features"]["raw"]
    assert set(raw) == set(jobs)
    for key, figures in raw.items():
        assert figures["requests"] == REQUESTS, key
        assert figures["output_tokens_per_s"]["median"] > 0, key
        assert jobs[key]["requests_ratio_to_raw"] > 0, key
    for key in ("plain", "logprobs", "n4"):
        assert raw[key]["output_tokens"] == jobs[key]["output_tokens"], key
    assert raw["plain"]["tokens_ratio_to_raw_plain"] == 1.0
    assert raw["control"]["output_tokens"] == raw["mixed"]["output_tokens"]
    # ignore_eos rows generate exactly max_tokens, every sample of the n=4 rows included.
    assert jobs["plain"]["output_tokens"] == REQUESTS * MAX_TOKENS
    assert jobs["logprobs"]["output_tokens"] == REQUESTS * MAX_TOKENS
    assert jobs["n4"]["output_tokens"] == REQUESTS * MAX_TOKENS * features.SAMPLES
    # Grammar-constrained rows stop early; the choice rows always satisfy their constraint.
    assert jobs["choice"]["output_tokens"] < REQUESTS * MAX_TOKENS
    assert jobs["choice"]["structured_rows"] == jobs["choice"]["structured_valid"] == REQUESTS
    assert jobs["json"]["structured_rows"] == REQUESTS
    assert jobs["json"]["structured_valid"] > 0
    constrained = sum(features.mixed_kind(i) in ("json", "choice") for i in range(REQUESTS))
    assert jobs["mixed"]["structured_rows"] == constrained
    assert "structured_rows" not in jobs["control"]
    # The control generated exactly what the mixed job did, without any constraint.
    assert jobs["control"]["output_tokens"] == jobs["mixed"]["output_tokens"]


def test_the_mixed_jobs_plain_rows_are_compared_with_the_same_rows_of_the_control(bench):
    result = bench.result
    part = result["features"]

    assert set(part["plain_rows"]) == set(features.HALVES)
    for key, figures in part["plain_rows"].items():
        assert figures["requests"] == REQUESTS // 2, key
        assert figures["output_tokens"] == REQUESTS // 2 * MAX_TOKENS, key
        assert 0 < figures["median_latency_seconds"] <= figures["wall_seconds"]["median"], key
    assert set(part["mixed_vs_control"]) == {"plain_rows", "plain_rows_latency", "job", "raw_vllm"}
    assert all(ratio > 0 for ratio in part["mixed_vs_control"].values())
    assert part["engine"]["compact_json"] is True
    assert part["engine"]["prefix_caching"] is False


def test_every_embedding_contender_embedded_the_same_texts_alike(bench):
    result = bench.result
    part = result["embed"]
    contenders = part["contenders"]

    assert set(contenders) == set(embed.CONTENDERS)
    assert part["texts"] == TEXTS and part["dimensions"] > 0
    tokens = {figures["prompt_tokens"] for figures in contenders.values()}
    assert len(tokens) == 1 and tokens.pop() > TEXTS  # the same texts, tokenized alike
    for key, figures in contenders.items():
        assert figures["requests"] == TEXTS, key
        assert figures["failed"] == 0, key
        assert figures["input_tokens_per_s"]["median"] > 0, key
        assert figures["ratio_to_raw"] > 0, key
        assert figures["max_abs_difference"] <= 1e-3, key
    assert contenders[embed.BASELINE]["ratio_to_raw"] == 1.0


def test_the_printed_tables_have_every_row_with_positive_figures(bench):
    stdout = bench.stdout

    for label in features.JOBS.values():
        req_s, tok_s, *_ = cells_after(stdout, label)
        assert number(req_s) > 0 and number(tok_s) > 0, label
    for label in embed.CONTENDERS.values():
        rows_s, input_tok_s, *_ = cells_after(stdout, label)
        assert number(rows_s) > 0 and number(input_tok_s) > 0, label
    for label in (
        "batchllm, whole job: out tok/s",
        "batchllm, its plain rows: out tok/s",
        "batchllm, its plain rows: median latency s",
        "raw vLLM, one generate call: out tok/s",
    ):
        mixed, control, ratio = cells_after(stdout, label)
        assert number(mixed) > 0 and number(control) > 0 and number(ratio) > 0, label
    assert "--compact-json" in stdout
    for out in bench.outputs:
        assert (out / "bench.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
