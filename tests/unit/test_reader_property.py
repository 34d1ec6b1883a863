"""Whatever bytes a file holds, the reader yields exactly one Request or LineError per non-blank
line, with the right line number, and raises nothing."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchllm.input.formats.schemas import LineError, Request
from batchllm.settings import get_settings
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests

LIMIT = 64  # small, so that generated long lines go over it cheaply
BOM = b"\xef\xbb\xbf"

custom_ids = st.one_of(
    st.none(), st.sampled_from(["a", "b", "line-1", "line-2", "line-2-2", ""]), st.text(max_size=8)
)
sampling = st.dictionaries(
    st.sampled_from(["max_tokens", "temperature", "top_p", "seed", "ignore_eos", "stop", "bogus"]),
    st.one_of(
        st.booleans(),
        st.integers(-5, 2_000_000),
        st.floats(allow_nan=False),
        st.text(max_size=5),
        st.none(),
    ),
    max_size=3,
)


@st.composite
def request_lines(draw) -> bytes:
    obj: dict = dict(draw(sampling))
    form = draw(st.sampled_from(["prompt", "messages", "openai", "other"]))
    content = draw(st.text(max_size=20))
    if form == "prompt":
        obj["prompt"] = content
    elif form == "messages":
        obj["messages"] = [
            {"role": draw(st.sampled_from(["user", "system", "robot"])), "content": content}
        ]
    elif form == "openai":
        obj = {
            "method": "POST",
            "url": draw(st.sampled_from(["/v1/completions", "/v1/x"])),
            "body": {"prompt": content, **obj},
        }
    custom_id = draw(custom_ids)
    if custom_id is not None:
        obj["custom_id"] = custom_id
    return json.dumps(obj, ensure_ascii=draw(st.booleans())).encode()


no_newline = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b""))
lines = st.one_of(
    request_lines(),
    no_newline,  # garbage
    st.sampled_from([b"", b" ", b"\t\r", b"\r", b"\x0b\x0c "]),  # blank
    st.binary(min_size=LIMIT - 2, max_size=3 * LIMIT).map(lambda b: b.replace(b"\n", b"x")),
    st.sampled_from([BOM, BOM + b'{"prompt": "p"}', b"[" * 5000, b"{}", b"null"]),
)


@st.composite
def files(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    body = b"\n".join(draw(st.lists(lines, max_size=12)))
    return (BOM if draw(st.booleans()) else b"") + body + draw(st.sampled_from([b"", b"\n"]))


def physical_lines(data: bytes) -> list[bytes]:
    """The oracle: the file's lines without newlines, the first without a leading BOM."""
    data = data.removeprefix(BOM)
    pieces = data.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()
    return pieces


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files())
def test_every_non_blank_line_yields_exactly_one_row_with_its_line_number(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.jsonl"
        path.write_bytes(data)

        items = list(read_requests(source_of(path), max_line_bytes=LIMIT, settings=get_settings()))

    pieces = physical_lines(data)
    expected = [number for number, piece in enumerate(pieces, start=1) if piece.strip()]
    assert [item.line for item in items] == expected
    assert all(isinstance(item, (Request, LineError)) for item in items)
    for item in items:
        if len(pieces[item.line - 1]) > LIMIT:
            assert isinstance(item, LineError) and "over the limit" in item.message
    accepted = [item.custom_id for item in items if isinstance(item, Request)]
    assert len(accepted) == len(set(accepted))
