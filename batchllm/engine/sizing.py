"""Size a job's max_model_len from its real prompts: longest prompt plus its max_tokens.

An oversized context only costs KV cache and concurrency; an undersized one turns rows into
errors. The longest request decides, capped by what the model supports. The sizing pass
tokenizes every prompt; it hands the ids on (input/token_store.py) so the feed does not
tokenize them again.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from batchllm.engine.images import ImagePrompt, has_images, load_image_processor
from batchllm.engine.prompts import prepare_prompts, token_count
from batchllm.input.formats.rows import POOLING_KINDS, InputRow
from batchllm.row_errors import Refusal
from batchllm.settings import Settings
from batchllm.spec import SamplingDefaults

log = logging.getLogger(__name__)

_BATCH = 2048
_ROUND = 64  # so jobs of similar size share one warm engine
_BOUND_FLOOR = 256  # the smallest context sized from a bound (sized() says why)

# What a sized batch hands on: its rows' line numbers and each one's prompt ids (None where
# the feed must prepare the row itself: invalid, failed, or a list embedding input; an
# ImagePrompt for a row with images, which the feed prepares again with its images).
OnPrepared = Callable[[list[int], list[list[int] | ImagePrompt | None]], None]


@functools.lru_cache(maxsize=8)
def model_limit(model: str) -> int:
    """The model's context: its config.json's (config_limit) for a local directory, else
    transformers' AutoConfig's (a hub name in the cache); 2048 when neither states one. The one
    reader of a model's context before an engine is built (a built engine's is its own
    model_config's: engine/vllm_engine.py)."""
    stated = config_limit(Path(model))
    if stated is not None:
        return stated
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "get_text_config", lambda: config)()
    return int(getattr(text, "max_position_embeddings", 2048))


def config_limit(model: Path) -> int | None:
    """The model's context as its config.json states it (its text model's, for a model with a
    `text_config`), read without transformers; None when it is not stated there."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str) -> Any:
    """The model's tokenizer, loaded once per process: a warm worker sizes each new job with
    it (loading takes seconds; the first job on a warm worker should start in well under one).
    Tokenizing is read-only, so sharing one is safe."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@functools.lru_cache(maxsize=4)
def light_tokenizer(model: str) -> Any:
    """The model's fast tokenizer without AutoTokenizer, whose import loads torch (measured:
    a process of ~570 MB instead of ~80 MB): for the submit's token pass, run's sizing, the
    instant engine and a kept engine's. Models without a tokenizer.json get AutoTokenizer's.
    Loaded once per process, as load_tokenizer: a kept engine sizes each run's job with it."""
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(model)
    except (OSError, ValueError, TypeError):
        log.info("%s: no fast tokenizer file; loading it with AutoTokenizer", model)
        return load_tokenizer(model)


class ContextSizer:
    """Feeds rows through prepare_prompts in batches and keeps the longest request."""

    def __init__(
        self,
        model: str,
        defaults: SamplingDefaults,
        chat_template: str | None = None,
        *,
        settings: Settings,
        tokenizer: Any = None,
        limit: int | None = None,
        images: bool = True,
    ) -> None:
        """`settings`: what rows' images are read under (engine/images.py). `tokenizer` and
        `limit` (the model's context) in place of the ones transformers' Auto classes load
        (which import torch); `images=False`: rows with images are left to the feed, and the
        pass is then not `complete` (its size misses them)."""
        self.model, self.settings = model, settings
        self.limit = model_limit(model) if limit is None else limit
        self.tokenizer = load_tokenizer(model) if tokenizer is None else tokenizer
        self.defaults, self.chat_template = defaults, chat_template
        self.images = images
        self.complete = True  # every runnable row was measured
        self.longest = 1
        self.bounded = False  # some rows were measured by their bytes' bound, not their ids
        # The prompt tokens of the rows tokenized: the job's exact count when every row was
        # (complete, not bounded), which its key's enqueued-token limit holds (api/enqueued.py).
        self.prompt_tokens = 0
        self._bound_encoder: Any = None  # byte_bound_encoder's, looked up once

    def add_bound(self, rows: list[InputRow], ceiling: int) -> bool:
        """Measure rows by their bytes (engine/token_bound.py) instead of their ids: True when
        the bound applies and the context it asks for is at most `ceiling` (the size so far
        then covers these rows), False when they must be tokenized (`add`): a tokenizer the
        bound does not hold for, a row with images, or a bound over the ceiling, where the
        exact size could be several times smaller."""
        if self._bound_encoder is None:
            from batchllm.engine.token_bound import byte_bound_encoder

            self._bound_encoder = byte_bound_encoder(self.tokenizer) or False
        runnable = [r for r in rows if r.kind != "invalid"]
        if self._bound_encoder is False or any(map(has_images, runnable)):
            return False
        ceiling = min(ceiling, self.limit)
        default_max = self.defaults.max_tokens
        need = 0
        bounds = prepare_prompts(
            self.tokenizer, runnable, None, self.chat_template, encode=self._bound_encoder
        )
        for row, ids in zip(runnable, bounds, strict=True):
            if isinstance(ids, Refusal | ImagePrompt) or not ids:
                continue  # the feed makes its error row, as it would of its real ids
            if row.kind in POOLING_KINDS:
                lengths = [len(i) for i in ids] if isinstance(ids[0], list) else [len(ids)]
                need = max(need, *lengths)
                continue
            max_tokens = row.overrides().get("max_tokens") if row.sampling else None
            need = max(need, len(ids) + (default_max if max_tokens is None else max_tokens))
        if need > ceiling:
            return False
        self.longest = max(self.longest, need)
        self.bounded = True
        return True

    def add(self, rows: Iterable[InputRow], on_prepared: OnPrepared | None = None) -> None:
        batch: list[InputRow] = []
        for row in rows:
            batch.append(row)
            if len(batch) >= _BATCH:
                self._flush(batch, on_prepared)
                batch = []
        self._flush(batch, on_prepared)

    def _flush(self, batch: list[InputRow], on_prepared: OnPrepared | None) -> None:
        runnable = [r for r in batch if r.kind != "invalid"]
        with_images = any(map(has_images, runnable))
        if with_images and not self.images:
            runnable = [r for r in runnable if not has_images(r)]
            self.complete = False
            with_images = False
        # The processor only for a batch with images: a text job never loads it.
        images = load_image_processor(self.model, self.settings) if with_images else None
        prepared = prepare_prompts(self.tokenizer, runnable, None, self.chat_template, images)
        default_max = self.defaults.max_tokens
        best = 0
        kept: dict[int, list[int] | ImagePrompt] = {}
        for row, ids in zip(runnable, prepared, strict=True):
            if isinstance(ids, Refusal) or not ids:
                continue
            if isinstance(ids, ImagePrompt):  # the feed opens its images again
                tokens = token_count(ids)
                self.prompt_tokens += tokens
                if tokens < self.limit:
                    max_tokens = row.overrides().get("max_tokens")
                    best = max(best, tokens + (default_max if max_tokens is None else max_tokens))
                kept[row.line] = ids
                continue
            self.prompt_tokens += sum(map(len, ids)) if isinstance(ids[0], list) else len(ids)
            # A prompt over the model's own context becomes an error row; sizing the engine for
            # it would give every other row the model's whole context (found on an 8k model).
            if row.kind in POOLING_KINDS:  # the longest text, and nothing generated
                if isinstance(ids[0], list):
                    fitting = [len(i) for i in ids if len(i) <= self.limit]
                    best = max(best, max(fitting, default=0))
                    continue
                if len(ids) <= self.limit:
                    best = max(best, len(ids))
            elif len(ids) < self.limit:
                max_tokens = row.overrides().get("max_tokens") if row.sampling else None
                best = max(best, len(ids) + (default_max if max_tokens is None else max_tokens))
            kept[row.line] = ids  # type: ignore[assignment]
        self.longest = max(self.longest, best)
        if on_prepared is not None:
            on_prepared([r.line for r in batch], [kept.get(r.line) for r in batch])

    def counted(self) -> int | None:
        """The prompt tokens of every row added, when each was tokenized (not bounded by its
        bytes, none left to the feed); None otherwise."""
        return self.prompt_tokens if self.complete and not self.bounded else None

    def sized(self) -> int:
        """The max_model_len for the rows added so far (result() without its log line).
        A bound is rounded up to a power of two: an unsized job's shards are released as they
        are measured and a worker rebuilds its engine when the job's size grows past it, so a
        loose measure gets coarse steps (at most 256, 512, 1024) rather than one per 64."""
        if self.bounded:
            return min(self.limit, max(_BOUND_FLOOR, 1 << (self.longest - 1).bit_length()))
        return min(self.limit, -(-self.longest // _ROUND) * _ROUND)

    def result(self) -> int:
        sized = self.sized()
        log.info(
            "max_model_len sized to %d (longest request %s%d tokens, model limit %d)",
            sized,
            "at most " if self.bounded else "",
            self.longest,
            self.limit,
        )
        return sized


def size_max_model_len(
    model: str,
    rows: Iterable[InputRow],
    defaults: SamplingDefaults,
    chat_template: str | None = None,
    *,
    settings: Settings,
) -> int:
    sizer = ContextSizer(model, defaults, chat_template, settings=settings)
    sizer.add(rows)
    return sizer.result()
