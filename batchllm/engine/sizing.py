"""Size a job's max_model_len from its real prompts: longest prompt plus its max_tokens.

An oversized context only costs KV cache and concurrency; an undersized one turns rows into
errors. The longest request decides, capped by what the model supports.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from batchllm.engine.prompts import prepare_prompts
from batchllm.jobs.rows import InputRow
from batchllm.jobs.schemas import SamplingDefaults

log = logging.getLogger(__name__)

_BATCH = 2048
_ROUND = 64  # so jobs of similar size share one warm engine


def model_limit(model: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "get_text_config", lambda: config)()
    return int(getattr(text, "max_position_embeddings", 2048))


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def size_max_model_len(
    model: str,
    rows: Iterable[InputRow],
    defaults: SamplingDefaults,
    chat_template: str | None = None,
) -> int:
    limit = model_limit(model)
    tokenizer = load_tokenizer(model)
    longest = 1
    batch: list[InputRow] = []

    def flush() -> int:
        best = 0
        runnable = [r for r in batch if r.kind != "invalid"]
        for row, ids in zip(runnable, prepare_prompts(tokenizer, runnable, None, chat_template)):
            if isinstance(ids, str):
                continue
            if row.kind == "embed":  # the longest text, and nothing generated
                best = max(best, max(len(i) for i in ids) if isinstance(ids[0], list) else len(ids))
            else:
                best = max(best, len(ids) + defaults.merged(row.overrides())["max_tokens"])
        return best

    for row in rows:
        batch.append(row)
        if len(batch) >= _BATCH:
            longest = max(longest, flush())
            batch = []
    longest = max(longest, flush())
    sized = min(limit, -(-longest // _ROUND) * _ROUND)
    log.info(
        "max_model_len sized to %d (longest request %d tokens, model limit %d)",
        sized,
        longest,
        limit,
    )
    return sized
