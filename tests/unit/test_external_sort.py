"""ExternalSort (batchllm/external_sort.py) on its own: every row added comes out exactly once,
in key order, whether it was sorted in memory or spilled to sorted runs and merged, and the
spilled runs are gone once it is closed."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from batchllm.errors import StorageError
from batchllm.external_sort import BATCH_ROWS, ExternalSort, SortSpillError

BY_KEY_THEN_LINE = [("key", "ascending"), ("line", "ascending")]
# Keys as placement makes them (a kind, a NUL, a prompt) and worse: empty, NULs, accents,
# letters beyond the BMP, where UTF-16 order would differ from the code points'.
TEXTS = [
    "",
    "a",
    "a\x00",
    "a\x00b",
    "ab",
    "B",
    "b",
    "é",
    "e\u0301",
    "ü",
    "中文",
    "中",
    "\U0001f600",
    "\uffff",
    "prompt\x00Document 1",
    "prompt\x00Document 10",
    "chat\x00[{...}]",
    "zz",
]


def rows(keys: list, lines: list[int], key_type: pa.DataType) -> pa.Table:
    return pa.table(
        {"key": pa.array(keys, key_type), "line": pa.array(lines, pa.int64())},
    )


def shuffled_rows(keys: list, key_type: pa.DataType, seed: int) -> pa.Table:
    """`keys` in a shuffled order, each row with its own line (1-based, in that order)."""
    shuffled = list(keys)
    random.Random(seed).shuffle(shuffled)
    return rows(shuffled, list(range(1, len(shuffled) + 1)), key_type)


def add_in_pieces(sorter: ExternalSort, table: pa.Table, piece: int) -> None:
    for offset in range(0, table.num_rows, piece):
        sorter.add(table.slice(offset, piece))


def pairs(tables: list[pa.Table]) -> list[tuple]:
    return [(r["key"], r["line"]) for table in tables for r in table.to_pylist()]


def expected_order(table: pa.Table) -> list[tuple]:
    """What a sort by (key, line) gives, by Python's own comparison (code points for text)."""
    return sorted(pairs([table]))


def test_input_that_fits_in_memory_is_sorted_there_and_spills_nothing():
    table = shuffled_rows(TEXTS * 50, pa.string(), seed=1)

    with ExternalSort(BY_KEY_THEN_LINE, memory_bytes=64 * 1024 * 1024) as sorter:
        add_in_pieces(sorter, table, 97)
        out = list(sorter.sorted_tables())
        assert sorter.runs == []

    assert sorter.rows == table.num_rows == 900
    assert pairs(out) == expected_order(table)
    assert all(t.num_rows <= BATCH_ROWS for t in out)


def test_spilled_runs_merge_to_every_row_once_in_order_and_are_removed_on_close(tmp_path):
    table = shuffled_rows(TEXTS * 50, pa.string(), seed=2)
    sorter = ExternalSort(BY_KEY_THEN_LINE, memory_bytes=1, spill_dir=str(tmp_path))
    add_in_pieces(sorter, table, 97)
    out = []
    for piece in sorter.sorted_tables():
        # The runs are read while merging: on disk until closed.
        assert all(path.is_file() for path in sorter.runs)
        out.append(piece)

    assert len(sorter.runs) == 10  # one run per piece added (900 rows, 97 at a time)
    assert all(path.parent.parent == tmp_path for path in sorter.runs)
    assert pairs(out) == expected_order(table)
    sorter.close()
    assert not any(path.exists() for path in sorter.runs)
    assert list(tmp_path.iterdir()) == []


def test_runs_that_fit_in_memory_are_sorted_beside_and_merged_there_spilling_nothing():
    # A run per piece added (run_bytes 1), all of them held: merged in memory, in order.
    table = shuffled_rows(TEXTS * 50, pa.string(), seed=8)

    with ExternalSort(BY_KEY_THEN_LINE, memory_bytes=1 << 30, run_bytes=1) as sorter:
        add_in_pieces(sorter, table, 97)
        out = list(sorter.sorted_tables())
        assert sorter.runs == []

    assert pairs(out) == expected_order(table)


def test_held_runs_are_spilled_with_the_rest_once_the_memory_bound_is_passed(tmp_path):
    table = shuffled_rows([f"key-{i % 13}" for i in range(1_300)], pa.string(), seed=9)
    piece = table.slice(0, 100).nbytes

    # Three pieces fit in memory as runs of their own; the fourth spills them and itself.
    sorter = ExternalSort(
        BY_KEY_THEN_LINE, memory_bytes=3 * piece, run_bytes=1, spill_dir=str(tmp_path)
    )
    with sorter:
        add_in_pieces(sorter, table, 100)
        out = pairs(list(sorter.sorted_tables()))
        assert len(sorter.runs) == 13
        assert all(path.is_file() for path in sorter.runs)

    assert out == expected_order(table)
    assert list(tmp_path.iterdir()) == []


def test_equal_keys_spread_over_many_runs_come_out_together_ordered_by_the_second_key():
    # Ten keys, each on 60 rows dealt over every run: the merge meets each key in all runs.
    table = shuffled_rows([f"key-{i % 10}" for i in range(600)], pa.string(), seed=3)

    with ExternalSort(BY_KEY_THEN_LINE, memory_bytes=1) as sorter:
        add_in_pieces(sorter, table, 50)
        out = pairs(list(sorter.sorted_tables()))
        assert len(sorter.runs) == 12

    assert out == expected_order(table)
    assert [key for key, _ in out] == [f"key-{i}" for i in range(10) for _ in range(60)]


def test_equal_keys_in_runs_longer_than_a_merge_batch_stay_ordered_by_the_second_key():
    count = 4 * BATCH_ROWS
    table = rows([7] * count, list(range(1, count + 1)), pa.int64())

    with ExternalSort(
        BY_KEY_THEN_LINE, memory_bytes=table.nbytes // 2, run_bytes=table.nbytes // 2
    ) as sorter:
        add_in_pieces(sorter, table, BATCH_ROWS)
        out = list(sorter.sorted_tables())
        assert len(sorter.runs) == 2  # each of 2 * BATCH_ROWS rows

    lines = [line for _, line in pairs(out)]
    assert sorted(lines) == list(range(1, count + 1))  # every row once, even so
    assert lines == list(range(1, count + 1))


@pytest.mark.parametrize("memory_bytes", [1, 1 << 30], ids=["spilled", "in_memory"])
def test_int64_keys_sort_numerically_negatives_and_extremes_included(memory_bytes):
    keys = [random.Random(4).randint(-(2**40), 2**40) for _ in range(2_000)]
    keys += [-(2**63), 2**63 - 1, 0, 0, -1]
    table = shuffled_rows(keys, pa.int64(), seed=5)

    with ExternalSort(BY_KEY_THEN_LINE, memory_bytes=memory_bytes) as sorter:
        add_in_pieces(sorter, table, 300)
        out = pairs(list(sorter.sorted_tables()))
        assert (len(sorter.runs) > 1) == (memory_bytes == 1)

    assert out == expected_order(table)
    assert out[0][0] == -(2**63) and out[-1][0] == 2**63 - 1


def test_a_spilled_sort_of_more_rows_than_a_merge_batch_hands_on_every_row_once_in_order():
    keys = [random.Random(6).randint(0, 5_000) for _ in range(3 * BATCH_ROWS)]
    table = shuffled_rows(keys, pa.int64(), seed=7)

    # Two runs of one and a half merge batches each: the merge reads each in two batches.
    with ExternalSort(
        BY_KEY_THEN_LINE, memory_bytes=table.nbytes // 2, run_bytes=table.nbytes // 2
    ) as sorter:
        add_in_pieces(sorter, table, BATCH_ROWS // 2)
        out = list(sorter.sorted_tables())
        assert len(sorter.runs) == 2

    assert [key for key, _ in pairs(out)] == sorted(keys)
    assert sorted(line for _, line in pairs(out)) == list(range(1, 3 * BATCH_ROWS + 1))


def test_no_rows_added_or_only_empty_tables_sort_to_nothing(tmp_path):
    with ExternalSort(BY_KEY_THEN_LINE, memory_bytes=1, spill_dir=str(tmp_path)) as nothing:
        assert list(nothing.sorted_tables()) == []
    with ExternalSort(BY_KEY_THEN_LINE, memory_bytes=1, spill_dir=str(tmp_path)) as empties:
        empties.add(rows([], [], pa.string()))
        empties.add(rows([], [], pa.string()))
        assert list(empties.sorted_tables()) == []
        assert (empties.rows, empties.runs) == (0, [])
    assert list(tmp_path.iterdir()) == []


def test_a_spill_that_cannot_be_written_says_where_and_is_a_storage_error(tmp_path):
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    table = rows(list(range(1000)), list(range(1000)), pa.int64())
    sort = ExternalSort(BY_KEY_THEN_LINE, memory_bytes=1, spill_dir=str(not_a_directory))
    with pytest.raises(SortSpillError, match="cannot spill 1,000 sorted rows") as raised:
        sort.add(table)
    assert isinstance(raised.value, StorageError)
    sort.close()
