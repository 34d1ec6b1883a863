"""The output buffer writes rows as positional tuples (output/parts.py: building an object per
row cost a quarter of the feed's own work); this pins each position to OUTPUT_SCHEMA's column
of the same name, so a column added or moved in the schema cannot shift values silently."""

from __future__ import annotations

import inspect

import pytest

from batchllm.output.parts import OUTPUT_SCHEMA, OutputBuffer

# A parameter named differently from its column.
_COLUMN_OF = {"code": "error_code"}


@pytest.mark.parametrize(
    ("method", "status"), [("answer", "ok"), ("embedding", "ok"), ("failed", "error")]
)
def test_every_value_lands_in_the_column_named_like_its_parameter(method, status):
    buffer = OutputBuffer()
    write = getattr(buffer, method)
    params = [p for p in inspect.signature(write).parameters]
    # A distinct marker per parameter, so a value in the wrong column is seen for what it is.
    markers = {name: f"<{name}>" for name in params}
    write(**markers)
    (row,) = buffer.take()

    assert len(row) == len(OUTPUT_SCHEMA.names)
    placed = dict(zip(OUTPUT_SCHEMA.names, row))
    expected = {name: None for name in OUTPUT_SCHEMA.names}
    expected["status"] = status
    for name, marker in markers.items():
        column = _COLUMN_OF.get(name, name)
        assert column in expected, f"{method}({name}=...) has no column {column!r}"
        expected[column] = marker
    assert placed == expected
