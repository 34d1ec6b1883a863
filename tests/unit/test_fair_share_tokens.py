"""Fair share counted in tokens served (SQLite): the tenant served the fewest tokens (prompt +
output, within the window, over its key's weight) takes the next turn, so a tenant whose
prompts are 20x longer gets half the tokens, not half the turns; weights shift the split; the
window bounds a tenant's credit; ties keep the turn order of before."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from batchllm.api import keys
from batchllm.store import state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Batch, Checkpoint, Shard, ShardStatus, utcnow
from batchllm.worker.fair_share import Waiting, next_shard, order, tenants_served
from tests.support.fake_runs import make_spec, one_line_shards, write_items
from tests.support.inputs import source_of

AGING = 600.0
WINDOW = 300.0
NOW = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)
# A shard's tokens served: the long tenant's prompts are 20x the short one's, 8 output tokens.
LONG = (200, 8)
SHORT = (10, 8)


def _waiting(job_id: str, tenant: str, served: float, started_ago: float | None) -> Waiting:
    return Waiting(
        job_id=job_id,
        tenant=tenant,
        priority="normal",
        created_at=NOW - timedelta(seconds=60),
        last_started=None if started_ago is None else NOW - timedelta(seconds=started_ago),
        tenant_served=served,
    )


def test_the_tenant_served_fewer_tokens_goes_first_whatever_its_last_turn():
    jobs = [_waiting("job_a", "a", 5_000, started_ago=50), _waiting("job_b", "b", 400, 1)]
    # b started a shard a second ago, a 50 s ago: by turns a goes first, by tokens b does.
    assert order(jobs, now=NOW, aging_seconds=AGING) == ["job_b", "job_a"]


def test_tenants_served_alike_take_turns_as_before():
    jobs = [_waiting("job_a", "a", 0, started_ago=1), _waiting("job_b", "b", 0, None)]
    assert order(jobs, now=NOW, aging_seconds=AGING) == ["job_b", "job_a"]


def test_priority_still_comes_before_the_share():
    high = _waiting("job_h", "a", 9_000, 1)
    high = Waiting(**{**high.__dict__, "priority": "high"})
    assert order([_waiting("job_n", "b", 0, None), high], now=NOW, aging_seconds=AGING) == [
        "job_h",
        "job_n",
    ]


def _batch_job(settings, tmp_path, name: str, owner: str, shards: int) -> list[int]:
    """One-line shards of a job created through the Batch API by `owner` (a key's id)."""
    shard_ids = one_line_shards(settings, tmp_path, name, shards)
    with session_scope(settings) as session:
        job_id = session.get(Shard, shard_ids[0]).job_id
        session.add(
            Batch(
                job_id=job_id,
                owner=owner,
                endpoint="/v1/completions",
                completion_window="24h",
                input_file_id="file-x",
            )
        )
    return shard_ids


def _weighted_key(settings, name: str, weight: float) -> str:
    """A key's id whose share of the tokens is `weight` times a plain key's."""
    with session_scope(settings) as session:
        row, _ = keys.create_key(session, name)
        row.share_weight = weight
        return row.id


def _serve(settings, shard_id: int, tokens: tuple[int, int], *, ago: float = 0.0) -> None:
    """Run a shard as a worker would, as far as fair share sees it: started, its rows committed
    as a checkpoint of `tokens` (prompt, output), ended."""
    now = utcnow() - timedelta(seconds=ago)
    with session_scope(settings) as session:
        state_machine.run_shard(session, shard_id, "w1", now=now, stale_before=now)
        session.add(
            Checkpoint(
                shard_id=shard_id,
                seq=0,
                path=f"part-{shard_id}",
                rows=1,
                rows_ok=1,
                rows_failed=0,
                prompt_tokens=tokens[0],
                completion_tokens=tokens[1],
                engine_seconds=0.0,
                created_at=now,
            )
        )
    with session_scope(settings) as session:
        state_machine.end_shard(session, shard_id, ShardStatus.COMPLETED)


def _served_by_one_worker(
    settings, tmp_path, *, long: int, short: int, short_owner: str
) -> dict[str, int]:
    """A job of `long` long-prompt shards (key_long's) and one of `short` short-prompt shards
    (`short_owner`'s), served by one worker: the tokens each tenant was served."""
    long_shards = _batch_job(settings, tmp_path, "long", "key_long", long)
    short_shards = _batch_job(settings, tmp_path, "short", short_owner, short)
    return _one_worker(settings, long_shards, short_shards)


def _one_worker(settings, long_shards: list[int], short_shards: list[int]) -> dict[str, int]:
    """One worker takes turns until a tenant has nothing queued: the tokens each was served."""
    cost = {**{s: LONG for s in long_shards}, **{s: SHORT for s in short_shards}}
    served = {"long": 0, "short": 0}
    queued = set(cost)
    while queued & set(long_shards) and queued & set(short_shards):
        with session_scope(settings) as session:
            chosen = next_shard(session, min(queued), aging_seconds=AGING, window_seconds=WINDOW)
        _serve(settings, chosen, cost[chosen])
        queued.discard(chosen)
        served["long" if chosen in long_shards else "short"] += sum(cost[chosen])
    return served


def test_a_tenant_with_prompts_20x_longer_gets_half_the_tokens_not_half_the_turns(
    settings, tmp_path
):
    served = _served_by_one_worker(settings, tmp_path, long=6, short=90, short_owner="key_short")
    share = served["long"] / (served["long"] + served["short"])
    # By turns it was 208 / (208 + 18) = 92% for the long tenant.
    assert 0.4 <= share <= 0.6, served


def test_a_key_of_weight_3_is_served_three_times_the_tokens(settings, tmp_path):
    heavy = _weighted_key(settings, "heavy", 3.0)
    served = _served_by_one_worker(settings, tmp_path, long=4, short=120, short_owner=heavy)
    share = served["short"] / (served["long"] + served["short"])
    assert 0.65 <= share <= 0.85, served


def test_only_the_windows_tokens_count_and_a_keys_weight_divides_them(settings, tmp_path):
    double = _weighted_key(settings, "double", 2.0)
    old = _batch_job(settings, tmp_path, "old", "key_old", 2)
    doubled = _batch_job(settings, tmp_path, "doubled", double, 1)
    _serve(settings, old[0], (1_000, 0), ago=WINDOW + 60)  # before the window: not counted
    _serve(settings, old[1], (30, 10))
    _serve(settings, doubled[0], (300, 100))
    with session_scope(settings) as session:
        served = tenants_served(
            session, make_spec().model, {"key_old", double, "key_none"}, now=utcnow(), window=WINDOW
        )
    assert served == {"key_old": 40.0, double: 200.0}


def test_the_instant_engines_token_cost_makes_its_time_follow_tokens_served(monkeypatch):
    """BATCHLLM_INSTANT_TOKEN_SECONDS: a step sleeps its cost per prompt and output token of
    the requests it finishes (the integration test's engine; the sleep recorded, not slept)."""
    import batchllm.execution.stand_in_engines as stand_ins

    slept: list[float] = []
    monkeypatch.setattr(stand_ins.time, "sleep", slept.append)
    engine = stand_ins.InstantEngine(tokenizer=None, max_model_len=512, token_seconds=0.001)
    params = engine.sampling_params({"max_tokens": 8})
    engine.add("long", list(range(200)), params)
    engine.add("short", list(range(10)), params)
    finished = engine.step()
    assert [(f.prompt_tokens, f.completion_tokens) for f in finished] == [(200, 8), (10, 8)]
    assert slept == [pytest.approx((208 + 18) * 0.001)]
    assert stand_ins.InstantEngine(tokenizer=None, max_model_len=512).token_seconds == 0.0
