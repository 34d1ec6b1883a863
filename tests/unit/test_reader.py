"""Input validation: every non-blank line becomes one Request or one LineError naming its line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchllm.errors import InputError
from batchllm.input.formats.rows import InputRow
from batchllm.input.formats.schemas import LineError, Request
from batchllm.input.shards import iter_shard_rows, store_input
from batchllm.settings import get_settings
from batchllm.storage import Storage
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests


def write_lines(path: Path, lines: list[str | dict | bytes]) -> Path:
    """Write one line per item: dicts as JSON, str as is, bytes raw (for broken encodings)."""
    with path.open("wb") as out:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            if isinstance(line, str):
                line = line.encode("utf-8")
            out.write(line + b"\n")
    return path


def read_all(tmp_path: Path, lines: list[str | dict | bytes]) -> list[Request | LineError]:
    return list(
        read_requests(source_of(write_lines(tmp_path / "in.jsonl", lines)), settings=get_settings())
    )


def only_error(tmp_path: Path, line: str | dict | bytes) -> LineError:
    (item,) = read_all(tmp_path, [line])
    assert isinstance(item, LineError), item
    return item


def chat_line(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
    }


# -- the three forms --------------------------------------------------------------------------


def test_prompt_line_becomes_a_prompt_request_with_default_custom_id_and_overrides(tmp_path):
    (req,) = read_all(
        tmp_path,
        [{"prompt": "Tell me a story", "max_tokens": 12, "temperature": 0.5, "stop": ["\n"]}],
    )

    assert req == Request(
        line=1,
        custom_id="line-1",
        kind="prompt",
        prompt="Tell me a story",
        sampling={"max_tokens": 12, "temperature": 0.5, "stop": ["\n"]},
    )


def test_prompt_line_keeps_its_own_custom_id(tmp_path):
    (req,) = read_all(tmp_path, [{"custom_id": "story-7", "prompt": "Once"}])

    assert req.custom_id == "story-7"
    assert req.sampling == {}


def test_messages_line_becomes_a_chat_request_with_text_parts_joined(tmp_path):
    line = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}],
            },
        ],
        "top_p": 0.9,
    }

    (req,) = read_all(tmp_path, ["", line])

    assert req.line == 2
    assert req.custom_id == "line-2"
    assert req.kind == "chat"
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    assert req.sampling == {"top_p": 0.9}
    assert req.prompt is None


def test_openai_chat_line_maps_max_completion_tokens_to_max_tokens(tmp_path):
    (req,) = read_all(tmp_path, [chat_line("oa-1", max_completion_tokens=33, temperature=0.0)])

    assert req.custom_id == "oa-1"
    assert req.kind == "chat"
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert req.sampling == {"max_tokens": 33, "temperature": 0.0}


def test_openai_chat_line_prefers_max_completion_tokens_over_max_tokens(tmp_path):
    (req,) = read_all(tmp_path, [chat_line("oa-2", max_tokens=5, max_completion_tokens=9)])

    assert req.sampling["max_tokens"] == 9


def test_openai_completion_line_becomes_a_prompt_request(tmp_path):
    line = {
        "custom_id": "c-1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "Complete this", "max_tokens": 4, "seed": 3},
    }

    (req,) = read_all(tmp_path, [line])

    assert req == Request(
        line=1,
        custom_id="c-1",
        kind="prompt",
        prompt="Complete this",
        sampling={"max_tokens": 4, "seed": 3},
    )


# -- bad lines ----------------------------------------------------------------------------------


def test_malformed_json_is_an_error_naming_its_line(tmp_path):
    items = read_all(tmp_path, [{"prompt": "ok"}, '{"prompt": "cut off'])

    assert isinstance(items[0], Request)
    err = items[1]
    assert isinstance(err, LineError)
    assert (err.line, err.custom_id, err.field) == (2, "line-2", None)
    assert "malformed JSON" in err.message
    assert str(err).startswith(f"{tmp_path / 'in.jsonl'}:2: ")


def test_non_utf8_bytes_are_an_error_naming_the_byte_offset(tmp_path):
    err = only_error(tmp_path, b'{"prompt": "caf\xe9"}')

    assert err.line == 1
    assert "not valid UTF-8" in err.message
    assert "byte 15" in err.message


def test_object_of_no_known_form_is_an_error(tmp_path):
    err = only_error(tmp_path, {"text": "no form here"})

    assert err.line == 1
    assert err.field is None
    assert "unknown line form" in err.message


@pytest.mark.parametrize("value", ["", "   \t  "])
def test_empty_or_blank_prompt_is_an_error_on_the_prompt_field(tmp_path, value):
    err = only_error(tmp_path, {"custom_id": "p", "prompt": value})

    assert (err.line, err.custom_id, err.field) == (1, "p", "prompt")


def test_empty_messages_list_is_an_error_on_the_messages_field(tmp_path):
    err = only_error(tmp_path, {"messages": []})

    assert err.field == "messages"
    assert "at least 1 item" in err.message


def test_duplicate_custom_id_becomes_an_error_row_naming_the_first_line(tmp_path):
    items = read_all(
        tmp_path,
        [
            {"custom_id": "a", "prompt": "one"},
            {"custom_id": "b", "prompt": "two"},
            "",
            {"custom_id": "a", "prompt": "three"},
        ],
    )

    assert [type(i).__name__ for i in items] == ["Request", "Request", "LineError"]
    err = items[2]
    assert (err.line, err.custom_id, err.field) == (4, "a", "custom_id")
    assert "first on line 1" in err.message


def test_extra_field_in_openai_body_is_an_error_naming_the_body_field(tmp_path):
    err = only_error(tmp_path, chat_line("x-1", logit_biases={"1": 5}))  # not OpenAI's

    assert (err.line, err.custom_id, err.field) == (1, "x-1", "body.logit_biases")
    assert "Extra inputs are not permitted" in err.message


def test_an_openai_field_asking_what_a_line_cannot_give_is_an_error_naming_it(tmp_path):
    err = only_error(tmp_path, chat_line("x-1", stream=True))  # OpenAI's: refused

    assert (err.line, err.custom_id, err.field) == (1, "x-1", "body.stream")
    assert err.message.startswith("stream: a batch line's answer is written whole")


@pytest.mark.parametrize(
    ("url", "told"),
    [
        ("/v1/moderations", "/v1/chat/completions"),  # unsupported: the message names the URLs
        ("/v1/embeddings", "embedding line in a generation job"),
    ],
    ids=["unsupported url", "embedding line in a generation job"],
)
def test_a_url_the_job_does_not_take_is_an_error_on_the_url_field(tmp_path, url, told):
    err = only_error(
        tmp_path, {"custom_id": "e-1", "method": "POST", "url": url, "body": {"input": "x"}}
    )

    assert (err.custom_id, err.field) == ("e-1", "url")
    assert told in err.message


@pytest.mark.parametrize("value", ["[1, 2]", '"just a string"', "42", "null"])
def test_json_that_is_not_an_object_is_an_error(tmp_path, value):
    err = only_error(tmp_path, value)

    assert err.line == 1
    assert "expected a JSON object" in err.message


def test_blank_lines_are_skipped_but_line_numbers_stay_physical(tmp_path):
    items = read_all(tmp_path, ["", {"prompt": "a"}, "   ", "", {"prompt": "b"}, "{bad", "\t"])

    assert [(type(i).__name__, i.line, i.custom_id) for i in items] == [
        ("Request", 2, "line-2"),
        ("Request", 5, "line-5"),
        ("LineError", 6, "line-6"),
    ]


def test_windows_line_endings_are_accepted(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b'{"prompt": "a"}\r\n{"prompt": "b"}\r\n')

    items = list(read_requests(source_of(path), settings=get_settings()))

    assert [(i.line, i.prompt) for i in items] == [(1, "a"), (2, "b")]


# -- storing the input as shards -----------------------------------------------------------------


def stored_rows(storage: Storage, path: str) -> list[InputRow]:
    return list(iter_shard_rows(storage, path))


def test_store_input_keeps_every_line_including_invalid_ones(tmp_path):
    source = write_lines(
        tmp_path / "in.jsonl",
        [
            {"custom_id": "a", "prompt": "one", "max_tokens": 3},
            "not json",
            {"messages": [{"role": "user", "content": "hi"}]},
        ],
    )
    storage = Storage(str(tmp_path / "store"))

    stored = store_input(
        source_of(source), storage, "job_x", shard_size=100, settings=get_settings()
    )

    assert (stored.total, stored.invalid, len(stored.shards)) == (3, 1, 1)
    rows = stored_rows(storage, stored.shards[0].path)
    assert [(r.line, r.custom_id, r.kind) for r in rows] == [
        (1, "a", "prompt"),
        (2, "line-2", "invalid"),
        (3, "line-3", "chat"),
    ]
    assert json.loads(rows[0].sampling) == {"max_tokens": 3}
    assert "malformed JSON" in rows[1].error
    assert json.loads(rows[2].messages) == [{"role": "user", "content": "hi"}]


def test_shards_roll_at_shard_size_with_their_first_and_last_lines(tmp_path):
    lines: list[str | dict] = []
    for i in range(7):
        lines.append({"custom_id": f"r{i}", "prompt": f"prompt {i}"})
        if i == 2:
            lines.append("")  # a blank line shifts later physical line numbers
    source = write_lines(tmp_path / "in.jsonl", lines)
    storage = Storage(str(tmp_path / "store"))

    stored = store_input(source_of(source), storage, "job_x", shard_size=3, settings=get_settings())

    assert [(s.index, s.rows, s.first_line, s.last_line) for s in stored.shards] == [
        (0, 3, 1, 3),
        (1, 3, 5, 7),
        (2, 1, 8, 8),
    ]
    assert storage.listdir(storage.input_dir("job_x")) == [
        "shard-00000.parquet",
        "shard-00001.parquet",
        "shard-00002.parquet",
    ]
    for shard in stored.shards:
        rows = stored_rows(storage, shard.path)
        assert len(rows) == shard.rows
        assert (rows[0].line, rows[-1].line) == (shard.first_line, shard.last_line)
    assert pq.read_metadata(stored.shards[1].path).num_rows == 3


def test_strict_refuses_a_file_with_invalid_lines_and_leaves_no_shard_files(tmp_path):
    source = write_lines(
        tmp_path / "in.jsonl",
        [
            {"prompt": "fine"},
            {"prompt": "fine too"},
            "{oops",
            {"prompt": "more"},
            {"messages": []},
            {"prompt": "last"},
        ],
    )
    storage = Storage(str(tmp_path / "store"))

    with pytest.raises(InputError) as caught:
        store_input(
            source_of(source), storage, "job_x", shard_size=2, strict=True, settings=get_settings()
        )

    message = str(caught.value)
    assert "2 of 6 lines are invalid" in message
    assert f"{source}:3: malformed JSON" in message
    assert f"{source}:5 field 'messages'" in message
    assert storage.listdir(storage.input_dir("job_x")) == []


def test_strict_accepts_a_clean_file(tmp_path):
    source = write_lines(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    storage = Storage(str(tmp_path / "store"))

    stored = store_input(
        source_of(source), storage, "job_x", shard_size=10, strict=True, settings=get_settings()
    )

    assert (stored.total, stored.invalid) == (2, 0)


def store_job_x(source, tmp_path) -> None:
    store_input(
        source_of(source),
        Storage(str(tmp_path / "store")),
        "job_x",
        shard_size=10,
        settings=get_settings(),
    )


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"])
def test_empty_file_raises_input_error_naming_the_file(tmp_path, content):
    source = tmp_path / "empty.jsonl"
    source.write_bytes(content)

    with pytest.raises(InputError, match="no requests") as caught:
        store_job_x(source, tmp_path)

    assert str(source) in str(caught.value)


def test_missing_file_raises_input_error_naming_the_file(tmp_path):
    source = tmp_path / "absent.jsonl"

    with pytest.raises(InputError, match="no such file") as caught:
        store_job_x(source, tmp_path)

    assert str(source) in str(caught.value)
