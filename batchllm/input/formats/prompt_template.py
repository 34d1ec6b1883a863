"""Prompt templates: each row's prompt built from its named fields (`--prompt-template`).

The syntax is Python's `str.format` with named fields only: `Question: {question}` puts the
row's `question` in; `{{` and `}}` are literal braces. No positional fields (`{}`, `{0}`), no
attribute or index access (`{a.b}`, `{a[0]}`), no conversions or format specs (`{a!r}`,
`{a:>10}`): a template only places text, so what a field may do stays obvious, and a
template read from a pipeline file cannot reach into Python objects. Chosen over Jinja: one
line of prompt rarely needs loops or conditions, and `str.format` fields are what every
Python user already writes.

Fields are a table's columns, a JSONL line's own keys, or a parent job's output columns
(`--from`). A field's text is the value itself for text, its JSON for numbers, booleans,
lists and objects (an embedding, tool_calls). Rendering is column-wise (pyarrow), a record
batch at a time: no Python string per row for text fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from batchllm.spec import TEMPLATE_FLAG, template_pieces

FLAG = TEMPLATE_FLAG


@dataclass(frozen=True, slots=True)
class PromptTemplate:
    """A parsed template: literal texts around fields, `pieces[i]` = (literal, field or None)."""

    text: str
    pieces: tuple[tuple[str, str | None], ...]

    @classmethod
    def parse(cls, text: str) -> PromptTemplate:
        """InputError naming the flag and the field for a template this module does not take."""
        return cls(text, template_pieces(text))

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields it names, in order, each once."""
        return tuple(dict.fromkeys(f for _, f in self.pieces if f is not None))

    def render(self, columns: dict[str, pa.Array]) -> pa.Array:
        """Each row's prompt from its fields' columns (one per field, of equal length); null
        where a field is null (the caller names the field: `missing`)."""
        texts = {field: field_text(columns[field]) for field in self.fields}
        parts: list[pa.Array | str] = []
        for literal, field in self.pieces:
            if literal:
                parts.append(literal)
            if field is not None:
                parts.append(texts[field])
        return pc.binary_join_element_wise(*parts, "")

    def missing(self, columns: dict[str, pa.Array]) -> dict[str, pa.Array]:
        """Per field, a boolean mask of the rows where it is null."""
        return {field: pc.is_null(columns[field]) for field in self.fields}


def field_text(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A field's values as text: strings as they are, anything else as its JSON."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return pc.cast(column, pa.string())
    if pa.types.is_dictionary(kind):
        return field_text(column.dictionary_decode())
    if pa.types.is_null(kind):
        return pa.nulls(len(column), pa.string())
    return pa.array(
        [None if value is None else json.dumps(value, default=str) for value in column.to_pylist()],
        pa.string(),
    )
