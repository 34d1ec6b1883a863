"""Prompt rendering, tokenization and length checks, done before a request reaches the engine.

vLLM's `generate` aborts the whole call on the first prompt it refuses, so every prompt is
tokenized and checked here and a prompt that cannot run becomes an error row instead.
The same code sizes a job's context length, so sizing and running agree on every token count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchllm.jobs.rows import InputRow

Encode = Callable[[list[str], bool], list[list[int]]]


def render(tokenizer: Any, row: InputRow, chat_template: str | None = None) -> str:
    """A row's prompt text: a chat row through the chat template (the job's, else the
    model's) with the line's template options."""
    if row.kind != "chat":
        return str(row.prompt)
    options = row.overrides() if row.sampling else {}
    continue_final = bool(options.get("continue_final_message", False))
    # Only what differs from the defaults is passed: a plain line renders exactly as before.
    extra: dict[str, Any] = dict(options.get("chat_template_kwargs") or {})
    if chat_template is not None:
        extra["chat_template"] = chat_template
    if continue_final:
        extra["continue_final_message"] = True
    return str(
        tokenizer.apply_chat_template(
            row.chat_messages(),
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


def prepare_prompts(
    tokenizer: Any,
    rows: list[InputRow],
    max_model_len: int | None,
    chat_template: str | None = None,
) -> list[list[int] | str]:
    """For each row: its prompt token ids, or an error message (row stays in place)."""
    results: list[list[int] | str] = [""] * len(rows)
    groups: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
    for i, row in enumerate(rows):
        try:
            # A chat template already holds the special tokens; a plain prompt gets them added.
            groups[row.kind != "chat"].append((i, render(tokenizer, row, chat_template)))
        except Exception as exc:  # a template can raise on unusual message orders
            results[i] = f"chat template failed: {exc}"
    encode = batch_encoder(tokenizer)
    for special, items in groups.items():
        if not items:
            continue
        encoded = encode([text for _, text in items], special)
        for (i, _), ids in zip(items, encoded):
            results[i] = ids
    if max_model_len is not None:
        for i, prepared in enumerate(results):
            if isinstance(prepared, list) and len(prepared) >= max_model_len:
                results[i] = (
                    f"prompt is {len(prepared)} tokens; the engine's max_model_len is "
                    f"{max_model_len} (prompt plus at least one output token must fit)"
                )
            elif isinstance(prepared, list) and not prepared:
                results[i] = "prompt is empty after tokenization"
    return results
