"""Block validation (input/validation/columnar.py) stores exactly the rows that line-by-line
validation (tests/support/line_reader.py, the definition of validity) gives, whatever the lines hold;
and for the common line shapes it does decide the lines itself, without the line-by-line path."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from unittest import mock

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchllm.input.files.custom_ids import CustomIds
from batchllm.input.files.lines import iter_lines
from batchllm.input.formats.rows import INPUT_SCHEMA, InputRow
from batchllm.input.formats.schemas import LineError
from batchllm.input.validation import columnar, validate
from batchllm.settings import get_settings
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests

LIMIT = 400

texts = st.one_of(
    st.sampled_from(
        ["hi", " ", "", "\u2003", "\x1c", "a\nb", 'q"uote\\', "null", "ü€😀", "line-3"]
    ),
    st.text(max_size=12),
)
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.sampled_from([0.0, -0.0, 0.5, 1, 1.0, 2.5, 1e300]),
    st.text(max_size=4),
    st.lists(st.text(max_size=3), max_size=2),
    st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text"])}),
)
sampling_names = st.sampled_from(
    [
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "ignore_eos",
        "stop",
        "n",
        "logprobs",
        "top_logprobs",
        "regex",
        "adapter",
        "response_format",
        "bogus",
    ]
)
# Mostly the common shapes with a few common settings, so that groups form.
common_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.sampled_from([1, 16, 64]),
        "temperature": st.sampled_from([0, 0.7]),
        "ignore_eos": st.just(True),
    },
)
sampling = st.one_of(
    common_sampling, common_sampling, st.dictionaries(sampling_names, values, max_size=3)
)
custom_ids = st.one_of(
    st.none(), st.sampled_from(["a", "b", "line-2", "line-3", ""]), st.text(max_size=6), values
)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "robot"]), "content": texts}
        ),
        st.fixed_dictionaries({"role": st.just("user")}, optional={"name": st.just("x")}),
        st.fixed_dictionaries(
            {"role": st.just("user"), "content": st.just([{"type": "text", "text": "hi"}])}
        ),
    ),
    max_size=3,
)


@st.composite
def request_objects(draw) -> object:
    obj: dict = dict(draw(sampling))
    form = draw(st.sampled_from(["prompt", "chat", "openai_chat", "openai_completion", "embed"]))
    if form == "prompt":
        obj["prompt"] = draw(st.one_of(texts, texts, values))
    elif form == "chat":
        obj["messages"] = draw(messages)
    elif form == "embed":
        obj = {"input": draw(st.one_of(texts, st.lists(texts, max_size=2)))}
    else:
        body = {**obj, "model": draw(st.sampled_from(["m", "lora-a"]))}
        if form == "openai_chat":
            body["messages"] = draw(messages)
        else:
            body["prompt"] = draw(texts)
        obj = {
            "method": draw(st.sampled_from(["POST", "GET"])),
            "url": draw(
                st.sampled_from(
                    ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/x"]
                )
            ),
            "body": body,
        }
    custom_id = draw(custom_ids)
    if custom_id is not None:
        obj["custom_id"] = custom_id
    return obj


def encode(obj: object, ascii_only: bool) -> bytes:
    return json.dumps(obj, ensure_ascii=ascii_only).encode()


odd_lines = st.sampled_from(
    [
        b"",
        b"   ",
        b"\x0c",
        b"{",
        b"[1, 2]",
        b'"text"',
        b'{"prompt": "a"} {"prompt": "b"}',
        b'{"prompt": "a", "prompt": "b"}',
        b'{"custom_id": "d", "method": "POST", "url": "/v1/completions", '
        b'"body": {"prompt": "a", "max_tokens": 1, "max_tokens": 2}}',
        b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}',
        b'{"messages": [{"content": "x", "role": "user"}], "seed": 9007199254740993}',
        b'{"prompt": "a", "seed": 2.0}',
        b'{"prompt": "2024-01-01", "stop": "2024-01-01"}',
        b'{"prompt": "a", "max_tokens": NaN}',
        b'{"prompt": "a", "temperature": 1e999}',
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "a\xff"}',
        b'\xef\xbb\xbf{"prompt": "bom"}',
        b'{"prompt": "a"}\r',
        b'{"prompt": "a", "max_tokens": 1.0}',
        b'{"prompt": "a", "max_tokens": "3"}',
        b'{"pr\\u006fmpt": "escaped key"}',
        b'{"prompt": null}',
        b'{"custom_id": null, "prompt": "a"}',
        b'{"prompt": "a", "stop": null}',
        b'{"prompt": "a", "temperature": NaN}',
        b'{"prompt": "a", "temperature": -Infinity}',
        b'{"messages": [null]}',
        b'{"messages": [{"role": "user", "content": "x"}, null]}',
        b'{"messages": [{"role": null, "content": "x"}]}',
        b'{"messages": [{"role": "user", "content": "a\\u007fb\\u0000"}]}',
        b'{"prompt": "' + b"x" * (LIMIT + 5) + b'"}',
    ]
)
line_bytes = st.one_of(
    st.builds(encode, request_objects(), st.booleans()),
    st.builds(encode, request_objects(), st.booleans()),
    odd_lines,
)


def expected_rows(path: Path, adapters: frozenset[str], task: str) -> list[tuple]:
    return [
        (InputRow.from_item(item).stored_values(), item if isinstance(item, LineError) else None)
        for item in read_requests(
            source_of(path),
            max_line_bytes=LIMIT,
            adapters=adapters,
            task=task,
            settings=get_settings(),
        )
    ]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=st.lists(line_bytes, min_size=1, max_size=40),
    task=st.sampled_from(["generate", "generate", "embed"]),
    slow_below=st.sampled_from([1, 64]),
)
def test_block_validation_stores_what_line_validation_gives(lines, task, slow_below):
    adapters = frozenset({"lora-a"})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        with mock.patch.object(columnar, "_SLOW_BELOW", slow_below):
            got = got_rows(path, adapters, task)
        assert got == expected_rows(path, adapters, task)


def test_common_lines_are_decided_by_the_block_not_line_by_line(tmp_path):
    """1,000 OpenAI chat lines with 3 distinct settings, plus a prompt-form group: the
    line-by-line path sees no line, and one representative per group is judged."""
    path = tmp_path / "in.jsonl"
    with path.open("w") as out:
        for i in range(1000):
            body = {
                "model": "m",
                "max_tokens": (16, 32, 64)[i % 3],
                "messages": [{"role": "user", "content": f"question {i} é"}],
            }
            out.write(
                json.dumps(
                    {
                        "custom_id": f"r{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": body,
                    }
                )
                + "\n"
            )
        for i in range(100):
            out.write(json.dumps({"prompt": f"say {i}", "temperature": 0}) + "\n")
    with path.open("rb") as handle:
        lines = list(iter_lines(handle, 1 << 20))
    line_by_line, judged = [], []

    def check_line(line):
        line_by_line.append(line.number)
        return None, None

    def judge(obj, number):
        judged.append(number)
        kind = "chat" if "body" in obj else "prompt"
        return kind, "body" if "body" in obj else "top", "{}"

    checked = columnar.check_block(lines, check_line, judge)
    assert line_by_line == []
    assert judged == [1, 2, 3, 1001]
    assert checked.numbers == list(range(1, 1101))
    assert checked.problems == {}
    rows = pa.table(checked.columns).to_pylist()
    assert rows[4] == {
        "given": "r4",
        "kind": "chat",
        "prompt": None,
        "messages": '[{"role": "user", "content": "question 4 \\u00e9"}]',
        "sampling": "{}",
        "inputs": None,
    }
    assert rows[1000] == {
        "given": None,
        "kind": "prompt",
        "prompt": "say 0",
        "messages": None,
        "sampling": "{}",
        "inputs": None,
    }
    assert got_rows(path) == expected_rows(path, frozenset(), "generate")


def got_rows(path: Path, adapters: frozenset[str] = frozenset(), task: str = "generate"):
    """read_row_chunks' rows, each with its LineError or None, as expected_rows gives them."""
    got = []
    for rows, problems in validate.read_row_chunks(
        source_of(path), max_line_bytes=LIMIT, adapters=adapters, task=task, settings=get_settings()
    ):
        assert rows.schema == INPUT_SCHEMA
        tuples = list(zip(*(column.to_pylist() for column in rows.columns)))
        errors = {problem.line: problem for problem in problems}
        assert len(errors) == len(problems) == sum(row[2] == "invalid" for row in tuples)
        got += [(row, errors.get(row[0])) for row in tuples]
    return got


def test_custom_ids_refuse_a_duplicate_within_and_across_chunks():
    ids = CustomIds()
    try:
        assert ids.add_first(["a", "b"], [1, 2]) == []
        assert ids.add_first(["c", "a", "c", "d"], [3, 4, 5, 6]) == [("a", 4, 1), ("c", 5, 3)]
        assert ids.add_first(["d", "e"], [7, 8]) == [("d", 7, 6)]
    finally:
        ids.close()


def test_the_written_out_spaces_are_every_character_str_isspace_accepts():
    from batchllm.input.validation.columnar import SPACES

    assert "".join(chr(c) for c in range(0x110000) if chr(c).isspace()) == SPACES
