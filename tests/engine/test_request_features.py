"""Structured output, log probabilities, n and chat template options on the real vLLM engine.

One `batchllm run` (in this process, on the session's engine for these options, which
test_run_real_vllm.py's jobs share) over one mixed file in every line form, with
`--compact-json` (a JSON constraint then stops on the random-weight demo model instead of
spending max_tokens on whitespace) and a custom `--chat-template`; the tests read its Parquet
output, manifest and `batchllm status --json`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchllm.output.parts import MANIFEST_NAME, OUTPUT_SCHEMA, SUCCESS_NAME
from tests.support.ran_jobs import run_and_read

# The module fixture runs `batchllm run`; it builds the shared engine when it is the first.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MAX_TOKENS = 8

CHOICES = ["yes", "no", "maybe"]
REGEX = r"[0-9]{3}-[a-z]{2}"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["cat", "dog"]}},
    "required": ["ok", "label"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA}}
# Renders unlike the model's own template (bracketed roles, an optional persona), so every chat
# row's prompt_tokens tells which template and which template options it ran with.
TEMPLATE = (
    "{{ bos_token }}{% if persona is defined %}({{ persona }}) {% endif %}"
    "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
ASK = [{"role": "user", "content": "Is the sky blue?"}]
# The demo model's token "x" (checked by the test): a +100 logit_bias makes every token it.
FORCED_TOKEN, FORCED_TEXT = 90, "x"


def oai_chat(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": ASK, **body},
    }


def oai_completion(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": "Is the sky blue?", **body},
    }


def in_every_form(name: str, **fields) -> list[dict]:
    """The same request as a prompt line, a chat line and both OpenAI batch lines."""
    return [
        {"custom_id": f"{name}-prompt", "prompt": "Is the sky blue?", **fields},
        {"custom_id": f"{name}-chat", "messages": ASK, **fields},
        oai_chat(f"{name}-oai-chat", **fields),
        oai_completion(f"{name}-oai-completion", **fields),
    ]


LINES: list[dict] = [
    *in_every_form("choice", choice=CHOICES),
    *in_every_form("regex", regex=REGEX),
    # JSON schema: response_format in the chat and OpenAI forms, `json` in the prompt form.
    {
        "custom_id": "json-chat",
        "messages": ASK,
        "response_format": RESPONSE_FORMAT,
        "max_tokens": 60,
    },
    oai_chat("json-oai-chat", response_format=RESPONSE_FORMAT, max_completion_tokens=60),
    oai_completion("json-oai-completion", response_format=RESPONSE_FORMAT, max_tokens=60),
    {"custom_id": "json-prompt", "prompt": "An animal:", "json": SCHEMA, "max_tokens": 60},
    {"custom_id": "json-cut", "prompt": "An animal:", "json": SCHEMA, "max_tokens": 3},
    {
        "custom_id": "json-object",
        "messages": ASK,
        "response_format": {"type": "json_object"},
        "max_tokens": 30,
    },
    {"custom_id": "grammar-ok", "prompt": "Yes or no?", "grammar": 'root ::= "yes" | "no"'},
    # Log probabilities: K alternatives per generated token.
    {
        "custom_id": "lp-chat",
        "messages": ASK,
        "logprobs": True,
        "top_logprobs": 3,
        "max_tokens": 5,
        "ignore_eos": True,
    },
    oai_chat(
        "lp-oai-chat", logprobs=True, top_logprobs=2, max_completion_tokens=4, ignore_eos=True
    ),
    {
        "custom_id": "lp-prompt",
        "prompt": "hello",
        "logprobs": 2,
        "max_tokens": 4,
        "ignore_eos": True,
    },
    oai_completion("lp-oai-completion", logprobs=4, max_tokens=3, ignore_eos=True),
    {
        "custom_id": "lp-zero",
        "messages": ASK,
        "logprobs": True,
        "max_tokens": 3,
        "ignore_eos": True,
    },
    # n samples.
    {"custom_id": "n3-prompt", "prompt": "Once upon", "n": 3, "temperature": 1.0, "max_tokens": 6},
    oai_chat(
        "n3-oai-chat",
        n=3,
        temperature=1.0,
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=4,
    ),
    {"custom_id": "n3-choice", "prompt": "Pick:", "n": 3, "temperature": 1.0, "choice": CHOICES},
    # Chat template options.
    {
        "custom_id": "tmpl-continue",
        "messages": [*ASK, {"role": "assistant", "content": "Sure,"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 4,
    },
    {
        "custom_id": "tmpl-kwargs",
        "messages": ASK,
        "chat_template_kwargs": {"persona": "pirate"},
        "max_tokens": 4,
    },
    oai_chat("tmpl-no-generation-prompt", add_generation_prompt=False, max_completion_tokens=4),
    {"custom_id": "plain", "prompt": "A plain prompt", "max_tokens": 5},
    # OpenAI's logit_bias (vLLM's SamplingParams.logit_bias): +100 on one token forces it.
    oai_chat("bias-oai-chat", logit_bias={str(FORCED_TOKEN): 100}, max_tokens=4, ignore_eos=True),
    oai_completion(
        "bias-oai-completion", logit_bias={str(FORCED_TOKEN): 100}, max_tokens=4, ignore_eos=True
    ),
    # Bad values: error rows naming the field.
    {"custom_id": "bad-schema", "prompt": "x", "json": {"type": "nonsense"}},
    oai_chat(
        "bad-rf-schema",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": 5}},
        },
    ),
    {"custom_id": "bad-regex", "prompt": "x", "regex": "([a-"},
    {"custom_id": "bad-top", "messages": ASK, "logprobs": True, "top_logprobs": 50},
    oai_chat("bad-top-oai", logprobs=True, top_logprobs=50),
    {"custom_id": "bad-n", "prompt": "x", "n": 0},
    oai_completion("bad-n-oai", n=0),
    {"custom_id": "bad-n-max", "prompt": "x", "n": 17},
    {"custom_id": "bad-grammar", "prompt": "x", "grammar": "root ::= 'a' | "},
    {"custom_id": "bad-clash", "prompt": "x", "choice": ["a"], "regex": "a"},
    oai_chat("bad-bias-oov", logit_bias={"999999": 5}),
]

# custom_id -> the field its error names (the vLLM refusal of a grammar says so too).
ERRORS = {
    "bad-schema": ("json", "invalid JSON schema"),
    "bad-rf-schema": ("body.response_format.json_schema.schema", "invalid JSON schema"),
    "bad-regex": ("regex", "regex does not compile"),
    "bad-top": ("top_logprobs", "less than or equal to 20"),
    "bad-top-oai": ("body.top_logprobs", "less than or equal to 20"),
    "bad-n": ("n", "greater than or equal to 1"),
    "bad-n-oai": ("body.n", "greater than or equal to 1"),
    "bad-n-max": ("n", "n is 17; at most 16 samples (BATCHLLM_MAX_N)"),
    "bad-grammar": ("grammar", "rejected by vLLM: "),
    "bad-clash": ("regex", "only one constraint per request"),
    "bad-bias-oov": ("logit_bias", "out-of-vocab"),
}
# custom_id -> K alternatives per token, for the rows that ask for log probabilities.
LOGPROBS = {
    "lp-chat": 3,
    "lp-oai-chat": 2,
    "lp-prompt": 2,
    "lp-oai-completion": 4,
    "lp-zero": 0,
    "n3-oai-chat": 2,
}
JSON_ROWS = ["json-chat", "json-oai-chat", "json-oai-completion", "json-prompt"]


def body_of(line: dict) -> dict:
    return line.get("body", line)


@pytest.fixture(scope="module")
def features(tiny_model, run_here, tmp_path_factory):
    """The mixed file run once by `batchllm run`, then `batchllm status --json`."""
    work = tmp_path_factory.mktemp("features")
    source = work / "features.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    template = work / "template.jinja"
    template.write_text(TEMPLATE)
    home = work / "home"

    read = run_and_read(
        run_here,
        str(source),
        *("--model", str(tiny_model)),
        *("--max-tokens", str(DEFAULT_MAX_TOKENS), "--temperature", "0"),
        *("--max-model-len", "512", "--enforce-eager"),
        "--compact-json",
        *("--chat-template", str(template)),
        home=home,
    )
    return {
        **read,
        "out_dir": read["job"]["output_dir"],
        "lines": {line["custom_id"]: line for line in LINES},
    }


# -- the output as a whole ----------------------------------------------------------------------


def test_exactly_one_row_per_line_in_a_version_2_output(features):
    table, out_dir = features["table"], features["out_dir"]

    assert table.num_rows == len(LINES)
    assert sorted(table.column("line").to_pylist()) == list(range(1, len(LINES) + 1))
    assert set(features["rows"]) == {line["custom_id"] for line in LINES}
    parts = [p for p in Path(out_dir).iterdir() if p.name.startswith("part-")]
    assert parts
    for part in parts:
        schema = pq.read_schema(part)
        assert schema.metadata[b"batchllm.schema_version"] == b"5"
        assert schema.names == OUTPUT_SCHEMA.names
    manifest = json.loads((Path(out_dir) / MANIFEST_NAME).read_text())
    assert manifest["schema_version"] == 5
    assert manifest["columns"] == OUTPUT_SCHEMA.names
    assert (Path(out_dir) / SUCCESS_NAME).is_file()
    assert manifest["engine"]["compact_json"] is True
    assert manifest["chat_template"] == TEMPLATE


def test_bad_values_are_error_rows_naming_the_field(features):
    rows = features["rows"]

    errors = {k: r["error"] for k, r in rows.items() if r["status"] == "error"}

    assert set(errors) == set(ERRORS)
    for custom_id, (field, message) in ERRORS.items():
        error = errors[custom_id]
        assert error.startswith(f"field '{field}': "), (custom_id, error)
        assert message in error, (custom_id, error)
        assert rows[custom_id]["text"] is None
        assert rows[custom_id]["structured_ok"] is None
    # vLLM refused the grammar after it was tokenized; the others never reached the engine.
    assert rows["bad-grammar"]["prompt_tokens"] > 0
    assert rows["bad-schema"]["prompt_tokens"] is None


def test_the_job_counts_constrained_rows_and_every_sample_token(features):
    job, rows, run = features["job"], features["rows"], features["run"]
    ok = [r for r in rows.values() if r["status"] == "ok"]
    constrained = [r for r in rows.values() if r["structured_ok"] is not None]
    valid = sum(1 for r in constrained if r["structured_ok"])

    assert job["status"] == "completed"
    assert job["request_counts"] == {
        "total": len(LINES),
        "completed": len(LINES) - len(ERRORS),
        "failed": len(ERRORS),
    }
    assert job["structured"] == {"rows": len(constrained), "valid": valid}
    # choice x4, regex x4, json x5 (json-cut included), json-object, n3-choice; grammar: null
    assert len(constrained) == 15
    assert f"structured {valid}/{len(constrained)} constrained rows satisfy" in run.stdout
    generated = sum(
        sum(c["completion_tokens"] for c in r["choices"])
        if r["choices"]
        else r["completion_tokens"]
        for r in ok
    )
    assert job["throughput"]["completion_tokens"] == generated
    assert generated > sum(r["completion_tokens"] for r in ok)  # the n=3 rows count 3 samples
    manifest = json.loads((Path(features["out_dir"]) / MANIFEST_NAME).read_text())
    assert manifest["structured"] == job["structured"]
    assert manifest["tokens"]["completion"] == generated


def test_duckdb_reads_the_new_columns(features):
    duckdb = pytest.importorskip("duckdb")
    out_dir, rows = features["out_dir"], features["rows"]

    ((total, constrained, valid, most_choices, lp_tokens),) = duckdb.sql(
        "SELECT count(*), count(structured_ok), count(*) FILTER (WHERE structured_ok), "
        "max(len(choices)), sum(len(logprobs)) "
        f"FROM '{out_dir}/*.parquet'"
    ).fetchall()
    (n3,) = duckdb.sql(
        f"SELECT choices[1].text = text FROM '{out_dir}/*.parquet' WHERE custom_id = 'n3-prompt'"
    ).fetchall()

    assert (total, constrained, valid) == (
        len(LINES),
        features["job"]["structured"]["rows"],
        features["job"]["structured"]["valid"],
    )
    assert most_choices == 3
    assert lp_tokens == sum(len(r["logprobs"]) for r in rows.values() if r["logprobs"])
    assert n3 == (True,)


# -- constraints --------------------------------------------------------------------------------


def test_choice_rows_answer_one_of_the_choices_in_every_form(features):
    rows = features["rows"]

    for form in ("prompt", "chat", "oai-chat", "oai-completion"):
        row = rows[f"choice-{form}"]
        assert row["status"] == "ok", row
        assert row["text"] in CHOICES, row
        assert row["finish_reason"] == "stop", row
        assert row["structured_ok"] is True


def test_regex_rows_fully_match_in_every_form(features):
    rows = features["rows"]

    for form in ("prompt", "chat", "oai-chat", "oai-completion"):
        row = rows[f"regex-{form}"]
        assert row["status"] == "ok", row
        assert re.fullmatch(REGEX, row["text"]), row
        assert row["finish_reason"] == "stop", row
        assert row["structured_ok"] is True


def test_json_rows_that_stop_validate_against_their_schema(features):
    import jsonschema

    rows = features["rows"]
    stopped = [rows[k] for k in JSON_ROWS if rows[k]["finish_reason"] == "stop"]

    assert all(rows[k]["status"] == "ok" for k in JSON_ROWS)
    assert stopped, [rows[k]["text"] for k in JSON_ROWS]
    for row in stopped:
        document = json.loads(row["text"])
        jsonschema.validate(document, SCHEMA)
        assert row["structured_ok"] is True
        assert " " not in row["text"]  # --compact-json: no whitespace between tokens
    for key in JSON_ROWS:
        if rows[key]["finish_reason"] != "stop":
            assert rows[key]["finish_reason"] == "length"
            assert rows[key]["structured_ok"] is False


def test_a_json_row_cut_by_max_tokens_is_ok_but_does_not_satisfy_its_schema(features):
    row = features["rows"]["json-cut"]

    assert (row["status"], row["finish_reason"], row["completion_tokens"]) == ("ok", "length", 3)
    assert row["structured_ok"] is False
    assert row["error"] is None
    with pytest.raises(ValueError):
        json.loads(row["text"])


def test_a_json_object_row_is_satisfied_exactly_when_it_is_an_object(features):
    row = features["rows"]["json-object"]

    assert row["status"] == "ok"
    try:
        is_object = isinstance(json.loads(row["text"]), dict)
    except ValueError:
        is_object = False
    assert row["structured_ok"] is is_object
    if row["finish_reason"] == "stop":
        assert is_object, row["text"]


def test_a_grammar_row_follows_it_but_has_no_checker(features):
    row = features["rows"]["grammar-ok"]

    assert row["status"] == "ok", row
    assert row["text"] in ("yes", "no"), row
    assert row["structured_ok"] is None


def test_a_logit_bias_of_100_makes_every_generated_token_the_biased_one(features, tokenizer):
    assert tokenizer.convert_ids_to_tokens(FORCED_TOKEN) == FORCED_TEXT
    for custom_id in ("bias-oai-chat", "bias-oai-completion"):
        row = features["rows"][custom_id]
        assert row["status"] == "ok", row
        assert (row["text"], row["completion_tokens"]) == (FORCED_TEXT * 4, 4)
    # The same request without the bias answers otherwise (greedy on random weights).
    assert features["rows"]["plain"]["text"] != FORCED_TEXT * 5


def test_rows_without_new_features_have_null_new_columns(features):
    row = features["rows"]["plain"]

    assert row["status"] == "ok"
    assert (row["structured_ok"], row["logprobs"], row["choices"]) == (None, None, None)
    assert features["rows"]["choice-prompt"]["logprobs"] is None


# -- log probabilities --------------------------------------------------------------------------


def check_logprobs(entries: list[dict], text: str, tokens: int, k: int, *, greedy: bool) -> None:
    assert len(entries) == tokens
    # Greedy rows here decode to whole characters; a token holding part of a UTF-8 character
    # (sampled rows may end on one) decodes alone as "".
    if greedy and "\ufffd" not in text:
        assert "".join(e["token"] for e in entries) == text
    for entry in entries:
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == k, entry
        values = [a["logprob"] for a in alternatives]
        assert values == sorted(values, reverse=True), entry
        assert all(v <= 0 for v in values)
        assert entry["logprob"] <= 0
        if k and greedy:  # the sampled token is the likeliest one
            assert entry["logprob"] == pytest.approx(values[0], abs=1e-4)
            likeliest = {a["token"] for a in alternatives if a["logprob"] == values[0]}
            assert entry["token"] in likeliest, entry


def test_logprobs_give_one_entry_per_token_with_k_sorted_alternatives(features):
    rows, lines = features["rows"], features["lines"]

    for custom_id, k in LOGPROBS.items():
        if custom_id.startswith("n3"):
            continue
        row = rows[custom_id]
        body = body_of(lines[custom_id])
        wanted = body.get("max_completion_tokens") or body["max_tokens"]
        assert row["status"] == "ok", row
        assert row["completion_tokens"] == wanted  # ignore_eos
        check_logprobs(row["logprobs"], row["text"], wanted, k, greedy=True)
    assert all(e["top_logprobs"] == [] for e in rows["lp-zero"]["logprobs"])


# -- n samples ----------------------------------------------------------------------------------


def test_n3_rows_hold_three_samples_the_first_also_in_the_row(features):
    rows = features["rows"]

    for custom_id in ("n3-prompt", "n3-oai-chat", "n3-choice"):
        row = rows[custom_id]
        choices = row["choices"]
        assert row["status"] == "ok", row
        assert [c["index"] for c in choices] == [0, 1, 2]
        first = choices[0]
        assert row["text"] == first["text"]
        assert row["finish_reason"] == first["finish_reason"]
        assert row["completion_tokens"] == first["completion_tokens"]
        assert row["logprobs"] == first["logprobs"]
        for choice in choices:
            assert choice["finish_reason"] in ("stop", "length")
            assert 0 < choice["completion_tokens"] <= DEFAULT_MAX_TOKENS
    for choice in rows["n3-oai-chat"]["choices"]:
        check_logprobs(
            choice["logprobs"], choice["text"], choice["completion_tokens"], 2, greedy=False
        )
    assert all(c["text"] in CHOICES for c in rows["n3-choice"]["choices"])
    assert rows["n3-choice"]["structured_ok"] is True
    assert all(c["logprobs"] is None for c in rows["n3-prompt"]["choices"])
    # Three samples at temperature 1 from a random model: not all the same.
    assert len({c["text"] for c in rows["n3-prompt"]["choices"]}) > 1


# -- the chat template and its options ----------------------------------------------------------


def rendered_tokens(tokenizer, line: dict, template: str | None) -> int:
    body = body_of(line)
    continue_final = bool(body.get("continue_final_message"))
    extra = dict(body.get("chat_template_kwargs") or {})
    if template is not None:
        extra["chat_template"] = template
    text = tokenizer.apply_chat_template(
        body["messages"],
        tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", not continue_final),
        continue_final_message=continue_final,
        **extra,
    )
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_rows_ran_through_the_jobs_template_with_their_options(features, tokenizer):
    rows, lines = features["rows"], features["lines"]
    checked = 0

    for custom_id, row in rows.items():
        line = lines[custom_id]
        if row["status"] != "ok":
            continue
        if "messages" not in body_of(line):
            assert row["prompt_tokens"] == len(tokenizer.encode(body_of(line)["prompt"]))
            continue
        assert row["prompt_tokens"] == rendered_tokens(tokenizer, line, TEMPLATE), custom_id
        assert row["prompt_tokens"] != rendered_tokens(tokenizer, line, None), custom_id
        checked += 1

    assert checked >= 12
    persona = rows["tmpl-kwargs"]["prompt_tokens"]
    assert persona > rows["choice-chat"]["prompt_tokens"]  # same messages, plus "(pirate) "
    # No generation prompt: the same messages render shorter.
    assert rows["tmpl-no-generation-prompt"]["prompt_tokens"] < rows["choice-chat"]["prompt_tokens"]


def test_continue_final_message_ends_the_prompt_inside_the_assistant_message(features, tokenizer):
    line = features["lines"]["tmpl-continue"]
    row = features["rows"]["tmpl-continue"]
    text = tokenizer.apply_chat_template(
        line["messages"],
        chat_template=TEMPLATE,
        tokenize=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    closed = tokenizer.apply_chat_template(
        line["messages"], chat_template=TEMPLATE, tokenize=False, add_generation_prompt=False
    )

    assert text.endswith("[assistant] Sure,")
    assert closed == text + "\n"
    assert row["status"] == "ok"
    assert row["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
    assert row["prompt_tokens"] < len(tokenizer.encode(closed, add_special_tokens=False))
    assert row["completion_tokens"] >= 1
