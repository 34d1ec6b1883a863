"""The fields of OpenAI's request bodies that batchllm's line models do not hold, taken off a
body before it is validated: a client that writes them as OpenAI's schema allows (`"stream":
false` in every line, `user`, `store`, `metadata`, ...) gets its lines run, not refused as
unknown parameters (issue 64).

Each such field is one of:
- of no effect here (NO_EFFECT): accepted whatever its value, and dropped (docs/batch-api.md
  lists them);
- honoured under batchllm's name: chat's legacy `functions` and `function_call` become `tools`
  and `tool_choice`;
- asking for what a batch line cannot give (ONLY_EMPTY): refused with an error row naming the
  field when it asks for it (`stream: true`, audio output, a web search, ...);
  absent, null, false, empty or the one neutral value, it changes nothing and is dropped.
A field in none of these keeps the models' clear refusal of an unknown parameter.
tests/unit/test_openai_fields.py derives each endpoint's fields from the installed `openai`
package's request types, so a field OpenAI adds shows up as a failing test.
"""

from __future__ import annotations

from typing import Any

from batchllm.input.parsing.problems import LineProblem

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_RESPONSES = "/v1/responses"

# Settings of OpenAI's service (storage, caching, tiers, moderation, identifiers for its abuse
# monitoring, a reasoning model's effort and verbosity, predicted outputs, streaming options of
# an unstreamed answer): nothing to do for them in a batch on vLLM.
NO_EFFECT: dict[str, frozenset[str]] = {
    _CHAT: frozenset(
        {
            "user",
            "store",
            "metadata",
            "service_tier",
            "prompt_cache_key",
            "prompt_cache_options",
            "prompt_cache_retention",
            "safety_identifier",
            "verbosity",
            "reasoning_effort",
            "moderation",
            "prediction",
            "stream_options",
        }
    ),
    _COMPLETIONS: frozenset({"user", "stream_options"}),
    _RESPONSES: frozenset(
        {
            "service_tier",
            "safety_identifier",
            "prompt_cache_key",
            "prompt_cache_options",
            "prompt_cache_retention",
            "stream_options",
            "include",
            "truncation",
            "max_tool_calls",
            "moderation",
            "context_management",
            "access_programs",
            "background",  # a batch line is answered in the background anyway
            "background_options",
        }
    ),
}

_NOT_STREAMED = "a batch line's answer is written whole, never streamed: give false or leave it out"
_NO_AUDIO = "audio output is not produced here (text only)"
_NO_SEARCH = "no web search runs here"
_STATELESS = "a batch line is answered on its own: no stored conversation or response to continue"

# Field -> (its neutral values, why any other is refused).
ONLY_EMPTY: dict[str, dict[str, tuple[tuple[Any, ...], str]]] = {
    _CHAT: {
        "stream": ((False,), _NOT_STREAMED),
        "audio": ((), _NO_AUDIO),
        "web_search_options": ((), _NO_SEARCH),
        "modalities": (([], ["text"]), _NO_AUDIO),
    },
    _COMPLETIONS: {
        "stream": ((False,), _NOT_STREAMED),
        "echo": ((False,), "echo (the prompt in the answer) is not produced here"),
        "suffix": (("",), "suffix (text after the insertion) is not supported here"),
        "best_of": ((1,), "best_of is not supported here: ask n samples instead"),
    },
    _RESPONSES: {
        "stream": ((False,), _NOT_STREAMED),
        "conversation": ((), _STATELESS),
        "previous_response_id": ((), _STATELESS),
        "prompt": ((), "stored prompt templates are OpenAI's: give `input` (and `instructions`)"),
        "image": ((), "image generation options: no image is generated here"),
        "top_logprobs": ((), "top_logprobs is not returned for /v1/responses lines here"),
    },
}


def without_openai_extras(url: str, body: dict[str, Any], prefix: str = "body.") -> dict[str, Any]:
    """`body` without the OpenAI fields its endpoint's model does not hold (a copy, when there
    are any): dropped where they change nothing, chat's `functions`/`function_call` as
    `tools`/`tool_choice`; LineProblem naming the field where one asks for what a batch line
    cannot give."""
    no_effect = NO_EFFECT.get(url, frozenset())
    only_empty = ONLY_EMPTY.get(url, {})
    legacy = url == _CHAT and ("functions" in body or "function_call" in body)
    if not legacy and not any(name in body for name in (*no_effect, *only_empty)):
        return body  # the common line: nothing to take off
    body = dict(body)
    for name in no_effect:
        body.pop(name, None)
    for name, (neutral, why) in only_empty.items():
        if name in body:
            value = body.pop(name)
            if value is not None and not any(
                value == n and type(value) is type(n) for n in neutral
            ):
                raise LineProblem(prefix + name, f"{name}: {why}")
    if legacy:
        _functions_as_tools(body, prefix)
    return body


def _functions_as_tools(body: dict[str, Any], prefix: str) -> None:
    """Chat's deprecated `functions` and `function_call`, as the `tools` and `tool_choice` they
    were replaced by (OpenAI answers them with `function_call`; batchllm with `tool_calls`)."""
    functions = body.pop("functions", None)
    call = body.pop("function_call", None)
    if functions is not None:
        if "tools" in body:
            raise LineProblem(prefix + "functions", "give tools or functions, not both")
        if not isinstance(functions, list):
            raise LineProblem(prefix + "functions", "functions must be a list of functions")
        body["tools"] = [{"type": "function", "function": f} for f in functions]
    if call is not None:
        if "tool_choice" in body:
            raise LineProblem(
                prefix + "function_call", "give tool_choice or function_call, not both"
            )
        if isinstance(call, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": call.get("name")}}
        else:
            body["tool_choice"] = call  # "none" or "auto", as tool_choice takes them
