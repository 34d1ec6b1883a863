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
from pathlib import Path
from typing import TYPE_CHECKING

from batchllm.input.formats.rows import InputRow
from batchllm.input.shards import ShardInput, iter_shard_rows
from batchllm.input.token_store import TokenFileWriter, token_path
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage

if TYPE_CHECKING:
    from batchllm.engine.sizing import ContextSizer

log = logging.getLogger(__name__)


def new_sizer(spec: JobSpec, settings: Settings) -> ContextSizer:
    """A sizer for the job's model. A local model's fast tokenizer and config.json are read
    without transformers' Auto classes, whose imports (torch among them) took 4-7 s of a cold
    `run` of 8 lines here (issue 63); the feed checks the stored ids against its engine's
    tokenizer and tokenizes again on a difference (execution/runner.py), as for `submit`."""
    from batchllm.engine.sizing import (  # transformers: here only
        ContextSizer,
        config_limit,
        light_tokenizer,
    )

    local = Path(spec.model)
    limit = config_limit(local)
    if limit is None or not (local / "tokenizer.json").is_file():
        return ContextSizer(spec.model, spec.sampling, spec.chat_template, settings=settings)
    return ContextSizer(
        spec.model,
        spec.sampling,
        spec.chat_template,
        settings=settings,
        tokenizer=light_tokenizer(spec.model),
        limit=limit,
    )


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


class ThreadedPass:
    """A pass over a job's shards on a thread of its own, as validation stores them: `stored`
    hands a shard over, the subclass's `_measure` runs on the thread until it raises once
    (`_stopped` then gets the error) or the pass is stopped, after which shards pass through
    untouched; `ready` hands them back in order, whether or not they were measured."""

    thread_name = "batchllm-sizing"

    def __init__(self) -> None:
        self._todo: queue.Queue[object] = queue.Queue()
        self._done: queue.Queue[ShardInput] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.stopped = False  # an error, or the job was not created

    def stored(self, shard: ShardInput) -> None:
        self._todo.put(shard)

    def ready(self) -> list[ShardInput]:
        """The shards measured (or passed through) since the last call; never waits."""
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def _start(self, waiting: list[ShardInput] | None = None) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        for shard in waiting or []:
            self._todo.put(shard)

    def _wait(self) -> None:
        """Wait for the shards handed over so far."""
        if self._thread is not None:
            self._todo.put(_DONE)
            self._thread.join()

    def _run(self) -> None:
        while True:
            shard = self._todo.get()
            if shard is _DONE:
                return
            assert isinstance(shard, ShardInput)
            if not self.stopped:
                try:
                    self._measure(shard)
                except Exception as exc:
                    self.stopped = True  # before the shard is handed back
                    self._stopped(exc)
            self._done.put(shard)

    def _measure(self, shard: ShardInput) -> None:
        raise NotImplementedError

    def _stopped(self, error: Exception) -> None:
        raise NotImplementedError


class BesideValidation(ThreadedPass):
    """Sizes shards on a thread as they are stored; `finish` gives the job's max_model_len, or
    None with the pass's error in `error` (the job is created all the same, and failed by its
    caller with that reason)."""

    def __init__(self, spec: JobSpec, storage: Storage, settings: Settings) -> None:
        super().__init__()
        self.spec, self.storage, self.settings = spec, storage, settings
        self.error: BaseException | None = None
        self._sizer: ContextSizer | None = None
        self._sized: list[str] = []
        self._start()

    def sized_so_far(self) -> int | None:
        return None  # a local run releases nothing before its validation ends

    def counted(self) -> int | None:
        if self.error is not None or self.stopped or self._sizer is None:
            return None
        return self._sizer.counted()

    def finish(self) -> int | None:
        """Wait for the shards stored so far; the sized max_model_len, or None and `error`."""
        try:
            self._wait()
            if self.error is None:
                return (self._sizer or new_sizer(self.spec, self.settings)).result()
        except BaseException as exc:  # a Ctrl-C while waiting, too: the job is failed with it
            self.stopped = True
            self.error = exc
        return None

    def close(self) -> None:
        """The job was not created (refused file, storage error): stop, remove what was written."""
        self.stopped = True
        self._wait()
        for path in self._sized:
            try:
                self.storage.delete(token_path(path))
            except OSError as exc:
                log.debug("could not delete the token ids of %s: %s", path, exc)

    def _measure(self, shard: ShardInput) -> None:
        self._sizer = self._sizer or new_sizer(self.spec, self.settings)
        size_shard(self._sizer, self.storage, shard.path)
        self._sized.append(shard.path)

    def _stopped(self, error: Exception) -> None:
        self.error = error  # read by the caller once the job exists


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

    def counted(self) -> int | None:
        return None  # the kept engine's sizing gives the length only

    def finish(self) -> int | None:
        try:
            return self.size(self._paths)
        except BaseException as exc:  # the job is created, and failed by its caller with it
            self.error = exc
            return None

    def close(self) -> None:
        pass
