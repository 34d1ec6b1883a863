"""Prompt rendering, tokenization and length checks, done before a request reaches the engine.

vLLM's `generate` aborts the whole call on the first prompt it refuses, so every prompt is
tokenized and checked here and a prompt that cannot run becomes an error row instead.
The same code sizes a job's context length, so sizing and running agree on every token count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from batchllm.engine.chat_batch import render_chats
from batchllm.engine.images import (
    ImageProcessor,
    ImagePrompt,
    has_images,
    prepare_image_row,
    template_messages,
)
from batchllm.input.formats.rows import POOLING_KINDS, TEMPLATE_OPTIONS, InputRow
from batchllm.row_errors import CONTEXT_LENGTH_EXCEEDED, INVALID_PROMPT, Refusal

log = logging.getLogger(__name__)

Encode = Callable[[list[str], bool], list[list[int]]]


def render(
    tokenizer: Any,
    row: InputRow,
    chat_template: str | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> str:
    """A row's prompt text: a chat row through the chat template (the job's, else the
    model's) with the line's template options; `messages` in place of the row's own."""
    if row.kind != "chat":
        return str(row.prompt)
    options = row.overrides()
    continue_final = bool(options.get("continue_final_message", False))
    # Only what differs from the defaults is passed: a plain line renders exactly as before.
    extra: dict[str, Any] = dict(options.get("chat_template_kwargs") or {})
    if chat_template is not None:
        extra["chat_template"] = chat_template
    if continue_final:
        extra["continue_final_message"] = True
    if options.get("tools"):
        extra["tools"] = list(options["tools"])
    return str(
        tokenizer.apply_chat_template(
            row.chat_messages() if messages is None else messages,
            tokenize=False,
            add_generation_prompt=options.get("add_generation_prompt", not continue_final),
            **extra,
        )
    )


def batch_encoder(tokenizer: Any) -> Encode:
    """Token ids for a batch of texts, through the Rust tokenizer directly when that gives the
    same ids: a Hugging Face fast tokenizer computes offsets, masks and Python objects per text
    that nothing here reads, a third of the tokenization time.

    The wrapper turns the backend's truncation and padding off on every call and sets its
    special-token splitting; the direct path is taken only when the backend is already in that
    state, so both paths give equal ids.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and hasattr(backend, "encode_batch_fast")
        and backend.truncation is None
        and backend.padding is None
        and getattr(backend, "encode_special_tokens", False)
        == bool(getattr(tokenizer, "split_special_tokens", False))
    ):
        return lambda texts, special: [
            e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)
        ]
    return lambda texts, special: tokenizer(texts, add_special_tokens=special)["input_ids"]


# Token ids of a row: one prompt, or one per text of a list embedding input, or a chat prompt
# with its images; or why it cannot run.
Prepared = list[int] | list[list[int]] | ImagePrompt | Refusal


def token_count(prepared: Any) -> int:
    """Prompt tokens of prepared ids (all texts of a list embedding input; a prompt's images'
    tokens)."""
    if isinstance(prepared, ImagePrompt):
        return prepared.tokens
    if prepared and isinstance(prepared[0], list):
        return sum(len(ids) for ids in prepared)
    return len(prepared)


def prepare_prompts(
    tokenizer: Any,
    rows: list[InputRow],
    max_model_len: int | None,
    chat_template: str | None = None,
    images: ImageProcessor | None = None,
    encode: Encode | None = None,
) -> list[Prepared]:
    """For each row: its prompt token ids (a list of them for a list embedding input; with
    its decoded images for a chat row with images, through the model's processor `images`,
    without which such a row cannot run), or an error message (row stays in place).
    `encode`: in place of the tokenizer's own (engine/token_bound.py measures with it)."""
    results: list[Prepared] = [Refusal("not prepared")] * len(rows)
    lists: dict[int, list[list[int]]] = {}  # rows with a list input: their texts' ids
    # (row index, position in a list input or None, text), by whether special tokens are added
    groups: dict[bool, list[tuple[int, int | None, str]]] = {True: [], False: []}
    plain_chats: list[int] = []  # chat rows with no template options, rendered together
    with_images: list[int] = []
    for i, row in enumerate(rows):
        if row.token_ids is not None:  # tokenized by the job's sizing pass
            results[i] = row.token_ids
            continue
        if row.inputs:  # a list embedding input, or a score row's texts
            texts = row.texts()
            lists[i] = [[] for _ in texts]
            groups[True].extend((i, j, text) for j, text in enumerate(texts))
            continue
        if has_images(row):
            with_images.append(i)
            continue
        if row.kind == "chat" and not _template_options(row):
            plain_chats.append(i)
            continue
        _render_one(tokenizer, rows, i, chat_template, groups, results)
    if plain_chats:
        chats = [rows[i].chat_messages() for i in plain_chats]
        rendered = render_chats(tokenizer, chats, chat_template)
        if rendered is None:
            for i in plain_chats:
                _render_one(tokenizer, rows, i, chat_template, groups, results)
        else:
            groups[False].extend((i, None, text) for i, text in zip(plain_chats, rendered))
    encode = encode or batch_encoder(tokenizer)
    refused: dict[int, Refusal] = {}  # rows a text of which the tokenizer refused
    for special, items in groups.items():
        if not items:
            continue
        encoded = _encode_each(encode, [text for _, _, text in items], special)
        for (i, j, _), ids in zip(items, encoded):
            if isinstance(ids, Refusal):
                refused.setdefault(i, ids)
            elif j is None:
                results[i] = ids
            else:
                lists[i][j] = ids
    for i, per_text in lists.items():
        results[i] = per_text
    for i in with_images:
        try:
            results[i] = _image_prompt(tokenizer, rows[i], chat_template, images, encode)
        except Exception as exc:  # one row's images or text: its error row, not the batch's
            results[i] = Refusal(f"the prompt could not be prepared: {_named(exc)}")
    for i, refusal in refused.items():
        results[i] = refusal
    if max_model_len is not None:
        return within_context(rows, results, max_model_len, "the engine's max_model_len")
    return results


def _named(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _encode_each(encode: Encode, texts: list[str], special: bool) -> list[list[int] | Refusal]:
    """The texts' ids in one batch call; when the tokenizer refuses the batch (one text it
    cannot take, e.g. a lone surrogate that slipped past validation, raises for the whole
    call), each text alone, so only the texts it refuses fail."""
    try:
        return list(encode(texts, special))
    except Exception:
        log.warning(
            "the tokenizer refused a batch of %d texts; tokenizing them one by one", len(texts)
        )
    each: list[list[int] | Refusal] = []
    for text in texts:
        try:
            each.append(encode([text], special)[0])
        except Exception as exc:
            each.append(Refusal(f"the prompt could not be tokenized: {_named(exc)}"))
    return each


def within_context(
    rows: list[InputRow], prepared: list[Prepared], max_model_len: int, limit: str
) -> list[Prepared]:
    """The prepared ids of rows that fit a context of `max_model_len` tokens; for the others,
    why they cannot run, naming the `limit` they break."""
    return [
        ids
        if isinstance(ids, Refusal)
        else _checked(ids, max_model_len, row.kind in POOLING_KINDS, limit)
        for row, ids in zip(rows, prepared, strict=True)
    ]


def _template_options(row: InputRow) -> bool:
    options = row.overrides()
    return any(name in options for name in TEMPLATE_OPTIONS)


def _render_one(
    tokenizer: Any,
    rows: list[InputRow],
    i: int,
    chat_template: str | None,
    groups: dict[bool, list[tuple[int, int | None, str]]],
    results: list[Prepared],
) -> None:
    row = rows[i]
    try:
        # A chat template already holds the special tokens; a plain prompt gets them added.
        groups[row.kind != "chat"].append((i, None, render(tokenizer, row, chat_template)))
    except Exception as exc:  # a template can raise on unusual message orders
        results[i] = Refusal(f"chat template failed: {exc}", INVALID_PROMPT)


def _image_prompt(
    tokenizer: Any,
    row: InputRow,
    chat_template: str | None,
    images: ImageProcessor | None,
    encode: Encode,
) -> Prepared:
    if images is None or not images.accepts_images:
        return prepare_image_row(row, [], images)  # says why
    try:
        text = render(tokenizer, row, chat_template, template_messages(row))
    except Exception as exc:  # a template can raise on unusual message orders
        return Refusal(f"chat template failed: {exc}", INVALID_PROMPT)
    return prepare_image_row(row, encode([text], False)[0], images)


def _checked(prepared: Any, max_model_len: int, embed: bool, limit: str) -> Prepared:
    """The ids, or why they cannot run: a generation prompt needs room for one output token,
    an embedding input only for itself."""
    if isinstance(prepared, ImagePrompt):
        if prepared.tokens >= max_model_len:
            return Refusal(
                f"prompt is {prepared.tokens} tokens with its images; {limit} is "
                f"{max_model_len} (prompt plus at least one output token must fit)",
                CONTEXT_LENGTH_EXCEEDED,
            )
        return prepared
    sequences = prepared if prepared and isinstance(prepared[0], list) else [prepared]
    for ids in sequences:
        if not ids:
            return Refusal("prompt is empty after tokenization", INVALID_PROMPT)
        if embed and len(ids) > max_model_len:
            return Refusal(
                f"input is {len(ids)} tokens; {limit} is {max_model_len}", CONTEXT_LENGTH_EXCEEDED
            )
        if not embed and len(ids) >= max_model_len:
            return Refusal(
                f"prompt is {len(ids)} tokens; {limit} is {max_model_len} "
                "(prompt plus at least one output token must fit)",
                CONTEXT_LENGTH_EXCEEDED,
            )
    fits: Prepared = prepared
    return fits
