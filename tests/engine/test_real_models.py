"""A real chat model, real answers: SmolLM2-135M-Instruct through `batchllm run`.

Everything else runs on the tiny random-weight model, which never stops on its own and answers
nothing. Here one chat job (greedy, eager mode) covers what only a trained model shows: its
chat template and default system prompt, an end-of-turn token that ends a row `stop`, right
answers, constraints on a model that would say something else, sampling and log probabilities,
and the context sizing against an 8k model. The real embedding model's jobs (vectors that mean
something) are test_embedding_jobs.py's, on the pooling engine the bench's embed part shares.

A 135M model is not always right: answers are checked over several questions with a margin,
never one question on which bf16 numerics could tip the greedy choice.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from batchllm.demo import PERSON_SCHEMA
from tests.support.cli import local_env, run_cli

# The module's fixture converts and runs the real chat model (SmolLM2): one engine build.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MAX_TOKENS = 48
CAPITALS = {
    "Japan": "Tokyo",
    "Germany": "Berlin",
    "Spain": "Madrid",
    "England": "London",
    "Russia": "Moscow",
    "Egypt": "Cairo",
}
SHARED_SYSTEM = (
    "You are a support assistant for a bicycle shop. "
    + "Customers ask about repairs, prices, opening hours and delivery. " * 12
)
MODEL_CONTEXT = 8192


def batchllm(*args: str, home: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return run_cli(local_env(home), *args, timeout=timeout)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def chat_lines() -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = [
        {"custom_id": f"capital-{country}", "messages": user(f"What is the capital of {country}?")}
        for country in CAPITALS
    ]
    lines += [
        {
            "custom_id": "own-system",
            "messages": [{"role": "system", "content": "Be brief."}, *user("Name a fruit.")],
        },
        {
            "custom_id": "cut",
            "messages": user("Write a long story about a dragon."),
            "max_tokens": 5,
        },
        {
            "custom_id": "json",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": user(
                    "Maria is 34 years old and lives in Lisbon. "
                    "Give her name, age and city as JSON."
                ),
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
                },
            },
        },
        {
            "custom_id": "choice",
            "messages": [
                {
                    "role": "system",
                    "content": "You classify the sentiment of reviews. Answer with one word: "
                    "positive, negative or neutral.",
                },
                *user("I loved this movie, the acting was wonderful."),
            ],
            "choice": ["positive", "negative", "neutral"],
        },
        {
            "custom_id": "regex",
            "messages": user("Give me a phone number."),
            "regex": r"[0-9]{3}-[0-9]{4}",
        },
        {
            "custom_id": "samples",
            "messages": user("Tell me a one-sentence fact about the sea."),
            "n": 3,
            "temperature": 1.0,
            "max_tokens": 24,
        },
        {
            "custom_id": "logprobs",
            "messages": user("What is the capital of Japan?"),
            "logprobs": True,
            "top_logprobs": 5,
        },
        {"custom_id": "too-long", "prompt": "word " * (MODEL_CONTEXT + 100)},
    ]
    lines += [
        {
            "custom_id": f"shared-{i}",
            "messages": [{"role": "system", "content": SHARED_SYSTEM}, *user(question)],
        }
        for i, question in enumerate(
            [
                "When do you open?",
                "Do you deliver?",
                "How much is a new tyre?",
                "Can you fix brakes?",
            ]
        )
    ]
    return lines


@pytest.fixture(scope="module")
def chat_job(chat_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("real-chat")
    lines = chat_lines()
    source = work / "chat.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ran = batchllm(
        "run",
        str(source),
        "--model",
        str(chat_model),
        "--temperature",
        "0",
        "--max-tokens",
        str(DEFAULT_MAX_TOKENS),
        "--enforce-eager",
        "--output",
        str(work / "out"),
        home=work / "home",
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    rows = ds.dataset(work / "out", format="parquet").to_table().to_pylist()
    manifest = json.loads((work / "out" / "_manifest.json").read_text())
    return {
        "lines": {line["custom_id"]: line for line in lines},
        "rows": {row["custom_id"]: row for row in rows},
        "manifest": manifest,
        "stdout": ran.stdout,
    }


def test_every_line_gives_one_row_and_only_the_too_long_prompt_is_an_error(chat_job):
    rows = chat_job["rows"]
    assert sorted(rows) == sorted(chat_job["lines"])
    errors = {cid: row["error"] for cid, row in rows.items() if row["status"] == "error"}
    assert list(errors) == ["too-long"]
    assert str(MODEL_CONTEXT) in errors["too-long"], errors


def test_short_questions_end_on_the_end_of_turn_token_with_the_right_answer(chat_job):
    rows = chat_job["rows"]
    capitals = [rows[f"capital-{country}"] for country in CAPITALS]
    assert all(row["finish_reason"] == "stop" for row in capitals), capitals
    assert all(row["completion_tokens"] < DEFAULT_MAX_TOKENS for row in capitals), capitals
    right = [c for c, city in CAPITALS.items() if city in rows[f"capital-{c}"]["text"]]
    # Measured: all six right in compiled, eager and float32 runs; a margin for bf16 numerics.
    assert len(right) >= 4, {c: rows[f"capital-{c}"]["text"] for c in CAPITALS}


def test_the_models_chat_template_and_default_system_prompt_are_applied(chat_job, chat_tokenizer):
    rows, lines = chat_job["rows"], chat_job["lines"]

    def template_tokens(messages: list[dict[str, str]]) -> int:
        text = chat_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return len(chat_tokenizer.encode(text, add_special_tokens=False))

    default = lines["capital-Japan"]["messages"]
    assert rows["capital-Japan"]["prompt_tokens"] == template_tokens(default)
    default_system = "You are a helpful AI assistant named SmolLM"
    assert default_system in chat_tokenizer.apply_chat_template(default, tokenize=False)
    # A system prompt of the line's own replaces the default one, not adds to it.
    own = lines["own-system"]["messages"]
    assert rows["own-system"]["prompt_tokens"] == template_tokens(own)
    assert default_system not in chat_tokenizer.apply_chat_template(own, tokenize=False)
    assert rows["own-system"]["prompt_tokens"] < rows["capital-Japan"]["prompt_tokens"]


def test_a_max_tokens_cut_ends_length(chat_job):
    row = chat_job["rows"]["cut"]
    assert (row["status"], row["finish_reason"], row["completion_tokens"]) == ("ok", "length", 5)
    assert row["text"].strip()


def test_constraints_hold_on_a_model_that_would_say_more(chat_job):
    rows = chat_job["rows"]
    person = json.loads(rows["json"]["text"])
    assert set(person) == {"name", "age", "city"}
    assert person["name"] == "Maria" and person["age"] == 34, person
    assert rows["choice"]["text"] in ("positive", "negative", "neutral")
    assert rows["choice"]["text"] == "positive"
    assert rows["regex"]["text"][3] == "-" and len(rows["regex"]["text"]) == 8
    assert [rows[c]["structured_ok"] for c in ("json", "choice", "regex")] == [True, True, True]
    assert "structured 3/3 constrained rows satisfy their constraint" in chat_job["stdout"]


def test_several_samples_at_temperature_one_differ(chat_job):
    row = chat_job["rows"]["samples"]
    texts = [choice["text"] for choice in row["choices"]]
    assert [choice["index"] for choice in row["choices"]] == [0, 1, 2]
    assert all(text.strip() for text in texts)
    assert len(set(texts)) >= 2, texts
    assert row["text"] == texts[0]


def test_log_probabilities_are_real_and_the_greedy_token_is_the_likeliest(chat_job, chat_tokenizer):
    row = chat_job["rows"]["logprobs"]
    tokens = row["logprobs"]
    assert len(tokens) == row["completion_tokens"] > 0
    for token in tokens:
        top = token["top_logprobs"]
        assert len(top) == 5
        assert all(t["logprob"] <= 0 for t in top)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.001
        # Greedy: the chosen token is the top alternative, with the same log probability.
        assert top[0]["token"] == token["token"], token
        assert math.isclose(top[0]["logprob"], token["logprob"], abs_tol=1e-3)
    # The end-of-turn token is generated (and counted) too; the text leaves it out.
    assert tokens[-1]["token"] == chat_tokenizer.eos_token == "<|im_end|>"
    assert "".join(t["token"] for t in tokens[:-1]) == row["text"]
    assert "Tokyo" in row["text"]


def test_the_context_is_sized_to_the_job_not_to_the_models_8k(chat_job):
    rows, lines = chat_job["rows"], chat_job["lines"]
    needed = max(
        row["prompt_tokens"] + lines[cid].get("max_tokens", DEFAULT_MAX_TOKENS)
        for cid, row in rows.items()
        if row["status"] == "ok"
    )
    sized = chat_job["manifest"]["engine"]["max_model_len"]
    assert sized == -(-needed // 64) * 64, (sized, needed)
    assert sized < MODEL_CONTEXT


def test_rows_sharing_a_long_system_prompt_all_run(chat_job, chat_tokenizer):
    rows, lines = chat_job["rows"], chat_job["lines"]
    shared = [cid for cid in rows if cid.startswith("shared-")]
    assert len(shared) == 4
    for cid in shared:
        text = chat_tokenizer.apply_chat_template(
            lines[cid]["messages"], tokenize=False, add_generation_prompt=True
        )
        assert rows[cid]["prompt_tokens"] == len(
            chat_tokenizer.encode(text, add_special_tokens=False)
        )
        assert rows[cid]["status"] == "ok" and rows[cid]["text"].strip()
