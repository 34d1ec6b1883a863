"""Every field of OpenAI's request bodies is taken in a batch line: held by batchllm's model,
of no effect here and dropped, honoured under batchllm's name, or refused with an error row
naming it when it asks for what a batch line cannot give (input/parsing/openai_fields.py;
issue 64). The field lists come from the installed `openai` package's request types: a field
OpenAI adds fails the first test until it is placed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from batchllm.input.parsing.endpoints import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES
from batchllm.input.parsing.line import parse_line
from batchllm.input.parsing.openai_fields import NO_EFFECT, ONLY_EMPTY
from batchllm.input.parsing.problems import LineProblem
from batchllm.input.validation import validate
from batchllm.settings import get_settings
from tests.support.inputs import source_of

# OpenAI's request types: the non-streaming variants carry `stream` too.
OPENAI_TYPES = {
    CHAT_COMPLETIONS: chat_create_params.CompletionCreateParamsNonStreaming,
    COMPLETIONS: completion_create_params.CompletionCreateParamsNonStreaming,
    EMBEDDINGS: embedding_create_params.EmbeddingCreateParams,
    RESPONSES: response_create_params.ResponseCreateParamsNonStreaming,
}
HONOURED_AS = {CHAT_COMPLETIONS: {"functions", "function_call"}}  # as tools, tool_choice


def openai_fields(request_type: type) -> set[str]:
    fields: set[str] = set()
    for cls in request_type.__mro__:
        fields |= set(getattr(cls, "__annotations__", {}))
    return fields


@pytest.mark.parametrize("endpoint", list(OPENAI_TYPES), ids=lambda e: e.url)
def test_every_openai_request_field_has_a_place(endpoint) -> None:
    ours = set(endpoint.body.model_fields)
    no_effect = NO_EFFECT.get(endpoint.url, frozenset())
    only_empty = set(ONLY_EMPTY.get(endpoint.url, {}))
    honoured = HONOURED_AS.get(endpoint, set())
    placed = ours | no_effect | only_empty | honoured
    assert openai_fields(OPENAI_TYPES[endpoint]) - placed == set()
    # Nothing is taken off a body that its model holds itself.
    assert not (no_effect | only_empty | honoured) & ours


def line(url: str, **body: Any) -> dict[str, Any]:
    if url == CHAT_COMPLETIONS.url:
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    elif url == RESPONSES.url:
        body = {"input": "hi", **body}
    else:
        body = {"prompt": "hi", **body}
    return {"custom_id": "c", "method": "POST", "url": url, "body": body}


def parsed(obj: dict[str, Any]):
    return parse_line(obj, 1, settings=get_settings())


SAMPLES: dict[str, Any] = {
    "user": "user-42",
    "store": True,
    "metadata": {"team": "a"},
    "service_tier": "flex",
    "prompt_cache_key": "k",
    "prompt_cache_options": {"x": 1},
    "prompt_cache_retention": "24h",
    "safety_identifier": "s",
    "verbosity": "low",
    "reasoning_effort": "low",
    "moderation": {"mode": "x"},
    "prediction": {"type": "content", "content": "x"},
    "stream_options": {"include_usage": True},
    "include": ["message.output_text.logprobs"],
    "truncation": "auto",
    "max_tool_calls": 3,
    "context_management": [{"type": "compaction"}],
    "access_programs": {"x": 1},
    "background": True,
    "background_options": {"x": 1},
}


@pytest.mark.parametrize(
    "url, name",
    [(url, name) for url, names in NO_EFFECT.items() for name in sorted(names)],
)
def test_a_field_of_no_effect_is_taken_and_changes_nothing(url: str, name: str) -> None:
    plain = parsed(line(url))
    given = parsed(line(url, **{name: SAMPLES[name]}))
    assert (given.kind, given.messages, given.prompt, given.sampling) == (
        plain.kind,
        plain.messages,
        plain.prompt,
        plain.sampling,
    )


REFUSED: dict[str, Any] = {
    "stream": True,
    "audio": {"voice": "alloy", "format": "wav"},
    "web_search_options": {},
    "modalities": ["text", "audio"],
    "echo": True,
    "suffix": "tail",
    "best_of": 3,
    "conversation": "conv_1",
    "previous_response_id": "resp_1",
    "prompt": {"id": "pmpt_1"},
    "image": {"size": "1024x1024"},
    "top_logprobs": 3,
}


@pytest.mark.parametrize(
    "url, name",
    [(url, name) for url, fields in ONLY_EMPTY.items() for name in sorted(fields)],
)
def test_a_field_asking_what_a_batch_line_cannot_give_is_an_error_naming_it(
    url: str, name: str
) -> None:
    with pytest.raises(LineProblem) as caught:
        parsed(line(url, **{name: REFUSED[name]}))
    assert caught.value.field == f"body.{name}"
    assert name in caught.value.message
    # Its neutral values (and null) change nothing: the line runs.
    neutral, _ = ONLY_EMPTY[url][name]
    for value in (None, *neutral):
        assert parsed(line(url, **{name: value})).custom_id == "c"


@pytest.mark.parametrize("url", [CHAT_COMPLETIONS.url, COMPLETIONS.url])
def test_logit_bias_is_kept_with_the_row_and_reaches_the_engine_keyed_by_token_id(url) -> None:
    from batchllm.engine.vllm_engine import sampling_values

    given = parsed(line(url, logit_bias={"50256": -100, "7": 2.5}))
    assert given.sampling == {"logit_bias": {"50256": -100.0, "7": 2.5}}
    # JSON keys are strings; vLLM's SamplingParams.logit_bias is keyed by token id.
    assert sampling_values({**given.sampling, "max_tokens": 4}) == {
        "max_tokens": 4,
        "logit_bias": {50256: -100.0, 7: 2.5},
    }
    assert parsed(line(url, logit_bias={})).sampling == {}  # asks nothing


@pytest.mark.parametrize(
    "bias, message",
    [
        ({"x": 1}, "key 'x' is not a token id"),
        ({"-1": 1}, "key '-1' is not a token id"),
        ({"5": 101}, "the bias of token 5 is 101.0: from -100 to 100"),
        ({"5": -100.5}, "from -100 to 100"),
    ],
)
def test_a_logit_bias_openai_would_refuse_is_an_error_naming_it(bias, message) -> None:
    with pytest.raises(LineProblem) as caught:
        parsed(line(CHAT_COMPLETIONS.url, logit_bias=bias))
    assert caught.value.field == "body.logit_bias"
    assert message in caught.value.message


def embedding_line(**body: Any) -> dict[str, Any]:
    body = {"input": "hi", **body}
    return {"custom_id": "e", "method": "POST", "url": EMBEDDINGS.url, "body": body}


def test_embeddings_take_dimensions_and_float_vectors_and_name_base64_as_unsupported() -> None:
    def embedded(obj: dict[str, Any]):
        return parse_line(obj, 1, task="embed", settings=get_settings())

    assert embedded(embedding_line(dimensions=8)).sampling == {"dimensions": 8}
    plain = embedded(embedding_line())
    for field in ({"encoding_format": "float"}, {"user": "u-1"}):
        assert embedded(embedding_line(**field)).sampling == plain.sampling
    with pytest.raises(LineProblem) as caught:
        embedded(embedding_line(encoding_format="base64"))
    assert caught.value.field == "body.encoding_format"


def test_legacy_functions_run_as_tools() -> None:
    function = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    legacy = parsed(
        line(CHAT_COMPLETIONS.url, functions=[function], function_call={"name": "get_weather"})
    )
    tools = parsed(
        line(
            CHAT_COMPLETIONS.url,
            tools=[{"type": "function", "function": function}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    assert legacy.sampling == tools.sampling and "tools" in json.dumps(legacy.sampling)
    with pytest.raises(LineProblem) as caught:
        parsed(
            line(
                CHAT_COMPLETIONS.url,
                functions=[function],
                tools=[{"type": "function", "function": function}],
            )
        )
    assert caught.value.field == "body.functions"


def test_a_field_openai_does_not_have_is_still_refused_as_unknown() -> None:
    with pytest.raises(LineProblem) as caught:
        parsed(line(CHAT_COMPLETIONS.url, streaming=False))
    assert caught.value.field == "body.streaming"


def test_a_file_of_sdk_written_lines_runs_block_and_line_by_line_alike(tmp_path: Path) -> None:
    """A client writing `"stream": false`, `user` and `store` into every line: every line
    runs (block validation, input/validation/columnar.py), and a `stream: true` line among them is
    that line's error, naming the field."""
    lines = [
        line(CHAT_COMPLETIONS.url, stream=False, user="u", store=False, temperature=0)
        | {"custom_id": f"c{i}"}
        for i in range(200)
    ]
    lines[7] = line(CHAT_COMPLETIONS.url, stream=True) | {"custom_id": "streamed"}
    path = tmp_path / "sdk.jsonl"
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    rows, errors = 0, []
    for chunk, problems in validate.read_row_chunks(
        source_of(path),
        max_line_bytes=1 << 20,
        adapters=frozenset(),
        task="generate",
        settings=get_settings(),
    ):
        rows += chunk.num_rows
        errors += problems
    assert rows == 200
    assert [(e.line, e.custom_id, e.field) for e in errors] == [(8, "streamed", "body.stream")]
