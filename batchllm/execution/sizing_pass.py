"""The context-sizing pass over a job's stored shards: every prompt rendered and tokenized once,
the longest request kept, and the ids stored beside each shard for the feed (token_store.py).

A `batchllm run` sizes while it validates: `BackgroundSizer` takes each shard as validation
stores it, on a thread of its own. The tokenizer's batch encoding runs in Rust without the GIL,
so it proceeds on the other core while validation (Python) goes on, instead of after it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

from batchllm.input.rows import InputRow
from batchllm.input.schemas import JobSpec
from batchllm.input.shards import iter_shard_rows
from batchllm.input.token_store import TokenFileWriter, token_path
from batchllm.settings import Settings
from batchllm.storage import Storage

if TYPE_CHECKING:
    from batchllm.engine.sizing import ContextSizer

log = logging.getLogger(__name__)


def new_sizer(spec: JobSpec, settings: Settings) -> ContextSizer:
    from batchllm.engine.sizing import ContextSizer  # transformers: only where a job is sized

    return ContextSizer(spec.model, spec.sampling, spec.chat_template, settings=settings)


def size_shard(
    sizer: ContextSizer, storage: Storage, input_path: str, rows: list[InputRow] | None = None
) -> None:
    """Size one stored shard and store its prompts' ids beside it; `rows`: its rows, when
    they were already read."""
    token_file = TokenFileWriter(storage, input_path)
    sizer.add(iter_shard_rows(storage, input_path) if rows is None else rows, token_file.write)
    token_file.close()


def size_shards(spec: JobSpec, storage: Storage, paths: list[str], settings: Settings) -> int:
    sizer = new_sizer(spec, settings)
    for path in paths:
        size_shard(sizer, storage, path)
    return sizer.result()


_DONE = object()


class BackgroundSizer:
    """Sizes shards on a thread as they are stored; `finish` gives the job's max_model_len."""

    def __init__(self, spec: JobSpec, storage: Storage, settings: Settings) -> None:
        self.spec, self.storage, self.settings = spec, storage, settings
        self._paths: queue.Queue[object] = queue.Queue()
        self._sized: list[str] = []
        self._result: int | None = None
        self._error: BaseException | None = None
        self._abandoned = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchllm-sizing", daemon=True)
        self._thread.start()

    def shard_stored(self, input_path: str) -> None:
        self._paths.put(input_path)

    def finish(self) -> int:
        """Wait for the shards stored so far; the sized max_model_len (or the pass's error)."""
        self._paths.put(_DONE)
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None  # set when the thread ends without an error
        return self._result

    def abandon(self) -> None:
        """The job was not created (refused file, storage error): stop, remove what was written."""
        self._abandoned.set()
        self._paths.put(_DONE)
        self._thread.join()
        for path in self._sized:
            try:
                self.storage.delete(token_path(path))
            except OSError as exc:
                log.debug("could not delete the token ids of %s: %s", path, exc)

    def _run(self) -> None:
        try:
            sizer = new_sizer(self.spec, self.settings)
            while True:
                path = self._paths.get()
                if path is _DONE or self._abandoned.is_set():
                    break
                assert isinstance(path, str)
                size_shard(sizer, self.storage, path)
                self._sized.append(path)
            if not self._abandoned.is_set():
                self._result = sizer.result()
        except BaseException as exc:  # re-raised by finish() on the caller's thread
            self._error = exc
