"""Text that cannot be encoded: a JSON string may hold a lone surrogate escape (`"x\\udc00"`),
which `json.loads` accepts and turns into a str that no UTF-8 encoder, tokenizer or Arrow
column takes (measured: tokenizers raise TypeError, `.encode()` UnicodeEncodeError). Such a
line is refused at validation, naming the field, before anything downstream sees it.

Raw UTF-8 cannot hold a surrogate (decoding refuses it), so only a line whose bytes hold a
`\\uD800`-`\\uDFFF` escape can; the walk over the decoded value runs only for those."""

from __future__ import annotations

import re
from typing import Any

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def may_hold_surrogates(raw: bytes) -> bool:
    """Whether a JSON line's bytes hold a surrogate escape (a valid pair does too)."""
    return _SURROGATE_ESCAPE.search(raw) is not None


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unencodable_field(value: Any, prefix: str = "") -> str | None:
    """The dotted path (`body.messages.0.content`) of the first string, or object key, in a
    decoded JSON value that UTF-8 cannot encode; None when there is none."""
    if isinstance(value, str):
        return None if encodable(value) else (prefix or "(the line)")
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if not encodable(key):
                return prefix or "(a key)"
            found = unencodable_field(item, path)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = unencodable_field(item, f"{prefix}.{index}" if prefix else str(index))
            if found is not None:
                return found
    return None


# The error of a line refused for it (the LineError names the field).
UNENCODABLE = (
    "text that is not valid Unicode (a lone surrogate escape such as \\udc00); encode it as "
    "UTF-8 or as a surrogate pair"
)
