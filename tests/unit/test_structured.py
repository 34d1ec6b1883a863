"""Structured output, log probabilities, n and chat template options without an engine: the
constraint forms of input/formats/structured.py, their normalization by the reader in every line
form, the job-level CLI flags, and the runner's structured_ok and structured counters on a fake
engine."""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any

import click
import pytest

from batchllm.cli.options import spec_from_flags
from batchllm.cli.run import run as run_command
from batchllm.engine.protocol import Finished
from batchllm.errors import BatchLLMError
from batchllm.execution.shard_state import sampling_for
from batchllm.input.formats.rows import InputRow
from batchllm.input.formats.schemas import LineError, Request
from batchllm.input.formats.structured import (
    ConstraintError,
    check_choice,
    check_regex,
    check_schema,
    constraint_of,
    field_of,
    from_response_format,
    satisfies,
)
from batchllm.output.parts import MANIFEST_NAME
from batchllm.settings import get_settings
from batchllm.storage import Storage
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus
from tests.support.cli import invoke
from tests.support.fake_runs import FakeEngine, FakeEngines, make_spec, output_rows, small_commits
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["cat", "dog"]}},
    "required": ["ok", "label"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "hi"}]


def json_schema_format(schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "animal", "schema": schema}}


def constraint_error(fields: dict) -> ConstraintError:
    with pytest.raises(ConstraintError) as caught:
        constraint_of(fields)
    return caught.value


# -- structured.py: the forms of a constraint ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"json": SCHEMA}, {"json": SCHEMA}),
        ({"choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"regex": r"[0-9]{3}"}, {"regex": r"[0-9]{3}"}),
        ({"grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        ({"response_format": json_schema_format()}, {"json": SCHEMA}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
        ({"json": None, "choice": None, "regex": None}, None),  # fields left out
    ],
)
def test_every_constraint_form_normalizes_to_one_vllm_field(fields, expected):
    assert constraint_of(fields) == expected


def test_the_field_of_a_stored_constraint_is_its_key():
    assert field_of({"choice": ["a"]}) == "choice"
    assert field_of({"json_object": True}) == "json_object"
    assert field_of(constraint_of({"response_format": json_schema_format()})) == "json"


@pytest.mark.parametrize(
    ("fields", "field", "named"),
    [
        ({"json": SCHEMA, "regex": "a"}, "regex", "json, regex"),
        ({"choice": ["a"], "grammar": "g"}, "grammar", "choice, grammar"),
        (
            {"response_format": json_schema_format(), "json": SCHEMA},
            "json",
            "response_format, json",
        ),
        ({"regex": "a", "grammar": "g", "choice": ["c"]}, "regex", "choice, regex, grammar"),
    ],
)
def test_two_constraints_on_one_request_clash_naming_the_second(fields, field, named):
    error = constraint_error(fields)

    assert error.field == field
    assert error.message == f"only one constraint per request; got {named}"


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"json": {"type": "nonsense"}}, "json", "invalid JSON schema"),
        ({"json": True}, "json", "a JSON schema must be an object"),
        ({"json": ["type", "object"]}, "json", "a JSON schema must be an object"),
        (
            {"response_format": json_schema_format({"type": 5})},
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "needs a 'schema' object",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema.schema",
            "needs a 'schema' object",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"response_format": "json"}, "response_format", "must be an object with a 'type'"),
        ({"response_format": {"kind": "text"}}, "response_format", "with a 'type'"),
        ({"regex": "([a-"}, "regex", "regex does not compile"),
        ({"regex": ""}, "regex", "must be a non-empty string"),
        ({"regex": 5}, "regex", "must be a non-empty string"),
        ({"choice": []}, "choice", "non-empty list of non-empty strings"),
        ({"choice": "yes"}, "choice", "non-empty list of non-empty strings"),
        ({"choice": ["yes", ""]}, "choice", "non-empty list of non-empty strings"),
        ({"choice": ["yes", 1]}, "choice", "non-empty list of non-empty strings"),
        ({"grammar": ""}, "grammar", "non-empty grammar string"),
        ({"grammar": "   "}, "grammar", "non-empty grammar string"),
        ({"grammar": ["root"]}, "grammar", "non-empty grammar string"),
    ],
)
def test_an_unusable_constraint_is_refused_naming_its_field(fields, field, message):
    error = constraint_error(fields)

    assert error.field == field
    assert message in error.message
    assert str(error) == error.message


def test_the_checkers_take_the_field_to_name():
    with pytest.raises(ConstraintError) as caught:
        check_schema({"type": "nonsense"}, "body.json")
    assert caught.value.field == "body.json"
    with pytest.raises(ConstraintError) as caught:
        check_regex("(", "--regex")
    assert caught.value.field == "--regex"
    with pytest.raises(ConstraintError) as caught:
        check_choice([], "--choice")
    assert caught.value.field == "--choice"
    check_schema(SCHEMA, "json")
    check_regex("a+")
    check_choice(["a"])


def test_from_response_format_text_means_no_constraint():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == {"json_object": True}
    assert from_response_format(json_schema_format()) == {"json": SCHEMA}


# -- structured.py: checking generated text -----------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "text", "expected"),
    [
        ({"choice": ["yes", "no"]}, "yes", True),
        ({"choice": ["yes", "no"]}, "no", True),
        ({"choice": ["yes", "no"]}, "maybe", False),
        ({"choice": ["yes", "no"]}, "yes ", False),
        ({"choice": ["yes", "no"]}, "", False),
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, "123-ab", True),
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, "123-abc", False),  # a match, not a full match
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, "x123-ab", False),
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, "123-a", False),  # cut by max_tokens
        ({"grammar": 'root ::= "a"'}, "a", None),  # no grammar checker here
        ({"grammar": 'root ::= "a"'}, "b", None),
        ({"json": SCHEMA}, '{"ok":true,"label":"cat"}', True),
        ({"json": SCHEMA}, ' { "ok" : false , "label" : "dog" }\n', True),
        ({"json": SCHEMA}, '{"ok":true,"label":"cow"}', False),  # not in the enum
        ({"json": SCHEMA}, '{"ok":"yes","label":"cat"}', False),  # not a boolean
        ({"json": SCHEMA}, '{"ok":true}', False),  # a required field missing
        ({"json": SCHEMA}, '{"ok":true,"label":"cat","x":1}', False),
        ({"json": SCHEMA}, '{"ok":true,"lab', False),  # cut mid-way by max_tokens
        ({"json": SCHEMA}, '{"ok": tru', False),
        ({"json": SCHEMA}, "", False),
        ({"json": SCHEMA}, "not json", False),
        ({"json": {}}, "[1, 2]", True),  # the empty schema accepts any document
        ({"json_object": True}, '{"a": [1, {"b": null}]}', True),
        ({"json_object": True}, "[1, 2]", False),
        ({"json_object": True}, '"a string"', False),
        ({"json_object": True}, '{"a": ', False),
    ],
)
def test_satisfies_checks_text_against_each_kind_of_constraint(constraint, text, expected):
    assert satisfies(constraint, text) is expected


def test_satisfies_does_not_mix_up_equal_schemas_written_in_another_key_order():
    reordered = {
        "additionalProperties": False,
        "required": ["ok", "label"],
        "properties": {"label": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
        "type": "object",
    }
    strict = {**SCHEMA, "properties": {**SCHEMA["properties"], "label": {"enum": ["cat"]}}}

    assert satisfies({"json": reordered}, '{"ok":true,"label":"dog"}') is True
    assert satisfies({"json": strict}, '{"ok":true,"label":"dog"}') is False
    assert satisfies({"json": SCHEMA}, '{"ok":true,"label":"dog"}') is True


# -- the reader: normalization in every line form -----------------------------------------------


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def read_all(tmp_path: Path, lines: list[dict]) -> list[Request | LineError]:
    return list(
        read_requests(source_of(write_lines(tmp_path / "in.jsonl", lines)), settings=get_settings())
    )


def openai_chat(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": MESSAGES, **body},
    }


def openai_completion(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "hello", **body},
    }


def one_request(tmp_path: Path, line: dict) -> Request:
    (item,) = read_all(tmp_path, [line])
    assert isinstance(item, Request), item
    return item


def one_error(tmp_path: Path, line: dict) -> LineError:
    (item,) = read_all(tmp_path, [line])
    assert isinstance(item, LineError), item
    return item


def test_constraints_are_stored_normalized_in_every_line_form(tmp_path):
    items = read_all(
        tmp_path,
        [
            {"prompt": "x", "json": SCHEMA},
            {"prompt": "x", "choice": ["yes", "no"]},
            {"messages": MESSAGES, "regex": "[a-z]+"},
            {"messages": MESSAGES, "response_format": json_schema_format()},
            {"messages": MESSAGES, "response_format": {"type": "json_object"}},
            openai_chat("oc", response_format=json_schema_format()),
            openai_chat("oc-g", grammar='root ::= "a"'),
            openai_completion("ocp", choice=["a", "b"]),
            openai_completion("ocp-j", json=SCHEMA),
            {"prompt": "x", "response_format": {"type": "text"}},
            {"prompt": "x"},
        ],
    )

    assert all(isinstance(item, Request) for item in items), items
    assert [item.sampling.get("structured") for item in items] == [
        {"json": SCHEMA},
        {"choice": ["yes", "no"]},
        {"regex": "[a-z]+"},
        {"json": SCHEMA},
        {"json_object": True},
        {"json": SCHEMA},
        {"grammar": 'root ::= "a"'},
        {"choice": ["a", "b"]},
        {"json": SCHEMA},
        None,
        None,
    ]
    assert [item.kind for item in items[5:9]] == ["chat", "chat", "prompt", "prompt"]


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        ({"prompt": "x", "json": {"type": "nonsense"}}, "json", "invalid JSON schema"),
        ({"prompt": "x", "regex": "([a-"}, "regex", "regex does not compile"),
        ({"messages": MESSAGES, "choice": []}, "choice", "non-empty list"),
        ({"messages": MESSAGES, "grammar": ""}, "grammar", "non-empty grammar string"),
        (
            {"messages": MESSAGES, "response_format": json_schema_format({"type": "nonsense"})},
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
        ({"prompt": "x", "choice": ["a"], "regex": "a"}, "regex", "only one constraint"),
        (openai_chat("a", regex="(["), "body.regex", "regex does not compile"),
        (
            openai_chat("b", response_format=json_schema_format({"type": 5})),
            "body.response_format.json_schema.schema",
            "invalid JSON schema",
        ),
        (
            openai_chat("c", response_format={"type": "xml"}),
            "body.response_format.type",
            "expected text, json_object or json_schema",
        ),
        (openai_completion("d", json={"type": "nonsense"}), "body.json", "invalid JSON schema"),
        (
            openai_completion("e", choice=["a"], grammar="g"),
            "body.grammar",
            "only one constraint",
        ),
    ],
)
def test_a_bad_constraint_is_an_error_naming_the_field_with_body_prefix_in_openai_form(
    tmp_path, line, field, message
):
    error = one_error(tmp_path, line)

    assert error.field == field
    assert message in error.message
    assert str(error).startswith(f"{tmp_path / 'in.jsonl'}:1 field '{field}': ")


@pytest.mark.parametrize(
    ("line", "logprobs"),
    [
        ({"prompt": "x", "logprobs": 3}, 3),
        ({"prompt": "x", "logprobs": 0}, 0),
        ({"prompt": "x"}, None),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 4}, 4),
        ({"messages": MESSAGES, "logprobs": True}, 0),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 20}, 20),
        ({"messages": MESSAGES, "logprobs": False}, None),
        ({"messages": MESSAGES}, None),
        (openai_chat("c", logprobs=True, top_logprobs=2), 2),
        (openai_chat("c0", logprobs=True), 0),
        (openai_completion("p", logprobs=5), 5),
    ],
)
def test_logprobs_become_the_number_of_alternatives_in_every_form(tmp_path, line, logprobs):
    request = one_request(tmp_path, line)

    assert request.sampling.get("logprobs") == logprobs
    assert "top_logprobs" not in request.sampling


def test_a_chat_lines_logprobs_false_turns_off_the_jobs_logprobs(tmp_path):
    # `--logprobs 3` is a default that lines override; `"logprobs": false` in the chat forms is
    # such an override, as `top_logprobs` is for the number of alternatives.
    spec = make_spec()
    spec.sampling.logprobs = 3
    items = read_all(
        tmp_path,
        [
            {"messages": MESSAGES, "logprobs": False},
            openai_chat("oc", logprobs=False),
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": 1},
            {"messages": MESSAGES},
        ],
    )

    merged = [sampling_for(spec, InputRow.from_item(item))["logprobs"] for item in items]

    assert merged == [None, None, 1, 3]


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        ({"prompt": "x", "logprobs": True}, "logprobs", "not true/false"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"prompt": "x", "top_logprobs": 2}, "top_logprobs", "Extra inputs"),
        ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
        (
            {"messages": MESSAGES, "logprobs": False, "top_logprobs": 3},
            "top_logprobs",
            "needs logprobs: true",
        ),
        (
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50},
            "top_logprobs",
            "less than or equal to 20",
        ),
        (openai_chat("a", top_logprobs=2), "body.top_logprobs", "needs logprobs: true"),
        (
            openai_chat("b", logprobs=True, top_logprobs=50),
            "body.top_logprobs",
            "less than or equal to 20",
        ),
        (openai_completion("c", logprobs=21), "body.logprobs", "less than or equal to 20"),
        (openai_completion("d", top_logprobs=2), "body.top_logprobs", "Extra inputs"),
    ],
)
def test_bad_logprobs_are_errors_naming_the_field(tmp_path, line, field, message):
    error = one_error(tmp_path, line)

    assert error.field == field
    assert message in error.message


def test_n_is_stored_and_bounded_below_in_every_form(tmp_path):
    items = read_all(
        tmp_path,
        [
            {"prompt": "x", "n": 3},
            {"messages": MESSAGES, "n": 16},
            openai_chat("oc", n=2),
            {"prompt": "x", "n": 0},
            openai_completion("ocp", n=0),
            {"prompt": "x", "n": True},
        ],
    )

    assert [i.sampling["n"] for i in items[:3]] == [3, 16, 2]
    assert [(type(i).__name__, getattr(i, "field", None)) for i in items[3:]] == [
        ("LineError", "n"),
        ("LineError", "body.n"),
        ("LineError", "n"),
    ]


def test_n_over_batchllm_max_n_is_an_error_naming_n(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLLM_MAX_N", "4")
    get_settings.cache_clear()
    try:
        items = read_all(
            tmp_path,
            [
                {"prompt": "x", "n": 4},
                {"prompt": "x", "n": 5},
                {"messages": MESSAGES, "n": 9},
                openai_chat("oc", n=5),
                openai_completion("ocp", n=4),
            ],
        )
    finally:
        get_settings.cache_clear()

    assert [(type(i).__name__, getattr(i, "field", None)) for i in items] == [
        ("Request", None),
        ("LineError", "n"),
        ("LineError", "n"),
        ("LineError", "body.n"),
        ("Request", None),
    ]
    assert items[1].message == "n is 5; at most 4 samples (BATCHLLM_MAX_N)"


def test_n_over_the_default_max_n_of_16_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("BATCHLLM_MAX_N", raising=False)
    get_settings.cache_clear()
    try:
        error = one_error(tmp_path, {"prompt": "x", "n": 17})
    finally:
        get_settings.cache_clear()

    assert (error.field, error.message) == ("n", "n is 17; at most 16 samples (BATCHLLM_MAX_N)")


def test_chat_template_options_are_stored_with_the_row(tmp_path):
    items = read_all(
        tmp_path,
        [
            {
                "messages": [*MESSAGES, {"role": "assistant", "content": "Sure,"}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
            {"messages": MESSAGES, "chat_template_kwargs": {"persona": "pirate", "level": 2}},
            openai_chat("oc", add_generation_prompt=False, chat_template_kwargs={"a": True}),
            {"messages": MESSAGES},
        ],
    )

    assert [i.sampling for i in items] == [
        {"continue_final_message": True, "add_generation_prompt": False},
        {"chat_template_kwargs": {"persona": "pirate", "level": 2}},
        {"add_generation_prompt": False, "chat_template_kwargs": {"a": True}},
        {},
    ]


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        (
            {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
            "cannot both be true",
        ),
        (
            openai_chat("a", continue_final_message=True, add_generation_prompt=True),
            "body.continue_final_message",
            "cannot both be true",
        ),
        ({"prompt": "x", "continue_final_message": True}, "continue_final_message", "Extra"),
        ({"prompt": "x", "chat_template_kwargs": {}}, "chat_template_kwargs", "Extra"),
        ({"messages": MESSAGES, "chat_template_kwargs": [1]}, "chat_template_kwargs", "dict"),
        (
            openai_completion("b", add_generation_prompt=False),
            "body.add_generation_prompt",
            "Extra",
        ),
    ],
)
def test_bad_chat_template_options_are_errors_naming_the_field(tmp_path, line, field, message):
    error = one_error(tmp_path, line)

    assert error.field == field
    assert message in error.message


def test_all_new_settings_of_one_openai_chat_line_are_stored_together(tmp_path):
    request = one_request(
        tmp_path,
        openai_chat(
            "all",
            n=2,
            logprobs=True,
            top_logprobs=3,
            choice=["a", "b"],
            chat_template_kwargs={"x": 1},
            max_completion_tokens=7,
            temperature=0.5,
        ),
    )

    assert request.sampling == {
        "n": 2,
        "logprobs": 3,
        "structured": {"choice": ["a", "b"]},
        "chat_template_kwargs": {"x": 1},
        "max_tokens": 7,
        "temperature": 0.5,
    }


# -- the CLI flags ------------------------------------------------------------------------------


def spec_of(prompts: Path, model_dir: Path, *flags: str):
    """The JobSpec `batchllm run` builds from these flags (parsed by click, no job created)."""
    with run_command.make_context("run", [str(prompts), "--model", str(model_dir), *flags]) as ctx:
        params = dict(ctx.params)
    for name in ("file", "output", "strict"):
        params.pop(name)
    return spec_from_flags(params)


def test_the_flags_become_the_jobs_sampling_engine_and_template(tmp_path, prompts, model_dir):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    plain = spec_of(prompts, model_dir)
    with_schema = spec_of(
        prompts,
        model_dir,
        *("--n", "3", "--logprobs", "5", "--json-schema", str(schema_file)),
        *("--chat-template", str(template), "--compact-json"),
    )
    with_choice = spec_of(prompts, model_dir, "--choice", " yes, no ,maybe,")
    with_regex = spec_of(prompts, model_dir, "--regex", "[0-9]+")

    assert (plain.sampling.n, plain.sampling.logprobs, plain.sampling.structured) == (1, None, None)
    assert (plain.chat_template, plain.engine.compact_json) == (None, False)
    assert with_schema.sampling.n == 3
    assert with_schema.sampling.logprobs == 5
    assert with_schema.sampling.structured == {"json": SCHEMA}
    assert with_schema.chat_template == template.read_text()
    assert with_schema.engine.compact_json is True
    assert with_choice.sampling.structured == {"choice": ["yes", "no", "maybe"]}
    assert with_regex.sampling.structured == {"regex": "[0-9]+"}


def test_run_and_submit_help_list_the_new_flags():
    for command in ("run", "submit"):
        result = invoke(command, "--help")
        assert result.exit_code == 0, result.output
        for flag in (
            "--n",
            "--logprobs",
            "--json-schema",
            "--choice",
            "--regex",
            "--chat-template",
            "--compact-json",
        ):
            assert flag in result.output, (command, flag)


@pytest.mark.parametrize("command", ["run", "submit"])
def test_two_job_constraints_are_a_usage_error(settings, prompts, model_dir, command):
    result = invoke(
        command, str(prompts), "--model", str(model_dir), "--choice", "a,b", *("--regex", "x")
    )

    assert result.exit_code == 2
    assert "Error: give one constraint per job: got --choice and --regex" in result.output
    assert not (settings.home / "batchllm.db").exists() or "no jobs" in invoke("jobs").output


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (json.dumps({"type": "nonsense"}), "Invalid value for --json-schema: invalid JSON schema"),
        ("[1, 2]", "Invalid value for --json-schema: a JSON schema must be an object"),
        ("{not json", "Invalid value for --json-schema: "),
    ],
)
def test_a_bad_schema_file_is_an_error_naming_the_flag(
    settings, tmp_path, prompts, model_dir, content, message
):
    schema_file = tmp_path / "bad.json"
    schema_file.write_text(content)

    result = invoke(
        "run", str(prompts), "--model", str(model_dir), "--json-schema", str(schema_file)
    )

    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_schema_file_holding_null_is_refused_not_ignored(tmp_path, prompts, model_dir):
    # A file the user named as the job's schema must constrain the job or be refused; `null`
    # is no schema, so running the job unconstrained would silently drop the flag.
    schema_file = tmp_path / "null.json"
    schema_file.write_text("null")

    with pytest.raises(click.BadParameter) as caught:
        spec_of(prompts, model_dir, "--json-schema", str(schema_file))

    assert caught.value.param_hint == "--json-schema"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--choice", ","), "Invalid value for --choice: must be a non-empty list"),
        (("--regex", "([a-"), "Invalid value for --regex: regex does not compile"),
        (("--regex", ""), "Invalid value for --regex: must be a non-empty string"),
        (("--logprobs", "21"), "Invalid value for '--logprobs'"),
        (("--n", "0"), "Invalid value for '--n'"),
        (("--n", "17"), "Invalid value for --n: 17 is over BATCHLLM_MAX_N (16)"),
    ],
)
def test_bad_flag_values_are_usage_errors_naming_the_flag(
    settings, prompts, model_dir, monkeypatch, flags, message
):
    monkeypatch.delenv("BATCHLLM_MAX_N", raising=False)
    get_settings.cache_clear()

    result = invoke("run", str(prompts), "--model", str(model_dir), *flags)

    assert result.exit_code == 2, result.output
    assert message in result.output


# -- the runner on a fake engine: structured_ok, rejections, n, counters -----------------------


class AnsweringEngine(FakeEngine):
    """Answers with the last word of the prompt; refuses a grammar as vLLM refuses one it
    cannot compile; gives n samples for n > 1 (the answer first, then `other-<i>`)."""

    def __init__(self) -> None:
        super().__init__()
        self.params_of: dict[str, dict] = {}

    def add(self, request_id: str, token_ids: list[int], params: dict, adapter: Any = None) -> None:
        if "grammar" in (params.get("structured") or {}):
            raise BatchLLMError("Invalid grammar specification: nope")
        self.params_of[request_id] = params
        super().add(request_id, token_ids, params, adapter)

    def step(self) -> list[Finished]:
        done = super().step()
        for out in done:
            out.text = out.text.split()[-1]
            n = self.params_of.pop(out.request_id).get("n") or 1
            if n > 1:
                out.choices = [
                    {
                        "index": i,
                        "text": out.text if i == 0 else f"other-{i}",
                        "finish_reason": "length",
                        "completion_tokens": out.completion_tokens,
                        "logprobs": None,
                    }
                    for i in range(n)
                ]
        return done


def test_structured_ok_comes_from_the_text_and_the_job_counts_constrained_rows(
    small_commits, tmp_path
):
    settings = small_commits
    spec = make_spec()
    spec.sampling.structured = {"choice": ["yes", "no"]}  # the job's --choice yes,no
    lines = [
        {"custom_id": "yes", "prompt": "answer yes"},
        {"custom_id": "no", "prompt": "answer no"},
        {"custom_id": "maybe", "prompt": "answer maybe"},
        {"custom_id": "own-regex", "prompt": "answer 123-ab", "regex": "[0-9]{3}-[a-z]{2}"},
        {"custom_id": "own-choice", "prompt": "answer blue", "choice": ["red", "blue"]},
        {"custom_id": "own-json", "prompt": 'answer {"a":1}', "json": {"type": "object"}},
        openai_completion("oai-no", prompt="answer no"),
        {"custom_id": "n2", "prompt": "answer yes", "n": 2, "max_tokens": 3},
        {"custom_id": "grammar", "prompt": "answer a", "grammar": 'root ::= "a"'},
        {"custom_id": "bad-regex", "prompt": "answer a", "regex": "(["},
    ]
    source = write_lines(tmp_path / "in.jsonl", lines)

    job = run_job_on(AnsweringEngine(), source, spec, settings)

    rows = {r["custom_id"]: r for r in output_rows(settings, job.id)}
    assert job.status is JobStatus.COMPLETED
    assert {k: (r["status"], r["text"], r["structured_ok"]) for k, r in rows.items()} == {
        "yes": ("ok", "yes", True),
        "no": ("ok", "no", True),
        "maybe": ("ok", "maybe", False),
        "own-regex": ("ok", "123-ab", True),  # the line's constraint replaces the job's
        "own-choice": ("ok", "blue", True),
        "own-json": ("ok", '{"a":1}', True),
        "oai-no": ("ok", "no", True),
        "n2": ("ok", "yes", True),
        "grammar": ("error", None, None),
        "bad-regex": ("error", None, None),
    }
    assert rows["grammar"]["error"] == (
        "field 'grammar': rejected by vLLM: Invalid grammar specification: nope"
    )
    assert rows["grammar"]["prompt_tokens"] == 3  # BOS + two words: it was tokenized
    assert rows["bad-regex"]["error"].startswith("field 'regex': regex does not compile")
    assert [c["text"] for c in rows["n2"]["choices"]] == ["yes", "other-1"]
    assert all(r["choices"] is None for k, r in rows.items() if k != "n2")

    ok = [r for r in rows.values() if r["status"] == "ok"]
    constrained = [r for r in rows.values() if r["structured_ok"] is not None]
    assert (job.structured_rows, job.structured_valid) == (8, 7)
    assert job.structured_rows == len(constrained)
    assert job.structured_valid == sum(1 for r in constrained if r["structured_ok"])
    # n=2 counts both samples' tokens.
    assert job.completion_tokens == sum(r["completion_tokens"] for r in ok) + 3

    storage = Storage.of(settings)
    manifest = json.loads(
        storage.read_bytes(posixpath.join(storage.output_dir(job.id), MANIFEST_NAME))
    )
    assert manifest["structured"] == {"rows": 8, "valid": 7}
    assert manifest["schema_version"] == 5
    status = invoke("status", job.id, "--json")
    assert status.exit_code == 0, status.output
    assert json.loads(status.output)["structured"] == {"rows": 8, "valid": 7}
    text = invoke("status", job.id)
    assert "structured 7/8 constrained rows satisfy their constraint" in text.output


def test_a_job_without_constraints_shows_no_structured_line(small_commits, tmp_path):
    settings = small_commits
    source = write_lines(tmp_path / "in.jsonl", [{"prompt": "answer yes"}])

    job = run_job_on(AnsweringEngine(), source, make_spec(), settings)

    assert (job.structured_rows, job.structured_valid) == (0, 0)
    assert [r["structured_ok"] for r in output_rows(settings, job.id)] == [None]
    lines = invoke("status", job.id).output.splitlines()
    assert lines[0] == f"job        {job.id}"
    assert not [line for line in lines if line.startswith("structured")]


def run_job_on(engine: FakeEngine, source: Path, spec, settings) -> Job:
    from batchllm.jobs.local import run_job

    job = run_job(source_of(source, settings), spec, settings=settings, engines=FakeEngines(engine))
    with session_scope(settings) as session:
        return session.get(Job, job.id)
