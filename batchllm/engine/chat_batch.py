"""Render many conversations through a chat template in one Jinja call.

transformers renders a chat template once per conversation, and each render builds a fresh
Jinja context (copying the environment's globals): for short prompts that costs more than
tokenizing them. Wrapping the template in a loop over the conversations
(`{% for messages in chats %}<template>SEP{% endfor %}`) renders a whole batch with one context;
the output splits on a separator no text holds.

The wrapped template must render exactly what transformers renders. A template may reach
outside its own scope (read `loop` at its top level, say), so each batch's first and last
conversations are also rendered the ordinary way and compared; one difference and that template
is rendered per conversation from then on. A batch whose render raises (a template that refuses
some message order) falls back to per-conversation renders, so the error lands on its row.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_SEPARATOR = "\x00\x1ebatchllm-row\x1e\x00"
_LOOP = "{% for messages in __batchllm_chats %}"
# template source -> its wrapped, compiled form; None when it does not render as transformers'
_COMPILED: dict[str, Any] = {}


def render_chats(
    tokenizer: Any, chats: list[list[dict[str, Any]]], chat_template: str | None
) -> list[str] | None:
    """Each conversation's prompt text (with the generation prompt), or None when this batch
    must be rendered one conversation at a time."""
    if len(chats) < 2:
        return None
    try:
        source = tokenizer.get_chat_template(chat_template, None)
    except Exception:  # no template at all: the per-row path reports it on each row
        return None
    wrapped = _wrapped(source)
    if wrapped is None:
        return None
    kwargs = {**tokenizer.special_tokens_map, "add_generation_prompt": True}
    try:
        text: str = wrapped.render(
            __batchllm_chats=chats, __batchllm_sep=_SEPARATOR, tools=None, documents=None, **kwargs
        )
    except Exception:
        return None
    pieces = text.split(_SEPARATOR)
    if len(pieces) != len(chats) + 1 or pieces[-1]:
        return None  # a message holds the separator
    rendered = pieces[:-1]
    for i in (0, len(chats) - 1):
        single = tokenizer.apply_chat_template(
            chats[i], tokenize=False, add_generation_prompt=True, chat_template=chat_template
        )
        if single != rendered[i]:
            log.info("this chat template renders one conversation at a time")
            _COMPILED[source] = None
            return None
    return rendered


def _wrapped(source: str) -> Any:
    if source in _COMPILED:
        return _COMPILED[source]
    from transformers.utils.chat_template_utils import _compile_jinja_template

    # Jinja drops one trailing newline of a template source; inside the loop it would not be
    # trailing any more, so it goes here.
    body = source[:-1] if source.endswith("\n") else source
    try:
        compiled = _compile_jinja_template(_LOOP + body + "{{ __batchllm_sep }}{% endfor %}")
    except Exception as exc:
        log.info("chat template cannot be wrapped for batch rendering: %s", exc)
        compiled = None
    _COMPILED[source] = compiled
    return compiled
