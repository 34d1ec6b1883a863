"""The bench's generated workload: controlled lengths, the same shape for every run."""

from __future__ import annotations

import json
import statistics

from batchllm.bench.workload import Workload, iter_requests, stored_rows, write_openai_chat


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


def test_a_natural_workload_asks_real_questions_greedily_without_ignore_eos(tmp_path):
    natural = Workload(requests=60, prompt_words=(8, 64), output_tokens=(16, 128), natural=True)
    requests = list(iter_requests(natural, variant=0))
    texts = [r.messages[-1]["content"] for r in requests]
    assert len(set(texts)) == 60
    assert all(t.endswith(("?", ".")) for t in texts)
    assert {(r.temperature, r.ignore_eos, r.max_tokens) for r in requests} == {(0.0, False, 128)}
    assert (natural.temperature, natural.ignore_eos) == (0.0, False)
    # Another variant asks other questions, so no run finds another's in the prefix cache.
    assert not set(texts) & {r.messages[-1]["content"] for r in iter_requests(natural, variant=1)}
    path = write_openai_chat(tmp_path / "n.jsonl", natural, 0, model="m")
    body = json.loads(path.read_text().splitlines()[0])["body"]
    assert (body["temperature"], body["ignore_eos"], body["max_tokens"]) == (0.0, False, 128)
    stored = json.loads(stored_rows(natural, 0)[0].sampling)
    assert stored == {"max_tokens": 128, "ignore_eos": False, "temperature": 0.0}


def test_the_default_workload_still_runs_every_output_to_its_length():
    plain = Workload(requests=10, prompt_words=(8, 16), output_tokens=(16, 32))
    assert {(r.temperature, r.ignore_eos) for r in iter_requests(plain, 0)} == {(1.0, True)}
