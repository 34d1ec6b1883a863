"""Concepts with one owner each, pinned: a second writer of states, a second reader of part
names or a second Redis client would slip back in unnoticed otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import batchllm

PACKAGE = Path(batchllm.__file__).parent
# A job or shard status set by an UPDATE's values(...) or on a loaded object.
_STATUS_WRITE = re.compile(
    r"\.values\((?:[^()]|\([^()]*\))*?\bstatus=|\.status\s*=\s*(?:Job|Shard)Status", re.DOTALL
)


def sources(*, but: tuple[str, ...] = ()) -> dict[str, str]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        if name not in but:
            found[name] = path.read_text()
    return found


def test_only_the_state_machine_moves_a_job_or_shard_from_one_state_to_another():
    writers = [
        n
        for n, text in sources(but=("store/state_machine.py",)).items()
        if _STATUS_WRITE.search(text)
    ]
    assert writers == []


def test_the_state_machine_leases_and_recovery_touch_no_storage():
    for name in ("store/state_machine.py", "store/leases.py", "store/recovery.py"):
        text = (PACKAGE / name).read_text()
        assert "batchllm.storage" not in text and "batchllm.output" not in text, name


def test_part_file_names_are_made_and_read_only_in_output_parts():
    readers = [
        n for n, text in sources(but=("output/parts.py",)).items() if re.search(r"[\"']part-", text)
    ]
    assert readers == []


def test_redis_is_reached_only_through_the_redis_broker_module():
    clients = [
        n
        for n, text in sources(but=("worker/redis_broker.py",)).items()
        if "Redis.from_url" in text or 'startswith(("redis' in text or 'startswith("redis' in text
    ]
    assert clients == []


def test_input_shard_and_token_file_names_are_made_and_read_only_in_storage():
    # Validation, the feed's token ids, the export and a pipeline's parent rows all find a
    # job's input shards through Storage.input_shard / input_shards / token_file_of.
    namers = [
        n
        for n, text in sources(but=("storage.py",)).items()
        if re.search(r"[\"'](?:shard|tokens)-", text)
    ]
    assert namers == []
