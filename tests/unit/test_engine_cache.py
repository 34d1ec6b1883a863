"""EngineCache keeps one warm engine and rebuilds it only when a job needs other engine settings
or a longer context than it has. vLLM is replaced by a fake engine class that records builds."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest

from batchllm.execution import engines as engines_module
from batchllm.execution.engines import EngineCache
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec

MODEL = "/models/fake"


class FakeVllmEngine:
    """Built like VllmEngine; its max_model_len is the one it was built with."""

    built: ClassVar[list[FakeVllmEngine]] = []

    def __init__(
        self, *, model: str, options: EngineOptions, max_model_len: int | None, settings: Settings
    ) -> None:
        self.model, self.options = model, options
        self.max_model_len = max_model_len
        self.shut_down = False
        FakeVllmEngine.built.append(self)

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.fixture
def cache(monkeypatch) -> EngineCache:
    FakeVllmEngine.built = []
    monkeypatch.setattr("batchllm.engine.vllm_engine.VllmEngine", FakeVllmEngine)
    return EngineCache(Settings())


def spec(**engine: object) -> JobSpec:
    return JobSpec(model=MODEL, engine=EngineOptions(enforce_eager=True, **engine))


def test_a_job_with_the_same_settings_and_a_shorter_context_gets_the_warm_engine(cache, caplog):
    warm = cache.get(spec(), 512)
    with caplog.at_level(logging.INFO, logger=engines_module.__name__):
        again = cache.get(spec(), 192)
        same = cache.get(spec(), 512)
    assert again is warm and same is warm
    assert FakeVllmEngine.built == [warm]
    assert not warm.shut_down
    assert "reusing the warm engine (max_model_len 512) for a job that needs max_model_len 192" in (
        caplog.text
    )


def test_an_explicit_shorter_max_model_len_is_served_by_the_warm_engine(cache):
    warm = cache.get(spec(), 1024)
    assert cache.get(spec(max_model_len=256), 256) is warm
    assert FakeVllmEngine.built == [warm]


def test_a_job_that_needs_a_longer_context_rebuilds_with_its_own(cache, caplog):
    short = cache.get(spec(), 256)
    with caplog.at_level(logging.INFO, logger=engines_module.__name__):
        longer = cache.get(spec(), 640)
    assert longer is not short
    assert [e.max_model_len for e in FakeVllmEngine.built] == [256, 640]
    assert short.shut_down and not longer.shut_down
    assert cache.engine is longer
    assert "the job needs max_model_len 640, the warm engine has 256" in caplog.text
    # and the longer engine now serves the short job too
    assert cache.get(spec(), 256) is longer
    assert len(FakeVllmEngine.built) == 2


def test_a_job_with_another_engine_setting_rebuilds_even_with_a_shorter_context(cache, caplog):
    warm = cache.get(spec(), 512)
    with caplog.at_level(logging.INFO, logger=engines_module.__name__):
        other = cache.get(spec(max_num_seqs=8), 128)
    assert other is not warm and warm.shut_down
    assert other.options.max_num_seqs == 8 and other.max_model_len == 128
    assert "other engine settings (max_num_seqs None -> 8)" in caplog.text


def test_another_model_rebuilds(cache):
    warm = cache.get(spec(), 512)
    other = cache.get(JobSpec(model="/models/other", engine=EngineOptions(enforce_eager=True)), 64)
    assert other is not warm and warm.shut_down and other.model == "/models/other"


def test_prefix_grouping_is_not_an_engine_setting(cache):
    warm = cache.get(spec(), 512)
    assert cache.get(spec(group_prefixes=False), 512) is warm


def test_after_close_the_next_job_builds_a_new_engine(cache):
    warm = cache.get(spec(), 512)
    cache.close()
    assert warm.shut_down and cache.engine is None
    assert cache.get(spec(), 128) is not warm
    assert [e.max_model_len for e in FakeVllmEngine.built] == [512, 128]
