"""Splitting a file a chunk at a time gives iter_lines' lines exactly: numbers, bytes, sizes,
blank lines skipped and over-long lines reported by size, whatever the chunk size."""

from __future__ import annotations

import io

from hypothesis import given, settings
from hypothesis import strategies as st

from batchllm.input.files.lines import iter_line_chunks, iter_lines

pieces = st.one_of(
    st.sampled_from([b"\n", b" ", b"\t", b"\r\n", b"\xef\xbb\xbf", b"{}", b"\x0c"]),
    st.binary(max_size=30),
)


@settings(max_examples=500, deadline=None)
@given(
    content=st.lists(pieces, max_size=30).map(b"".join),
    limit=st.integers(1, 40),
    chunk=st.integers(1, 50),
)
def test_chunks_give_the_lines_iter_lines_gives(content, limit, chunk):
    expected = list(iter_lines(io.BufferedReader(io.BytesIO(content)), limit))
    chunks = list(iter_line_chunks(io.BufferedReader(io.BytesIO(content)), limit, chunk))
    assert [line for lines in chunks for line in lines] == expected
    assert all(chunks)  # no empty chunk is handed on
    # Looking only for lines holding "{": runs of lines without one are skipped, not split.
    wanted = list(
        iter_line_chunks(
            io.BufferedReader(io.BytesIO(content)), limit, chunk, wanted=lambda run: b"{" in run
        )
    )
    found = [line for lines in wanted for line in lines]
    assert set(found) <= set(expected)
    assert [line for line in found if b"{" in (line.raw or b"")] == [
        line for line in expected if b"{" in (line.raw or b"")
    ]


def test_a_long_line_is_counted_not_held():
    content = b'{"a": 1}\n' + b"x" * 10_000 + b"\n   \n" + b" " * 500 + b"\n{}"
    lines = [
        line
        for chunk in iter_line_chunks(io.BufferedReader(io.BytesIO(content)), 100, 64)
        for line in chunk
    ]
    assert [(line.number, line.raw, line.size) for line in lines] == [
        (1, b'{"a": 1}', 8),
        (2, None, 10_000),
        (5, b"{}", 2),
    ]
