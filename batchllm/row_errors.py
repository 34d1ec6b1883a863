"""Why an error row failed, as a machine-readable code (the output's `error_code` column).

The code is stored with the row (schema version 3) rather than read back from the `error` text
whenever it is needed: `batchllm retry` must tell a request the engine failed (worth running
again) from one that can never succeed (invalid, over the context), and a decision that rests
on wording would change silently the day a message is reworded. Rows written before version 3
have no code; `code_of` classifies them by the wording of the messages of that time, once, here.
New refusals carry their code from where they arise (`Refusal`).
"""

from __future__ import annotations

INVALID_REQUEST = "invalid_request"  # refused by validation (the input shard's `invalid` rows)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt does not fit the context
INVALID_PROMPT = "invalid_prompt"  # empty after tokenization, or the chat template failed
REQUEST_REJECTED = "request_rejected"  # vLLM refused the request (e.g. its constraint)
ENGINE_ERROR = "engine_error"  # the engine ended the request without an answer
SERVER_ERROR = "server_error"  # a pre-version-3 run failure no wording names
# Its shard failed BATCHLLM_MAX_SHARD_FAILURES times on an error no row explains; the row
# never ran (execution/shard_failures.py).
SHARD_FAILED = "shard_failed"

# Failures of the run, not of the request: running the request again may well succeed. Lines a
# cancelled or expired job never ran have no row at all; a retry runs them too (OpenAI's export
# names them `batch_expired` in an expired batch's error file).
RETRYABLE = frozenset({ENGINE_ERROR, SERVER_ERROR, SHARD_FAILED})

# Pre-version-3 rows: the wording of engine/prompts.py and execution/runner.py (first match wins).
_BY_WORDING = (
    ("max_model_len", CONTEXT_LENGTH_EXCEEDED),
    ("empty after tokenization", INVALID_PROMPT),
    ("chat template failed", INVALID_PROMPT),
    ("model does not accept images", INVALID_PROMPT),
    ("image token(s) for", INVALID_PROMPT),  # a chat template that does not place images
    ("rejected by vLLM", REQUEST_REJECTED),
    ("vLLM ended the request", ENGINE_ERROR),
)


class Refusal(str):
    """Why a row cannot run, as its error row's message, with its code decided where the
    refusal arises (tokenizing, a chat template, the context, an image): the runner writes
    `code` as the row's `error_code` and never reads the wording. A str, so it reads as the
    message wherever one is shown."""

    code: str

    def __new__(cls, message: str, code: str = INVALID_PROMPT) -> Refusal:
        refusal = super().__new__(cls, message)
        refusal.code = code
        return refusal


def code_of(code: str | None, message: str | None, *, invalid: bool = False) -> str:
    """An error row's code: the stored one, else classified from its message. `invalid`: the
    input shard marks the line invalid (validation refused it)."""
    if code:
        return code
    if invalid:
        return INVALID_REQUEST
    text = message or ""
    return next((found for words, found in _BY_WORDING if words in text), SERVER_ERROR)


def retryable(code: str | None, message: str | None, *, invalid: bool = False) -> bool:
    return code_of(code, message, invalid=invalid) in RETRYABLE
