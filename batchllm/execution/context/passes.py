"""The context-sizing passes over a job's stored shards: every prompt rendered and tokenized
once, the longest request kept, and the ids stored beside each shard for the feed
(input/token_store.py).

`BesideValidation` is `batchllm run`'s: it takes each shard as validation stores it, on a thread
of its own. The tokenizer's batch encoding runs in Rust without the GIL, so it proceeds on the
other core while validation (Python) goes on, instead of after it. `AfterValidation` sizes the
job once its shards are all stored, by a function the caller gives (a kept engine's tokenizer,
which is loaded already). Both are ShardPreparers (plan.py) whose error fails the job: the
caller reads it from `error` once the job exists.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from batchllm.input.rows import InputRow
from batchllm.input.schemas import JobSpec
from batchllm.input.shards import ShardInput, iter_shard_rows
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


class BesideValidation:
    """Sizes shards on a thread as they are stored; `finish` gives the job's max_model_len, or
    None with the pass's error in `error` (the job is created all the same, and failed by its
    caller with that reason)."""

    def __init__(self, spec: JobSpec, storage: Storage, settings: Settings) -> None:
        self.spec, self.storage, self.settings = spec, storage, settings
        self.error: BaseException | None = None
        self._todo: queue.Queue[object] = queue.Queue()
        self._done: queue.Queue[ShardInput] = queue.Queue()
        self._sized: list[str] = []
        self._result: int | None = None
        self._abandoned = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchllm-sizing", daemon=True)
        self._thread.start()

    def stored(self, shard: ShardInput) -> None:
        self._todo.put(shard)

    def ready(self) -> list[ShardInput]:
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def sized_so_far(self) -> int | None:
        return None  # a local run releases nothing before its validation ends

    def finish(self) -> int | None:
        """Wait for the shards stored so far; the sized max_model_len, or None and `error`."""
        self._todo.put(_DONE)
        try:
            self._thread.join()
        except BaseException as exc:  # a Ctrl-C while waiting: the job is failed with it
            self._abandoned.set()
            self.error = exc
        return None if self.error is not None else self._result

    def close(self) -> None:
        """The job was not created (refused file, storage error): stop, remove what was written."""
        self._abandoned.set()
        self._todo.put(_DONE)
        self._thread.join()
        for path in self._sized:
            try:
                self.storage.delete(token_path(path))
            except OSError as exc:
                log.debug("could not delete the token ids of %s: %s", path, exc)

    def _run(self) -> None:
        sizer = None
        while True:
            shard = self._todo.get()
            if shard is _DONE:
                break
            assert isinstance(shard, ShardInput)
            if self.error is None and not self._abandoned.is_set():
                try:
                    sizer = sizer or new_sizer(self.spec, self.settings)
                    size_shard(sizer, self.storage, shard.path)
                    self._sized.append(shard.path)
                except BaseException as exc:  # read by the caller once the job exists
                    self.error = exc
            self._done.put(shard)  # recorded whether or not it was sized
        if self.error is None and not self._abandoned.is_set():
            try:
                self._result = (sizer or new_sizer(self.spec, self.settings)).result()
            except BaseException as exc:
                self.error = exc


class AfterValidation:
    """Sizes the job once every shard is stored, with `size(paths)`; its error as
    BesideValidation's."""

    def __init__(self, size: Callable[[list[str]], int]) -> None:
        self.size = size
        self.error: BaseException | None = None
        self._paths: list[str] = []
        self._ready: list[ShardInput] = []

    def stored(self, shard: ShardInput) -> None:
        self._paths.append(shard.path)
        self._ready.append(shard)

    def ready(self) -> list[ShardInput]:
        ready, self._ready = self._ready, []
        return ready

    def sized_so_far(self) -> int | None:
        return None

    def finish(self) -> int | None:
        try:
            return self.size(self._paths)
        except BaseException as exc:  # the job is created, and failed by its caller with it
            self.error = exc
            return None

    def close(self) -> None:
        pass
