"""OpenAI batch lines for `/v1/responses`: the body becomes a chat request (the row kind
`chat`) whose stored settings say `"endpoint": "responses"`, so the OpenAI export answers it with a
`Response` object (output/responses_body.py).

Mapped: `input` (a string, or a list of messages and function call items), `instructions` (a
system message first), `max_output_tokens`, `temperature`, `top_p`, `text.format` (json_schema
and json_object become structured output), `tools` (Responses' flat function tools) with
`tool_choice` and `parallel_tool_calls`, `reasoning` (kept; the thinking is split off when the
job has a reasoning parser).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from batchllm.input.formats.schemas import ChatMessage
from batchllm.input.formats.structured import ConstraintError, check_schema
from batchllm.input.formats.tools import line_tool_settings
from batchllm.spec import MAX_TOKENS_LIMIT, Float, Int

ENDPOINT = "responses"  # the stored marker, under the settings key "endpoint"

_TEXT_TYPES = ("input_text", "output_text", "text")


class OpenAIResponsesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Float | None = Field(default=None, ge=0)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    user: str | None = None


def responses_request(body: OpenAIResponsesBody) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the chat messages, the settings to store) of a Responses body; ConstraintError naming
    the body field."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        if not body.input.strip():
            raise ConstraintError("body.input", "input is blank")
        messages.append({"role": "user", "content": body.input})
    else:
        messages += _input_items(body.input)
    if not any(m["role"] != "system" for m in messages):
        raise ConstraintError("body.input", "input holds no message")
    settings: dict[str, Any] = {"endpoint": ENDPOINT}
    if body.max_output_tokens is not None:
        settings["max_tokens"] = body.max_output_tokens
    if body.temperature is not None:
        settings["temperature"] = body.temperature
    if body.top_p is not None:
        settings["top_p"] = body.top_p
    constraint = _text_format(body.text)
    if constraint is not False:
        settings["structured"] = constraint
    tools = None
    if body.tools is not None:
        tools = [_chat_tool(tool, f"body.tools.{i}") for i, tool in enumerate(body.tools)]
    tool_settings, enforced = line_tool_settings(
        tools, body.tool_choice, body.parallel_tool_calls, "body."
    )
    settings |= tool_settings
    if enforced is not None:
        if settings.get("structured"):
            raise ConstraintError(
                "body.tool_choice", "a forced tool call and text.format cannot both constrain"
            )
        settings["structured"] = enforced
    if body.reasoning is not None:
        settings["reasoning"] = body.reasoning
        if body.reasoning.get("effort") == "none":
            # No thinking: the template's switch (Qwen3-style), and nothing to split off.
            settings["chat_template_kwargs"] = {"enable_thinking": False}
    return messages, settings


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | bool | None:
    """The constraint text.format asks for; None for plain text (switches the job's off),
    False when the body does not say."""
    if text is None or text.get("format") is None:
        return False
    fmt = text["format"]
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        check_schema(fmt.get("schema"), "body.text.format.schema")
        return {"json": fmt["schema"]}
    raise ConstraintError("body.text.format.type", "expected text, json_object or json_schema")


def _chat_tool(tool: Any, field: str) -> dict[str, Any]:
    """A Responses function tool ({type, name, parameters}) in the chat form templates take."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ConstraintError(f"{field}.type", "only tools of type 'function' are supported")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _input_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        field = f"body.input.{i}"
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "content": text, "tool_call_id": item.get("call_id")})
            continue
        if kind != "message":
            raise ConstraintError(f"{field}.type", f"{kind!r}: expected message or function_call")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in _TEXT_TYPES:
                    raise ConstraintError(
                        f"{field}.content.{j}", "only text content parts are supported"
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        messages.append({"role": item.get("role"), "content": content})
    checked = []
    for i, message in enumerate(messages):
        try:
            checked.append(ChatMessage.model_validate(message).stored())
        except ValueError as exc:
            first = exc.errors()[0] if hasattr(exc, "errors") else None
            where = ".".join(str(p) for p in first["loc"]) if first and first["loc"] else ""
            message_text = first["msg"] if first else str(exc)
            raise ConstraintError(
                f"body.input.{i}" + (f".{where}" if where else ""), message_text
            ) from None
    return checked
