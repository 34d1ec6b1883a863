"""Tool calling: a line's `tools` and `tool_choice`, checked up front and turned into what the
engine side needs.

The chat template renders the tools (they are stored with the row's template options). How the
answer becomes tool calls depends on tool_choice, as in vLLM's server:
- "required" or a named function: structured output enforces the call. The constraint is a JSON
  schema over the call, the one vLLM's server builds (tool_parsers/utils.py): for a named
  function its parameters (the answer is the arguments), for "required" an array of
  {name, parameters} objects, one per call.
- "auto": the model decides; the job's --tool-call-parser (vLLM's) reads the calls off the text.
- "none": the tools are rendered, nothing is parsed.
The normalized choice is stored as {"tool_choice": "auto" | "none" | "required" | {"name": N}}.
"""

from __future__ import annotations

from typing import Any

from batchllm.input.formats.structured import ConstraintError, check_schema

TOOL_MODES = ("none", "auto", "required")


def _params_or_empty(params: Any) -> dict[str, Any]:
    # A function without parameters takes an empty object, as vLLM's schema gives it.
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def check_tools(tools: Any, field: str = "tools") -> dict[str, dict[str, Any]]:
    """Each function tool's parameters schema by name; ConstraintError naming the field."""
    if not isinstance(tools, list) or not tools:
        raise ConstraintError(field, "must be a non-empty list of function tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"{field}.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ConstraintError(f"{where}.type", "only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ConstraintError(f"{where}.function", "must be an object with a 'name'")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ConstraintError(f"{where}.function.name", "must be a non-empty string")
        if name in functions:
            raise ConstraintError(f"{where}.function.name", f"tool {name!r} is given twice")
        params = function.get("parameters")
        if params is not None:
            check_schema(params, f"{where}.function.parameters")
        functions[name] = _params_or_empty(params)
    return functions


def tool_choice_of(
    choice: Any, functions: dict[str, dict[str, Any]] | None, field: str = "tool_choice"
) -> str | dict[str, str]:
    """The normalized tool_choice (OpenAI's default: auto with tools, none without)."""
    if choice is None:
        return "auto" if functions else "none"
    if isinstance(choice, str):
        if choice not in TOOL_MODES:
            raise ConstraintError(field, f"{choice!r}: expected none, auto, required or a function")
        if choice != "none" and not functions:
            raise ConstraintError(field, f"tool_choice {choice!r} needs tools")
        return choice
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        # Chat: {"type": "function", "function": {"name"}}; Responses: {"type", "name"}.
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
    if not isinstance(name, str) or not name:
        raise ConstraintError(field, 'expected {"type": "function", "function": {"name": ...}}')
    if not functions or name not in functions:
        raise ConstraintError(field, f"tool {name!r} is not among the line's tools")
    return {"name": name}


def tool_constraint(
    choice: str | dict[str, str],
    functions: dict[str, dict[str, Any]],
    parallel_tool_calls: bool | None = None,
) -> dict[str, Any] | None:
    """The structured output constraint that enforces a call, or None when nothing must."""
    if isinstance(choice, dict):
        return {"json": functions[choice["name"]]}
    if choice != "required":
        return None
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": params,
                    },
                    "required": ["name", "parameters"],
                }
                for name, params in functions.items()
            ],
        },
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return {"json": schema}


def line_tool_settings(
    tools: Any, choice: Any, parallel_tool_calls: bool | None, prefix: str = ""
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(settings to store with the row, the constraint enforcing a call or None) for a line's
    tool fields; ConstraintError naming the field (with `prefix`, e.g. `body.`)."""
    if tools is None and choice is None:
        return {}, None
    functions = check_tools(tools, prefix + "tools") if tools is not None else None
    normalized = tool_choice_of(choice, functions, prefix + "tool_choice")
    settings: dict[str, Any] = {"tool_choice": normalized}
    if functions is None:
        return settings, None
    settings["tools"] = tools
    return settings, tool_constraint(normalized, functions, parallel_tool_calls)
