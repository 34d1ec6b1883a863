"""Which rows of a job feed the next job (`--from JOB`, `--from-status`), and the table options
a child job takes from that: kept free of pyarrow, as the CLI and `import batchllm` load it.
jobs/parent_rows.py reads the rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchllm.errors import InputError

ROW_STATUSES = ("ok", "error")
# The parent's output columns a child can read, besides custom_id and its line.
CARRIED = (
    "status",
    "text",
    "finish_reason",
    "structured_ok",
    "reasoning",
    "tool_calls",
    "embedding",
    "scores",
    "label",
    "probs",
    "error",
)
# Table options that say where a row's request is; with none of them the child's prompt is
# the parent's answer.
REQUEST_OPTIONS = ("prompt_column", "messages_column", "prompt_template")
DEFAULT_PROMPT_COLUMN = "text"
ID_COLUMN = "custom_id"


@dataclass(frozen=True)
class JobRows:
    """The rows of job `job` with these output statuses, as a job's input."""

    job: str
    statuses: tuple[str, ...] = ("ok",)

    def __post_init__(self) -> None:
        unknown = [s for s in self.statuses if s not in ROW_STATUSES]
        if unknown or not self.statuses:
            raise InputError(
                f"--from-status {','.join(self.statuses) or '(none)'}: "
                f"row statuses are {', '.join(ROW_STATUSES)}"
            )

    @property
    def recorded(self) -> str:
        """How the child records its input."""
        return f"from:{self.job}?status={','.join(self.statuses)}"


def child_options(rows: JobRows, options: dict[str, Any]) -> dict[str, Any]:
    """A child job's options (build_job_spec's keywords): the parent recorded, the parent's
    custom_id as its id, and its answer (`text`) as its prompt unless a prompt column,
    messages column or template says otherwise."""
    given = dict(options)
    given["parents"] = [rows.job]
    if given.get("id_column") is not None and given["id_column"] != ID_COLUMN:
        raise InputError(
            f"--id-column {given['id_column']}: with --from, each row keeps its parent's "
            "custom_id, so children join back to their parents"
        )
    given["id_column"] = ID_COLUMN
    if all(given.get(name) is None for name in REQUEST_OPTIONS):
        given["prompt_column"] = DEFAULT_PROMPT_COLUMN
    return given
