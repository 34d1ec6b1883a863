"""The bench's generated workload: controlled lengths, the same shape for every run."""

from __future__ import annotations

import statistics

from batchllm.bench.workload import Workload, iter_requests


def lengths(workload: Workload, variant: int = 0) -> list[int]:
    return [request.max_tokens for request in iter_requests(workload, variant)]


def test_log_uniform_outputs_stay_in_range_and_are_long_tailed():
    workload = Workload(
        requests=4000, prompt_words=(8, 64), output_tokens=(8, 512), output_shape="log-uniform"
    )

    drawn = lengths(workload)

    assert min(drawn) >= 8 and max(drawn) <= 512
    assert max(drawn) > 480  # the tail reaches the top of the range
    # Half the answers are shorter than the geometric mean (64); the mean sits far above it.
    assert 55 <= statistics.median(drawn) <= 75
    assert statistics.mean(drawn) > 110


def test_uniform_outputs_cover_the_range_evenly():
    drawn = lengths(Workload(requests=4000, prompt_words=(8, 64), output_tokens=(16, 128)))

    assert min(drawn) == 16 and max(drawn) == 128
    assert 66 <= statistics.median(drawn) <= 78


def test_every_variant_has_the_same_lengths_and_different_words():
    workload = Workload(
        requests=50, prompt_words=(8, 64), output_tokens=(8, 512), output_shape="log-uniform"
    )

    first, second = list(iter_requests(workload, 1)), list(iter_requests(workload, 2))

    assert [r.max_tokens for r in first] == [r.max_tokens for r in second]
    assert all(a.messages != b.messages for a, b in zip(first, second))
