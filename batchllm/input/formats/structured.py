"""Structured output: the one constraint a request may carry, checked up front and checked
again on the generated text.

Every form of constraint (OpenAI's `response_format`, vLLM-style `choice`/`regex`/`json`/
`grammar` fields, the job's `--json-schema`/`--choice`/`--regex`) becomes one small dict with a
single key, the name of vLLM's StructuredOutputsParams field it maps to:
{"json": schema} | {"json_object": True} | {"choice": [...]} | {"regex": r} | {"grammar": g}.
It is stored with the row's sampling settings, so the constraint a row ran under is
recoverable from the input shard.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

CONSTRAINT_KINDS = ("json", "json_object", "choice", "regex", "grammar")
# The line fields that carry a constraint, in the order they are reported when several clash.
LINE_FIELDS = ("response_format", "json", "choice", "regex", "grammar")


class ConstraintError(ValueError):
    """A constraint that cannot be used; `field` names the line field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def from_response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ConstraintError("response_format", "must be an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ConstraintError(
                "response_format.json_schema.schema",
                "json_schema needs a 'schema' object (and a 'name')",
            )
        check_schema(spec["schema"], "response_format.json_schema.schema")
        return {"json": spec["schema"]}
    raise ConstraintError(
        "response_format.type", f"{kind!r}: expected text, json_object or json_schema"
    )


def check_schema(schema: Any, field: str) -> None:
    """A JSON schema that jsonschema's meta-schema accepts."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ConstraintError(field, "a JSON schema must be an object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConstraintError(field, f"invalid JSON schema: {exc.message}") from None


def check_regex(pattern: Any, field: str = "regex") -> None:
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError(field, "must be a non-empty string")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ConstraintError(field, f"regex does not compile: {exc}") from None


def check_choice(choices: Any, field: str = "choice") -> None:
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ConstraintError(field, "must be a non-empty list of non-empty strings")


def constraint_of(fields: dict[str, Any]) -> dict[str, Any] | None:
    """The one constraint among a line's fields (None without one); ConstraintError when a
    value is invalid or several are given."""
    given = [name for name in LINE_FIELDS if fields.get(name) is not None]
    if len(given) > 1:
        raise ConstraintError(given[1], f"only one constraint per request; got {', '.join(given)}")
    if not given:
        return None
    name = given[0]
    value = fields[name]
    if name == "response_format":
        return from_response_format(value)
    if name == "json":
        check_schema(value, "json")
    elif name == "regex":
        check_regex(value)
    elif name == "choice":
        check_choice(value)
    elif not isinstance(value, str) or not value.strip():
        raise ConstraintError("grammar", "must be a non-empty grammar string (GBNF or Lark)")
    return {name: value}


def field_of(constraint: dict[str, Any]) -> str:
    """The line field a stored constraint came from, for error messages."""
    return next(iter(constraint))


@lru_cache(maxsize=256)
def _validator(schema_text: str) -> Any:
    import jsonschema

    schema = json.loads(schema_text)
    return jsonschema.validators.validator_for(schema)(schema)


@lru_cache(maxsize=256)
def _pattern(regex: str) -> re.Pattern[str]:
    return re.compile(regex)


def satisfies(constraint: dict[str, Any], text: str) -> bool | None:
    """Whether generated text meets its constraint: parses and validates against the schema,
    is one of the choices, fully matches the regex. None for a grammar (no checker here)."""
    kind, value = next(iter(constraint.items()))
    if kind == "choice":
        return text in value
    if kind == "regex":
        return _pattern(value).fullmatch(text) is not None
    if kind == "grammar":
        return None
    try:
        document = json.loads(text)
    except ValueError:
        return False
    if kind == "json_object":
        return isinstance(document, dict)
    return bool(_validator(json.dumps(value, sort_keys=True)).is_valid(document))
