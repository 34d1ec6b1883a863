"""`submit`'s token pass: the ids of a fleet job's prompts, computed while it validates the file.

A thread tokenizes each shard as validation stores it and writes its ids beside it
(input/token_store.py); the workers' feed reads them instead of tokenizing, and an unsized job's
context is sized here, not by a worker. Only for a model the submitting machine holds (a local
directory with `tokenizer.json` and `config.json`), loaded without torch
(engine/sizing.light_tokenizer); each worker checks a shard's first ids against its engine's
tokenizer and tokenizes the shard itself on a difference (execution/runner.py). A shard is
released only once its ids are stored (jobs/create.py); an error here never fails a
submit, it leaves tokenizing to the workers. BATCHLLM_TOKENIZE_AT_SUBMIT: `auto` for unsized jobs
of AUTO_MIN_ROWS lines or more (see BOUND_CEILING), `always` every job, `never` none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from batchllm.execution.context.passes import ThreadedPass, size_shard
from batchllm.input.shards import ShardInput, iter_shard_rows
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage

if TYPE_CHECKING:
    from batchllm.engine.sizing import ContextSizer

log = logging.getLogger(__name__)

# A model with no max_position_embeddings in its config.json: its ids are still stored, but
# its context is left for a worker to size (AutoConfig, which knows each model's default).
_NO_LIMIT = 2**31
# `auto` starts the pass once a job has this many rows: a smaller job's worker sizes it in well
# under a second, where loading transformers here would add one or two to every small submit.
AUTO_MIN_ROWS = 10_000
# `auto` sizes a shard by its bytes (engine/token_bound.py) while the context that asks for is at
# most this many tokens; over it the prompts are long, the exact size may be a fraction of the
# bound (English runs ~4 bytes a token) and tokenizing is a small share of a row's engine time,
# so such a shard is tokenized and its ids stored as `always` does.
BOUND_CEILING = 1024


class SubmitTokens(ThreadedPass):
    """Tokenizes shards on a thread as validation stores them (a ShardPreparer)."""

    thread_name = "batchllm-submit-tokens"

    def __init__(
        self,
        spec: JobSpec,
        storage: Storage,
        settings: Settings,
        *,
        min_rows: int = 0,
        bound: bool = False,
    ) -> None:
        """`min_rows`: the pass starts once the shards stored hold this many rows; a job that
        never gets there passes through untouched, its sizing left to a worker. `bound`: a
        shard of short prompts is sized by its bytes and left to the workers to tokenize
        (BOUND_CEILING); without it, every shard is tokenized and its ids stored."""
        super().__init__()
        self.spec, self.storage, self.settings = spec, storage, settings
        self.min_rows = min_rows
        self.bound = bound
        self._sizer: ContextSizer | None = None
        from batchllm.engine.sizing import config_limit  # transformers: imported when used

        self._limit = config_limit(Path(spec.model))
        self._before: list[ShardInput] = []  # stored while the job is under min_rows
        self._rows = 0
        if min_rows <= 0:
            self._start()

    def stored(self, shard: ShardInput) -> None:
        if self._thread is not None:
            super().stored(shard)
            return
        self._before.append(shard)
        self._rows += shard.rows
        if self._rows >= self.min_rows:
            self._start(self._before)
            self._before = []

    def finish(self) -> int | None:
        """Wait for the shards stored so far; the job's sized max_model_len when this pass
        sized it (every row measured, the model's context known), else None."""
        if self._thread is None:  # too small to start: every shard passes through
            self.stopped = True
            for shard in self._before:
                self._done.put(shard)
            return None
        self._wait()
        sizer = self._sizing()
        return None if sizer is None else sizer.result()

    def sized_so_far(self) -> int | None:
        """The job's max_model_len over every shard `ready` has returned, while this pass sizes
        the job (no --max-model-len, every row measured so far, the model's context known);
        None otherwise, and for good from the first shard the pass could not tokenize."""
        sizer = self._sizing()
        return None if sizer is None else sizer.sized()

    def counted(self) -> int | None:
        """The exact prompt tokens of the job's rows, when this pass tokenized every one (it
        started, measuring the shards held back until then too, and never stopped or bounded
        a shard by its bytes)."""
        if self._thread is None or self.stopped or self._sizer is None:
            return None
        return self._sizer.counted()

    def close(self) -> None:
        """The job was not created: stop (the job's storage goes with it)."""
        self.stopped = True
        self._wait()

    def _sizing(self) -> ContextSizer | None:
        """The sizer, while its size is the job's (see sized_so_far)."""
        sizer = self._sizer
        if (
            self.spec.engine.max_model_len is not None
            or self.stopped  # set before the shard it failed on is handed back
            or sizer is None
            or not sizer.complete
            or self._limit is None
        ):
            return None
        return sizer

    def _stopped(self, error: Exception) -> None:  # the workers tokenize what this could not
        log.warning(
            "tokenizing at submit stopped (%s: %s); the workers tokenize the job's rows",
            type(error).__name__,
            error,
        )

    def _measure(self, shard: ShardInput) -> None:
        sizer = self._get_sizer()
        if not self.bound:
            size_shard(sizer, self.storage, shard.path)
            return
        rows = list(iter_shard_rows(self.storage, shard.path))
        if not sizer.add_bound(rows, BOUND_CEILING):
            size_shard(sizer, self.storage, shard.path, rows)

    def _get_sizer(self) -> ContextSizer:
        if self._sizer is None:
            from batchllm.engine.sizing import ContextSizer, light_tokenizer

            self._sizer = ContextSizer(
                self.spec.model,
                self.spec.sampling,
                self.spec.chat_template,
                settings=self.settings,
                tokenizer=light_tokenizer(self.spec.model),
                limit=self._limit or _NO_LIMIT,
                images=False,
            )
        return self._sizer
