"""The OpenAI bodies of a row that holds more than text: a `/v1/responses` line's `Response`
object, and the chat message fields of a reasoning model's thinking and of tool calls.

The Response is the shape the official `openai` SDK parses (`openai.types.responses.Response`):
output items for the thinking (`reasoning`), each tool call (`function_call`) and the answer
(`message`), the status `incomplete` for an answer cut by max_output_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

ENDPOINT_MARK = '"endpoint": "responses"'  # in the stored settings text (input/responses.py)


def is_responses(settings: str | None) -> bool:
    """Whether a stored chat row came from a /v1/responses line."""
    return settings is not None and ENDPOINT_MARK in settings


def chat_message(row: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a row: its answer, thinking and tool calls."""
    calls = row.get("tool_calls")
    text = row["text"] or ""
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if row.get("reasoning") is not None:
        message["reasoning_content"] = row["reasoning"]
    if calls:
        message["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for call in calls
        ]
    return message


def completion_details(row: dict[str, Any]) -> dict[str, int] | None:
    """OpenAI's usage.completion_tokens_details, when the row counted reasoning tokens."""
    tokens = row.get("reasoning_tokens")
    return None if tokens is None else {"reasoning_tokens": tokens}


def response_body(
    row: dict[str, Any],
    model: str,
    created: int,
    make_id: Callable[[str], str],
) -> dict[str, Any]:
    """The Response object answering a /v1/responses line."""
    settings = json.loads(row.get("settings") or "{}")
    cut = row["finish_reason"] == "length"
    status = "incomplete" if cut else "completed"
    output: list[dict[str, Any]] = []
    if row.get("reasoning") is not None:
        output.append(
            {
                "id": make_id("rs_"),
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": row["reasoning"]}],
                "status": status,
            }
        )
    calls = row.get("tool_calls") or []
    for i, call in enumerate(calls):
        output.append(
            {
                "id": make_id(f"fc{i}_"),
                "type": "function_call",
                "call_id": call["id"],
                "name": call["name"],
                "arguments": call["arguments"],
                "status": status,
            }
        )
    text = row["text"] or ""
    if text or not calls:
        output.append(
            {
                "id": make_id("msg_"),
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    prompt = row["prompt_tokens"] or 0
    completion = row["completion_tokens"] or 0
    choice = settings.get("tool_choice", "auto")
    return {
        "id": make_id("resp_"),
        "object": "response",
        "created_at": created,
        "completed_at": created,
        "model": model,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "instructions": None,
        "metadata": None,
        "output": output,
        "parallel_tool_calls": settings.get("parallel_tool_calls", True),
        "tool_choice": (
            {"type": "function", "name": choice["name"]} if isinstance(choice, dict) else choice
        ),
        "tools": [_response_tool(tool) for tool in settings.get("tools") or []],
        "temperature": settings.get("temperature"),
        "top_p": settings.get("top_p"),
        "max_output_tokens": settings.get("max_tokens"),
        "reasoning": settings.get("reasoning"),
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": row.get("reasoning_tokens") or 0},
            "total_tokens": prompt + completion,
        },
    }


def _response_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A stored (chat form) function tool in the Responses form."""
    function = tool.get("function", {})
    return {
        "type": "function",
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
        "strict": False,
    }
