"""Generated text split into what OpenAI returns apart: the thinking of a reasoning model, the
answer, and tool calls, with vLLM's own parsers (vllm/reasoning, vllm/tool_parsers), through
their non-streaming extract methods, once a request has finished; and the generated tokens' log
probabilities as OpenAI lists them (`token_logprobs`).

What a request needs parsed travels with its SamplingParams (`extra_args`, see `output_spec`),
so the engine knows it when the request finishes. vllm is imported only when a parser is built.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from batchllm.errors import BatchLLMError

log = logging.getLogger(__name__)

EXTRA_KEY = "batchllm_output"  # our entry in SamplingParams.extra_args


class UnknownParser(BatchLLMError):
    """The job names a parser the installed vLLM does not have; its rows are error rows."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class Parsed:
    text: str  # the answer alone
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    # {name, arguments (JSON text), arguments_valid}; ids are given by the runner
    tool_calls: list[dict[str, Any]] | None = None


def output_spec(merged: dict[str, Any]) -> dict[str, Any] | None:
    """What a request's answer needs parsed, from its merged settings; None for plain text."""
    kwargs = merged.get("chat_template_kwargs") or {}
    thinking_off = kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False
    reasoning = None if thinking_off else merged.get("reasoning_parser")
    choice = merged.get("tool_choice")
    tools = merged.get("tools") if choice not in (None, "none") else None
    tool_parser = merged.get("tool_call_parser") if choice == "auto" else None
    if reasoning is None and tools is None:
        return None
    return {
        "reasoning_parser": reasoning,
        "tool_choice": choice if tools else None,
        "tool_call_parser": tool_parser,
        "tools": tools,
    }


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _call(name: str | None, arguments: str) -> dict[str, Any]:
    return {"name": name, "arguments": arguments, "arguments_valid": _valid_json(arguments)}


_PARSER_FIELDS = ("reasoning_parser", "tool_call_parser")  # the spec fields naming a parser


def _registry(field: str) -> tuple[Any, Any]:
    """vLLM's lookup of the parsers a spec field names, and its list of their names (vllm is
    imported here, when a parser is first built)."""
    if field == "reasoning_parser":
        from vllm.reasoning import ReasoningParserManager

        return ReasoningParserManager.get_reasoning_parser, ReasoningParserManager.list_registered
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser, ToolParserManager.list_registered


class OutputParsers:
    """vLLM's reasoning and tool parsers for one tokenizer, built on first use by name."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._built: dict[tuple[str, str], Any] = {}  # (spec field, name) -> parser

    def check(self, spec: dict[str, Any]) -> None:
        """Build the parsers a spec names now; UnknownParser when vLLM has no such parser."""
        for field in _PARSER_FIELDS:
            if spec.get(field):
                self._parser(field, spec[field])

    def _parser(self, field: str, name: str) -> Any:
        """The parser that the spec's `field` (reasoning_parser, tool_call_parser) names."""
        parser = self._built.get((field, name))
        if parser is None:
            get, registered = _registry(field)
            kind = field.replace("_", " ")  # "reasoning parser", "tool call parser"
            try:
                parser = get(name)(self.tokenizer)
            except KeyError:
                known = ", ".join(sorted(registered()))
                raise UnknownParser(
                    field, f"vLLM has no {kind} {name!r}; it has: {known}"
                ) from None
            except Exception as exc:  # e.g. the tokenizer lacks the parser's think tokens
                raise UnknownParser(
                    field, f"{kind} {name!r} does not fit this model: {exc}"
                ) from None
            self._built[(field, name)] = parser
        return parser

    def parse(self, text: str, token_ids: Any, spec: dict[str, Any]) -> Parsed:
        """The answer, thinking and tool calls in a finished request's text."""
        parsed = Parsed(text=text)
        request = _request(spec)
        if spec.get("reasoning_parser"):
            parser = self._parser("reasoning_parser", spec["reasoning_parser"])
            reasoning, content = parser.extract_reasoning(text, request)
            parsed.reasoning = reasoning
            parsed.text = content or ""
            if reasoning is not None:
                counted = int(parser.count_reasoning_tokens(list(token_ids or ())))
                # A model may spell the think tags in pieces rather than as their tokens.
                parsed.reasoning_tokens = counted or len(
                    self.tokenizer.encode(reasoning, add_special_tokens=False)
                )
            else:
                parsed.reasoning_tokens = 0
        choice = spec.get("tool_choice")
        if isinstance(choice, dict):
            # The constraint made the whole answer the named function's arguments.
            parsed.tool_calls = [_call(choice["name"], parsed.text.strip())]
            parsed.text = ""
        elif choice == "required":
            parsed.tool_calls, parsed.text = _required_calls(parsed.text)
        elif choice == "auto" and spec.get("tool_call_parser"):
            parser = self._parser("tool_call_parser", spec["tool_call_parser"])
            extracted = parser.extract_tool_calls(parsed.text, request)
            if extracted.tools_called:
                parsed.tool_calls = [
                    _call(call.function.name, call.function.arguments)
                    for call in extracted.tool_calls
                ]
                parsed.text = extracted.content or ""
        return parsed


def _required_calls(text: str) -> tuple[list[dict[str, Any]] | None, str]:
    """The calls of a `required` answer (a JSON array of {name, parameters}); an answer that
    does not parse (cut by max_tokens) stays text, and structured_ok says it failed."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None, text
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        return None, text
    return [
        _call(c.get("name"), json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls
    ], ""


_REQUESTS: dict[str, Any] = {}


def _request(spec: dict[str, Any]) -> Any:
    """The ChatCompletionRequest vLLM's parsers take (some read its tools or settings); one
    per distinct spec."""
    key = json.dumps(spec, sort_keys=True)
    request = _REQUESTS.get(key)
    if request is None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        data: dict[str, Any] = {"model": "batchllm", "messages": []}
        if spec.get("tools"):
            data["tools"] = spec["tools"]
            choice = spec.get("tool_choice")
            data["tool_choice"] = (
                {"type": "function", "function": {"name": choice["name"]}}
                if isinstance(choice, dict)
                else choice
            )
        try:
            request = ChatCompletionRequest.model_validate(data)
        except Exception:  # a parser that reads nothing of it still works without one
            log.debug("no ChatCompletionRequest for %s", key, exc_info=True)
            request = ChatCompletionRequest.model_validate({"model": "batchllm", "messages": []})
        if len(_REQUESTS) > 1024:
            _REQUESTS.clear()
        _REQUESTS[key] = request
    return request


def token_logprobs(
    token_ids: Any, positions: Any, top_k: int | None
) -> list[dict[str, Any]] | None:
    """One {token, logprob, top_logprobs} per generated token from vLLM's per-position
    {token id: Logprob(logprob, rank, decoded_token)}: the sampled token's entry, and the
    `top_k` likeliest (rank 1..k) as its alternatives, as OpenAI returns them."""
    if top_k is None or positions is None:
        return None
    entries = []
    for token_id, position in zip(token_ids, positions):
        if not position:
            continue
        chosen = position.get(token_id)
        ranked = sorted(
            (lp for lp in position.values() if lp.rank is not None and lp.rank <= top_k),
            key=lambda lp: lp.rank,
        )
        entries.append(
            {
                "token": (chosen.decoded_token if chosen else None) or "",
                "logprob": chosen.logprob if chosen else None,
                "top_logprobs": [
                    {"token": lp.decoded_token or "", "logprob": lp.logprob} for lp in ranked
                ],
            }
        )
    return entries
