"""An upper bound on a text's tokens from its UTF-8 bytes, for byte-level BPE tokenizers.

Why: sizing a job's context exactly means tokenizing every row before any row runs, and on a
fleet that pass is one thread the workers wait on (issue 37: `submit`'s exact pass was the long
pole of an unsized job, and more workers made it no faster). The engine needs a max_model_len
that no request exceeds, not the smallest one: vLLM's KV cache is paged, so a longer context
costs no memory until a request uses it. A bound known from the bytes sizes a job of short
prompts in the validation's time, and the workers tokenize their own shards, in parallel.

Why it holds: a byte-level BPE model (GPT-2's scheme: SmolLM2, Llama 3, Qwen, the demo model)
starts from one symbol per byte of each pre-token and only merges symbols, so each token covers
at least one byte of the text; an added token in the text is one token for its bytes; without a
normalizer nothing rewrites the text before that. The post-processor's tokens (a BOS, with
special tokens added) come on top. Any other tokenizer (WordPiece, Unigram, a normalizer that
may expand a character) gets no bound here: its jobs are sized by tokenizing, as before.
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
