"""A local run's first wave: until its first request finishes, at most BATCHLLM_FIRST_WAVE
requests are in the engine (so the first answer is not held back by a full batch), then the
rest; every row still runs once. Without a first wave every row goes in at once."""

from __future__ import annotations

import pytest

from batchllm.jobs.local import run_job
from tests.support.fake_runs import FakeEngine, FakeEngines, make_spec, output_rows, write_items
from tests.support.file_jobs import run_file
from tests.support.inputs import source_of

ROWS = 40


def in_engine_per_step(settings, tmp_path, first_wave: int) -> tuple[list[int], list[dict]]:
    settings.first_wave = first_wave
    seen: list[int] = []
    engine = FakeEngine(steps=3, max_num_seqs=4)
    engine.on_step = lambda step: seen.append(len(engine.waiting) + len(engine.running))
    job = run_file(
        write_items(tmp_path / "in.jsonl", ROWS), make_spec(), settings, engines=FakeEngines(engine)
    )
    assert job.status.value == "completed"
    return seen, output_rows(settings, job.id)


@pytest.mark.parametrize(("first_wave", "before_first_answer"), [(2, 2), (0, ROWS)])
def test_the_engine_holds_the_first_wave_until_an_answer_then_the_window(
    settings, tmp_path, first_wave, before_first_answer
):
    seen, rows = in_engine_per_step(settings, tmp_path, first_wave)

    # The fake finishes its first requests at step 3: the steps before hold the first wave.
    assert seen[:3] == [before_first_answer] * 3
    # Then the rest at once (the feed's batches are larger than this job).
    assert max(seen) == (ROWS - 2 if first_wave else ROWS)
    assert sorted(r["custom_id"] for r in rows) == sorted(f"item-{i}" for i in range(ROWS))
    assert all(r["status"] == "ok" for r in rows)
