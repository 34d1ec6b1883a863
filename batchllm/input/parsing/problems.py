"""Why a line is refused: the problem naming its field, with OpenAI's error code for it, decided
where the problem arises (the Batch API's error file shows it; output/openai_files.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from batchllm.input.formats.schemas import LineError

INVALID_JSON = "invalid_json"  # not UTF-8, or not JSON
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
UNKNOWN_PARAMETER = "unknown_parameter"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
INVALID_VALUE = "invalid_value"  # any other refusal

# pydantic's error types with a code of their own; the first error of a line decides.
_CODE_OF_ERROR_TYPE = {"missing": MISSING_REQUIRED_PARAMETER, "extra_forbidden": UNKNOWN_PARAMETER}


class LineProblem(Exception):
    def __init__(self, field: str | None, message: str, code: str = INVALID_VALUE) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code

    def error(self, file: str, line: int, custom_id: str) -> LineError:
        """The LineError refusing this line."""
        return LineError(
            file=file,
            line=line,
            custom_id=custom_id,
            field=self.field,
            message=self.message,
            code=self.code,
        )


def duplicate(custom_id: str, first: int) -> LineProblem:
    return LineProblem(
        "custom_id",
        f"duplicate custom_id {custom_id!r} (first on line {first})",
        DUPLICATE_CUSTOM_ID,
    )


def from_validation(exc: ValidationError, prefix: str = "") -> LineProblem:
    """The problem of a pydantic refusal: its first error's field and code, every error's
    message."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    field = (
        prefix + ".".join(str(part) for part in first["loc"]) if first["loc"] else prefix or None
    )
    message = "; ".join(
        (prefix + ".".join(str(p) for p in e["loc"]) + ": " if e["loc"] else "") + e["msg"]
        for e in errors
    )
    return LineProblem(
        field or None, message, _CODE_OF_ERROR_TYPE.get(first["type"], INVALID_VALUE)
    )


def validated(model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    """`data` as `model`, or the LineProblem refusing it (fields named after `prefix`)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc, prefix) from None
