"""Tool calling, /v1/responses lines and reasoning rows without an engine: how lines are checked
and stored, what the engine is asked to parse, and the OpenAI bodies of the new columns
(validated with the official SDK's types). The engine side: tests/engine/
test_reasoning_tools_responses.py."""

from __future__ import annotations

import json

import pytest

from batchllm.engine.outputs import output_spec
from batchllm.engine.protocol import Finished
from batchllm.execution.results import satisfied, with_call_ids
from batchllm.input.parsing.line import parse_line
from batchllm.input.parsing.problems import LineProblem
from batchllm.output.responses_body import chat_message, is_responses, response_body
from batchllm.settings import get_settings

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
ASK = [{"role": "user", "content": "Weather?"}]


def responses(**body) -> dict:
    return {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body}


def chat(**body) -> dict:
    return {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": ASK, **body},
    }


def test_a_named_tool_choice_is_enforced_by_its_parameters_schema():
    request = parse_line(
        {
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        1,
        settings=get_settings(),
    )
    assert request.sampling["structured"] == {"json": CITY}
    assert request.sampling["tool_choice"] == {"name": "get_weather"}
    assert request.sampling["tools"] == TOOLS


def test_required_is_enforced_by_vllms_array_schema_and_auto_by_nothing():
    required = parse_line(
        chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
        1,
        settings=get_settings(),
    )
    schema = required.sampling["structured"]["json"]
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {
        "type": "string",
        "enum": ["get_weather"],
    }
    auto = parse_line({"messages": ASK, "tools": TOOLS}, 2, settings=get_settings())
    assert auto.sampling["tool_choice"] == "auto" and "structured" not in auto.sampling


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (chat(tool_choice="required"), "body.tool_choice"),
        (chat(tools=TOOLS, tool_choice="sometimes"), "body.tool_choice"),
        (chat(tools=[{"type": "retrieval"}]), "body.tools.0.type"),
        (chat(tools=[{"type": "function", "function": {}}]), "body.tools.0.function.name"),
        (
            chat(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
            ),
            "body.tools.0.function.parameters",
        ),
        (
            chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
            "body.tool_choice",
        ),
        ({"messages": [*ASK, {"role": "assistant", "content": None}]}, "messages.1"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
        (responses(input="x", text={"format": {"type": "xml"}}), "body.text.format.type"),
        (responses(input=" "), "body.input"),
        (responses(input="x", max_output_tokens=0), "body.max_output_tokens"),
        (responses(input="x", stream=True), "body.stream"),
        (responses(input=[{"type": "image", "url": "x"}]), "body.input.0.type"),
        (
            responses(input="x", tools=[{"type": "web_search"}]),
            "body.tools.0.type",
        ),
    ],
)
def test_bad_tool_and_responses_values_name_their_field(line, field):
    with pytest.raises(LineProblem) as caught:
        parse_line(line, 1, settings=get_settings())
    assert caught.value.field == field, caught.value.message


def test_a_multi_turn_line_keeps_the_calls_and_the_tool_results_for_the_template():
    request = parse_line(
        chat(
            messages=[
                *ASK,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]
        ),
        1,
        settings=get_settings(),
    )
    assistant, tool = request.messages[1:]
    # Templates render the arguments as an object, as vLLM's server hands them over.
    assert assistant["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Rome"},
    }
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert request.messages[0] == {"role": "user", "content": "Weather?"}  # plain: unchanged


def test_a_responses_line_becomes_a_chat_request_marked_for_a_response_body():
    request = parse_line(
        responses(
            model="m",
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city": "Rome"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            instructions="Be brief.",
            max_output_tokens=30,
            temperature=0.5,
            text={"format": {"type": "json_schema", "name": "c", "schema": CITY}},
            reasoning={"effort": "none"},
        ),
        1,
        settings=get_settings(),
    )
    assert request.kind == "chat"
    assert [m["role"] for m in request.messages] == ["system", "user", "assistant", "tool"]
    assert request.messages[1]["content"] == "Weather?"
    assert request.sampling["endpoint"] == "responses"
    assert (request.sampling["max_tokens"], request.sampling["temperature"]) == (30, 0.5)
    assert request.sampling["structured"] == {"json": CITY}
    assert request.sampling["chat_template_kwargs"] == {"enable_thinking": False}
    assert is_responses(json.dumps(request.sampling))


def test_the_engine_is_asked_to_parse_only_what_a_row_needs():
    assert output_spec({"max_tokens": 5}) is None
    assert output_spec({"reasoning_parser": "deepseek_r1"})["reasoning_parser"] == "deepseek_r1"
    off = {"reasoning_parser": "deepseek_r1", "chat_template_kwargs": {"enable_thinking": False}}
    assert output_spec(off) is None
    auto = output_spec({"tools": TOOLS, "tool_choice": "auto", "tool_call_parser": "hermes"})
    assert (auto["tool_choice"], auto["tool_call_parser"]) == ("auto", "hermes")
    named = output_spec({"tools": TOOLS, "tool_choice": {"name": "f"}, "tool_call_parser": "x"})
    assert named["tool_call_parser"] is None  # enforced, not parsed
    assert output_spec({"tools": TOOLS, "tool_choice": "none"}) is None


def test_structured_ok_checks_the_text_the_constraint_ran_over():
    finished = Finished("r1", "answer", "stop", 3, 9, raw_text="<think>hm</think>answer")
    assert satisfied({"regex": r"<think>[a-z]+</think>[a-z]+"}, finished) is True
    assert satisfied({"regex": "[a-z]+"}, finished) is False


def test_tool_call_ids_are_stable_per_row_and_call():
    calls = [{"name": "f", "arguments": "{}", "arguments_valid": True}] * 2
    first, second = with_call_ids("row-7", calls)
    assert first["id"].startswith("call_") and first["id"] != second["id"]
    assert with_call_ids("row-7", calls) == [first, second]


ROW = {
    "line": 1,
    "text": "",
    "finish_reason": "tool_calls",
    "prompt_tokens": 10,
    "completion_tokens": 12,
    "reasoning": "the user wants weather",
    "reasoning_tokens": 5,
    "tool_calls": [
        {"id": "call_a", "name": "get_weather", "arguments": '{"city"', "arguments_valid": False}
    ],
}


def test_a_chat_message_carries_reasoning_content_and_tool_calls():
    from openai.types.chat import ChatCompletionMessage

    message = ChatCompletionMessage.model_validate(chat_message(ROW))
    assert message.content is None
    assert message.model_extra["reasoning_content"] == "the user wants weather"
    assert message.tool_calls[0].function.arguments == '{"city"'  # kept as text, flagged


def test_a_response_body_parses_with_the_openai_sdk():
    from openai.types.responses import Response

    settings = json.dumps({"endpoint": "responses", "tools": TOOLS, "max_tokens": 12})
    row = {**ROW, "finish_reason": "length", "settings": settings}
    response = Response.model_validate(response_body(row, "m", 1700000000, lambda p: p + "x"))
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[1].call_id == "call_a"
    assert response.tools[0].name == "get_weather"
    assert response.usage.output_tokens_details.reasoning_tokens == 5
    assert response.max_output_tokens == 12

    answered = {
        **ROW,
        "tool_calls": None,
        "reasoning": None,
        "reasoning_tokens": None,
        "text": "Sunny.",
        "finish_reason": "stop",
    }
    plain = Response.model_validate(response_body(answered, "m", 1, lambda p: p + "y"))
    assert (plain.status, plain.output_text) == ("completed", "Sunny.")
