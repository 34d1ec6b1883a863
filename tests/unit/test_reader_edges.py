"""Input edge cases: BOMs, default ids that a file also gives, booleans and huge numbers in
sampling fields, over-long lines, pathological JSON."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
from pydantic import ValidationError

from batchllm.input.formats.schemas import LineError, Request
from batchllm.input.shards import iter_shard_rows, store_input
from batchllm.settings import get_settings
from batchllm.spec import MAX_TOKENS_LIMIT, JobSpec, SamplingDefaults
from batchllm.storage import Storage
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests


def write(path: Path, lines: list[str | dict | bytes], *, prefix: bytes = b"") -> Path:
    body = b"".join(
        (
            json.dumps(line).encode()
            if isinstance(line, dict)
            else line
            if isinstance(line, bytes)
            else line.encode()
        )
        + b"\n"
        for line in lines
    )
    path.write_bytes(prefix + body)
    return path


def read(tmp_path: Path, lines: list[str | dict | bytes], **kwargs) -> list[Request | LineError]:
    return list(
        read_requests(
            source_of(write(tmp_path / "in.jsonl", lines)), **kwargs, settings=get_settings()
        )
    )


def summary(items: list[Request | LineError]) -> list[tuple[str, int, str]]:
    return [(type(i).__name__, i.line, i.custom_id) for i in items]


# -- byte order mark ------------------------------------------------------------------------------


def test_a_utf8_bom_before_the_first_line_is_ignored(tmp_path):
    path = write(tmp_path / "bom.jsonl", [{"prompt": "a"}, {"prompt": "b"}], prefix=b"\xef\xbb\xbf")

    items = list(read_requests(source_of(path), settings=get_settings()))

    assert [(type(i).__name__, i.line, i.prompt) for i in items] == [
        ("Request", 1, "a"),
        ("Request", 2, "b"),
    ]


def test_a_bom_on_a_later_line_is_still_an_error(tmp_path):
    items = read(tmp_path, [{"prompt": "a"}, b"\xef\xbb\xbf" + b'{"prompt": "b"}'])

    assert summary(items) == [("Request", 1, "line-1"), ("LineError", 2, "line-2")]
    assert "malformed JSON" in items[1].message


def test_a_file_holding_only_a_bom_and_blank_lines_has_no_rows(tmp_path):
    path = tmp_path / "bom-only.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\n  \n")

    assert list(read_requests(source_of(path), settings=get_settings())) == []


# -- default ids never clash with given ids ------------------------------------------------------


def test_a_later_given_id_equal_to_a_default_moves_the_default_aside(tmp_path):
    items = read(
        tmp_path, [{"prompt": "a"}, {"prompt": "b"}, {"custom_id": "line-2", "prompt": "c"}]
    )

    assert summary(items) == [
        ("Request", 1, "line-1"),
        ("Request", 2, "line-2-2"),
        ("Request", 3, "line-2"),
    ]


def test_an_earlier_given_id_equal_to_a_default_moves_the_default_aside(tmp_path):
    items = read(
        tmp_path,
        [
            {"custom_id": "line-3", "prompt": "a"},
            {"prompt": "b"},
            {"messages": [{"role": "user", "content": "c"}]},
        ],
    )

    assert summary(items) == [
        ("Request", 1, "line-3"),
        ("Request", 2, "line-2"),
        ("Request", 3, "line-3-2"),
    ]


def test_a_default_skips_every_given_alternative_including_escaped_and_invalid_lines(tmp_path):
    lines = [
        {"prompt": "a"},
        {"custom_id": "line-1", "prompt": "b"},
        '{"custom_id": "line\\u002d1-2", "prompt": "c"}',  # the same id behind an escape
        {"custom_id": "line-1-3", "prompt": ""},
    ]  # an invalid line's id is still taken

    first, second = read(tmp_path, lines), read(tmp_path, lines)

    assert summary(first) == [
        ("Request", 1, "line-1-4"),
        ("Request", 2, "line-1"),
        ("Request", 3, "line-1-2"),
        ("LineError", 4, "line-1-3"),
    ]
    assert summary(second) == summary(first)


def test_an_error_row_without_an_id_gets_the_moved_default_too(tmp_path):
    items = read(tmp_path, ["{broken", {"custom_id": "line-1", "prompt": "b"}])

    assert summary(items) == [("LineError", 1, "line-1-2"), ("Request", 2, "line-1")]


def test_given_ids_that_repeat_are_still_duplicates(tmp_path):
    items = read(
        tmp_path, [{"custom_id": "line-9", "prompt": "a"}, {"custom_id": "line-9", "prompt": "b"}]
    )

    assert summary(items) == [("Request", 1, "line-9"), ("LineError", 2, "line-9")]
    assert "first on line 1" in items[1].message


@pytest.mark.parametrize("path", ["rows", "lines"])
def test_a_file_whose_lines_all_give_ids_is_read_once_and_one_needing_a_default_twice(
    tmp_path, monkeypatch, path
):
    """The first pass (the given ids of the default shape) runs only for a default: a 10M-line
    file stores no shard before it ends. Both validation paths: stored rows and read_requests."""
    from batchllm.input.files.source import InputSource

    opened: list[str] = []
    real_open = InputSource.open

    def counting_open(source):
        opened.append(str(source))
        return real_open(source)

    monkeypatch.setattr(InputSource, "open", counting_open)

    def ids_of(lines: list[dict]) -> list[str]:
        source = write(tmp_path / "in.jsonl", lines)
        if path == "lines":
            return [
                item.custom_id for item in read_requests(source_of(source), settings=get_settings())
            ]
        storage = Storage(str(tmp_path / f"store-{len(opened)}"))
        stored = store_input(
            source_of(source), storage, "job_x", shard_size=10, settings=get_settings()
        )
        return [r.custom_id for r in iter_shard_rows(storage, stored.shards[0].path)]

    given = [{"custom_id": f"line-{n}", "prompt": "a"} for n in (3, 1)]
    assert ids_of(given) == ["line-3", "line-1"]
    assert len(opened) == 1
    opened.clear()
    # The default of line 3 is given by line 1, which the validation passed before it asked.
    assert ids_of([*given, {"prompt": "b"}]) == ["line-3", "line-1", "line-3-2"]
    assert len(opened) == 2


def test_moved_defaults_reach_the_stored_input_rows(tmp_path):
    source = write(tmp_path / "in.jsonl", [{"prompt": "a"}, {"custom_id": "line-1", "prompt": "b"}])
    storage = Storage(str(tmp_path / "store"))

    stored = store_input(
        source_of(source), storage, "job_x", shard_size=10, settings=get_settings()
    )

    rows = list(iter_shard_rows(storage, stored.shards[0].path))
    assert [(r.line, r.custom_id, r.kind) for r in rows] == [
        (1, "line-1-2", "prompt"),
        (2, "line-1", "prompt"),
    ]


# -- numbers in sampling fields ------------------------------------------------------------------

NUMBER_FIELDS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
MESSAGES = [{"role": "user", "content": "hi"}]


def in_every_form(field: str, value) -> list[tuple[dict, str]]:
    """The line in each of the four forms with `field` set, and the field name its error has."""
    return [
        ({"prompt": "p", field: value}, field),
        ({"messages": MESSAGES, field: value}, field),
        (
            {
                "custom_id": "c",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "p", field: value},
            },
            f"body.{field}",
        ),
        (
            {
                "custom_id": "c",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": MESSAGES, field: value},
            },
            f"body.{field}",
        ),
    ]


@pytest.mark.parametrize("field", NUMBER_FIELDS + ["max_completion_tokens"])
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_in_a_number_field_is_an_error_naming_the_field(tmp_path, field, value):
    cases = in_every_form(field, value)
    if field == "max_completion_tokens":
        cases = cases[-1:]  # only the OpenAI chat body has it

    items = read(tmp_path, [line for line, _ in cases])

    assert [(type(i).__name__, i.field) for i in items] == [
        ("LineError", name) for _, name in cases
    ]
    assert all("not true/false" in i.message for i in items)


def test_ignore_eos_still_takes_a_boolean(tmp_path):
    (item,) = read(tmp_path, [{"prompt": "p", "ignore_eos": True}])

    assert item.sampling == {"ignore_eos": True}


def test_max_tokens_above_the_bound_is_an_error_naming_the_field(tmp_path):
    cases = in_every_form("max_tokens", 10**9)
    over_completion = {
        "custom_id": "d",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": MESSAGES, "max_completion_tokens": 10**9},
    }

    items = read(tmp_path, [line for line, _ in cases] + [over_completion])

    assert [(type(i).__name__, i.field) for i in items] == [
        ("LineError", name) for _, name in cases
    ] + [("LineError", "body.max_completion_tokens")]
    assert all(f"less than or equal to {MAX_TOKENS_LIMIT}" in i.message for i in items)


def test_max_tokens_at_the_bound_is_accepted(tmp_path):
    (item,) = read(tmp_path, [{"prompt": "p", "max_tokens": MAX_TOKENS_LIMIT}])

    assert item.sampling == {"max_tokens": MAX_TOKENS_LIMIT}


@pytest.mark.parametrize(
    "sampling",
    [
        {"max_tokens": True},
        {"temperature": False},
        {"top_p": True},
        {"max_tokens": MAX_TOKENS_LIMIT + 1},
    ],
)
def test_job_defaults_refuse_booleans_and_an_unbounded_max_tokens(sampling):
    with pytest.raises(ValidationError) as caught:
        JobSpec(model="m", sampling=SamplingDefaults(**sampling))

    (error,) = caught.value.errors()
    assert error["loc"] == (next(iter(sampling)),)


# -- pathological JSON ---------------------------------------------------------------------------


def test_deeply_nested_json_is_an_error_row_not_a_crash(tmp_path):
    items = read(tmp_path, ["[" * 100_000, {"prompt": "after"}])

    assert summary(items) == [("LineError", 1, "line-1"), ("Request", 2, "line-2")]
    assert items[0].message == "malformed JSON: nested too deeply"


def test_an_integer_of_ten_thousand_digits_is_an_error_row(tmp_path):
    items = read(tmp_path, ['{"prompt": "p", "seed": 1' + "0" * 10_000 + "}"])

    assert summary(items) == [("LineError", 1, "line-1")]
    assert items[0].message.startswith("malformed JSON: Exceeds the limit")


# -- over-long lines -----------------------------------------------------------------------------


def test_a_line_over_the_limit_is_an_error_row_and_later_lines_still_parse(tmp_path):
    long_line = json.dumps({"custom_id": "big", "prompt": "x" * 200})
    exact = json.dumps({"prompt": "y" * 80})
    items = read(
        tmp_path,
        [{"prompt": "before"}, long_line, exact, {"custom_id": "z", "prompt": "after"}],
        max_line_bytes=len(exact),
    )

    assert summary(items) == [
        ("Request", 1, "line-1"),
        ("LineError", 2, "line-2"),
        ("Request", 3, "line-3"),
        ("Request", 4, "z"),
    ]
    assert items[1].message == (
        f"line is {len(long_line):,} bytes, over the limit of "
        f"{len(exact):,} (BATCHLLM_MAX_LINE_BYTES)"
    )


def test_the_line_limit_comes_from_batchllm_max_line_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLLM_MAX_LINE_BYTES", "50")
    get_settings.cache_clear()
    try:
        items = read(tmp_path, [{"prompt": "short"}, {"prompt": "z" * 60}])
    finally:
        get_settings.cache_clear()

    assert summary(items) == [("Request", 1, "line-1"), ("LineError", 2, "line-2")]
    assert "over the limit of 50 (BATCHLLM_MAX_LINE_BYTES)" in items[1].message


def test_a_huge_line_is_skipped_without_being_held_in_memory(tmp_path):
    # The file is read 4 MB at a time (lines.iter_line_chunks): memory is a few chunks,
    # whatever the length of a line.
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as out:
        out.write(b'{"prompt": "' + b"x" * (64 * 1024 * 1024) + b'"}\n{"prompt": "next"}')

    tracemalloc.start()
    try:
        items = list(read_requests(source_of(path), max_line_bytes=1024, settings=get_settings()))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert summary(items) == [("LineError", 1, "line-1"), ("Request", 2, "line-2")]
    assert items[0].message.startswith(f"line is {64 * 1024 * 1024 + 14:,} bytes")
    assert peak < 16 * 1024 * 1024
