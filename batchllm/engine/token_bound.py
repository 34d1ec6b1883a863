"""An upper bound on a text's tokens from its UTF-8 bytes, for byte-level BPE tokenizers.

Why: an exact context size means tokenizing every row before any runs, one thread a fleet waits
on. The engine needs a max_model_len no request exceeds, not the smallest (vLLM's KV cache is
paged: a longer context costs nothing until used), so a bound from the bytes sizes a job of
short prompts at validation's pace while the workers tokenize their own shards in parallel.
Why it holds: byte-level BPE (GPT-2's scheme: SmolLM2, Llama 3, Qwen, the demo model) starts
from one symbol per byte and only merges, so each token covers at least one byte; an added token
is one token; without a normalizer nothing rewrites the text first. The post-processor's special
tokens come on top. Other tokenizers (WordPiece, Unigram, an expanding normalizer) get no bound.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from batchllm.engine.prompts import Encode

log = logging.getLogger(__name__)


def byte_bound_encoder(tokenizer: Any) -> Encode | None:
    """An `Encode` whose "ids" are as many placeholder ids as the bound allows for each text
    (so a prompt's length is its bound through the same code that measures real ids), or None
    when the bound does not hold for this tokenizer. Reads the tokenizer's whole
    serialization: call it once per tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _byte_level_bpe(backend.to_str()):
        log.debug("no byte bound for this tokenizer: its jobs are sized by tokenizing")
        return None
    added = backend.num_special_tokens_to_add(False)
    return lambda texts, special: [
        [0] * (len(text.encode("utf-8", "surrogatepass")) + (added if special else 0))
        for text in texts
    ]


def _byte_level_bpe(serialized: str) -> bool:
    """Whether a tokenizer (its tokenizer.json text) is a byte-level BPE with no normalizer."""
    try:
        config = json.loads(serialized)
    except ValueError:
        return False
    model = config.get("model") or {}
    return (
        model.get("type") == "BPE"
        and not model.get("byte_fallback")
        and config.get("normalizer") is None
        and _is_byte_level(config.get("pre_tokenizer"))
    )


def _is_byte_level(pre_tokenizer: Any) -> bool:
    """A ByteLevel pre-tokenizer, alone or last in a sequence (after splits, which only cut
    the text into pieces: each piece still maps byte by byte)."""
    if not isinstance(pre_tokenizer, dict):
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    if pre_tokenizer.get("type") != "Sequence":
        return False
    steps = pre_tokenizer.get("pretokenizers") or []
    return (
        bool(steps)
        and _is_byte_level(steps[-1])
        and all(step.get("type") in ("Split", "Digits", "ByteLevel") for step in steps)
    )
