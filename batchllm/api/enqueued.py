"""What an API key has enqueued, counted as its quotas count it: its unfinished batches, their
request lines not yet done, and their prompt tokens per model (OpenAI's unit: an organization's
enqueued prompt tokens per model are limited, a batch over the limit fails with
`token_limit_exceeded`).

A batch's prompt tokens are estimated at create, as its file is scanned, from the text of each
line's prompt fields: a token per 4 UTF-8 bytes (OpenAI's rule of thumb for English; scripts of
3-byte characters come out near a token per character, as BPE vocabularies cut them), 3 tokens
more per chat message (the role and the template's separators, after OpenAI's cookbook), a
fixed 85 per image (OpenAI's low-detail price) rather than its URL's bytes, and a token per id of
a prompt given as token ids. The server may not hold the model's tokenizer (it names a model
the workers load); an estimate known at create is what lets a batch over the limit fail before
any of it runs. The figure reserved is the job's `prompt_tokens_estimate`, released in
proportion as its rows finish (completed or failed) and whole when the batch ends.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import BindParameter, ColumnElement, Connection, bindparam, case, func, select
from sqlalchemy.orm import Session

from batchllm.settings import Settings
from batchllm.store.models import ApiKey, Batch, Job, StoredFile
from batchllm.store.states import JobStatus

_UNFINISHED = [status for status in JobStatus if not status.is_final]
# The body fields that become the prompt, in every endpoint's lines: chat and completions,
# embeddings, responses (input, instructions), tool and function definitions (a model reads them
# as part of its prompt, and OpenAI counts them), score/rerank/classify (text_1, text_2, query,
# documents, input).
PROMPT_FIELDS = (
    "messages",
    "prompt",
    "input",
    "instructions",
    "tools",
    "functions",
    "text_1",
    "text_2",
    "query",
    "documents",
)
BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 3
TOKENS_PER_IMAGE = 85
_IMAGE_KEYS = frozenset({"url", "image_url", "image"})


def estimate_prompt_tokens(body: Any) -> int:
    """A line body's prompt tokens, estimated from its prompt fields (see the module's
    docstring); 0 for a body that is not an object."""
    if not isinstance(body, dict):
        return 0
    return sum(_tokens(body[field]) for field in PROMPT_FIELDS if field in body)


def _tokens(value: Any, key: str | None = None) -> int:
    if isinstance(value, str):
        if key in _IMAGE_KEYS or value.startswith("data:"):
            return TOKENS_PER_IMAGE  # an image's URL or base64 bytes are not its tokens
        return -(-len(value.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return 1  # a prompt given as token ids
    if isinstance(value, list):
        return sum(_tokens(item, key) for item in value)
    if isinstance(value, dict):
        overhead = TOKENS_PER_MESSAGE if "role" in value else 0
        return overhead + sum(_tokens(item, name) for name, item in value.items())
    return 0


def unfinished_of(owner: str | BindParameter[str]) -> tuple[ColumnElement[bool], ...]:
    """The WHERE of `owner`'s unfinished jobs, read from the unfinished jobs (jobs.status's
    index; they are few) and each one's batch by its key, never from the owner's batches, which
    are all it ever made: joined from them, the planners walked every batch of the key (SQLite
    always, 0.2 s at 100,000; PostgreSQL without statistics). A scalar subquery, not a join or
    EXISTS, which a planner may turn around."""
    owner_of = select(Batch.owner).where(Batch.job_id == Job.id).scalar_subquery()
    return (Job.status.in_(_UNFINISHED), owner_of == owner)


def _lines() -> ColumnElement[int]:
    """A batch's input lines: its file's count (the job's own once validated, should the file
    be deleted)."""
    file_lines = (
        select(StoredFile.lines)
        .join(Batch, StoredFile.id == Batch.input_file_id)
        .where(Batch.job_id == Job.id)
        .scalar_subquery()
    )
    return func.coalesce(file_lines, Job.request_total)


def _waiting(lines: ColumnElement[int]) -> ColumnElement[int]:
    """Its lines not yet done (never below 0)."""
    waiting = lines - Job.request_completed - Job.request_failed
    return case((waiting > 0, waiting), else_=0)


def enqueued_rows(session: Session | Connection, owner: str) -> int:
    """The request lines `owner`'s unfinished batches have not finished."""
    return int(session.scalar(_ENQUEUED_ROWS, {"owner": owner}) or 0)


def _reserved_tokens() -> ColumnElement[int]:
    """A job's prompt tokens still reserved: its estimate times the share of its lines not yet
    done (integer arithmetic in SQL; the figure is exact at both ends: whole before any row,
    0 once all are done)."""
    lines = _lines()
    estimate = func.coalesce(Job.prompt_tokens_estimate, 0)
    return case((lines > 0, estimate * _waiting(lines) / lines), else_=estimate)


def enqueued_tokens(session: Session | Connection, owner: str, model: str) -> int:
    """The prompt tokens `owner` has enqueued for `model` in its unfinished batches. Read with
    the other models' (a key has few unfinished batches): filtered on the model in SQL,
    SQLite's planner walked every job of the model ever run by its index."""
    return enqueued_tokens_by_model(session, owner).get(model, 0)


def enqueued_tokens_by_model(session: Session | Connection, owner: str) -> dict[str, int]:
    """`owner`'s enqueued prompt tokens for each model it has unfinished batches of."""
    rows = session.execute(_TOKENS_BY_MODEL, {"owner": owner}).all()
    return {model: int(tokens or 0) for model, tokens in rows}


def token_limit(session: Session | Connection, owner: str, settings: Settings) -> int:
    """The key's enqueued-token limit per model: its own (`batchllm keys limits`), else the
    server's BATCHLLM_API_MAX_ENQUEUED_TOKENS."""
    own = session.scalar(_OWN_TOKEN_LIMIT, {"owner": owner})
    return int(own) if own is not None else settings.api_max_enqueued_tokens


# The statements every list page runs, built once and bound per request: building them cost
# more than running them (2.5 of a list page's 3.3 ms, measured in process).
_OWNER: BindParameter[str] = bindparam("owner")
_ENQUEUED_ROWS = (
    select(func.coalesce(func.sum(_waiting(_lines())), 0))
    .select_from(Job)
    .where(*unfinished_of(_OWNER))
)
_TOKENS_BY_MODEL = (
    select(Job.model, func.sum(_reserved_tokens()))
    .where(*unfinished_of(_OWNER))
    .group_by(Job.model)
    .order_by(Job.model)
)
_OWN_TOKEN_LIMIT = select(ApiKey.enqueued_token_limit).where(ApiKey.id == _OWNER)


def over_token_limit(
    session: Session, owner: str, model: str, adding: int, limit: int
) -> dict[str, Any] | None:
    """The batch error (OpenAI's BatchError shape, code `token_limit_exceeded`) when `adding`
    more prompt tokens for `model` would take `owner` over `limit`; None when they fit."""
    enqueued = enqueued_tokens(session, owner, model)
    if enqueued + adding <= limit:
        return None
    # OpenAI's own message starts so ("Enqueued token limit reached for gpt-4o in organization
    # org-... Limit: 90,000 enqueued tokens."); the figures that explain it follow.
    return {
        "code": "token_limit_exceeded",
        "message": f"Enqueued token limit reached for {model} for this API key. Limit: "
        f"{limit:,} enqueued tokens. This batch's {adding:,} prompt tokens (estimated) and the "
        f"{enqueued:,} already enqueued in this key's unfinished batches of {model} exceed it. "
        "Please try submitting your requests again later, once batches finish.",
        "param": None,
        "line": None,
    }


class TokenLimitExceeded(Exception):
    """A batch over its key's enqueued-token limit when it came to be recorded (concurrent
    creates took the room its early check saw): its job is dropped and a failed batch with
    `error` recorded in its place. Not
    an ApiError: the create answers with the failed batch, as OpenAI's does; not a
    BatchLLMError, which submit_job's caller turns into a 503."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.error = error
