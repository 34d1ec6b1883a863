"""The feed's fast paths give the same rows, bytes and counts as the plain ones: output rows
buffered as value tuples, input rows read back without the dataclass __init__, prefix
grouping by two stable sorts."""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.execution.shard_state import ShardState
from batchllm.input.formats.rows import INPUT_SCHEMA, InputRow, stored_row
from batchllm.input.shards import iter_shard_rows, store_input
from batchllm.output.parts import OUTPUT_SCHEMA, OutputBuffer, part_of
from batchllm.settings import get_settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage
from tests.support.inputs import source_of
from tests.support.output_rows import OutputRow, rows_to_table

CHOICES = [
    {"index": 0, "text": "a", "finish_reason": "stop", "completion_tokens": 3, "logprobs": None},
    {"index": 1, "text": "bb", "finish_reason": "length", "completion_tokens": 5, "logprobs": None},
]
LOGPROBS = [{"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}]}]


def buffered_and_plain() -> tuple[OutputBuffer, list[OutputRow]]:
    """One row of every kind, through the buffer and as OutputRows."""
    buffer = OutputBuffer()
    buffer.answer("a", 1, "hello", "stop", 4, 2, None, None, None, None)
    buffer.answer("b", 2, '{"x": 1}', "length", 6, 7, True, LOGPROBS, None, "my-lora")
    buffer.answer("c", 3, "a", "stop", 5, 3, False, None, CHOICES, None)
    buffer.embedding("d", 4, 9, [0.5, -1.0], None)
    buffer.embedding("e", 5, 3, None, [[0.25], [1.0]])
    buffer.failed("f", 6, "prompt is empty after tokenization", "invalid_prompt")
    buffer.failed("g", 7, "rejected by vLLM: no", "request_rejected", prompt_tokens=8)
    plain = [
        OutputRow("a", 1, "ok", "hello", "stop", 4, 2),
        OutputRow(
            "b", 2, "ok", '{"x": 1}', "length", 6, 7, None, True, LOGPROBS, adapter="my-lora"
        ),
        OutputRow("c", 3, "ok", "a", "stop", 5, 3, None, False, None, CHOICES),
        OutputRow("d", 4, "ok", prompt_tokens=9, embedding=[0.5, -1.0]),
        OutputRow("e", 5, "ok", prompt_tokens=3, embeddings=[[0.25], [1.0]]),
        OutputRow.failed("f", 6, "prompt is empty after tokenization", code="invalid_prompt"),
        OutputRow.failed("g", 7, "rejected by vLLM: no", 8, code="request_rejected"),
    ]
    return buffer, plain


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def test_buffered_rows_write_the_same_part_file_as_output_rows():
    buffer, plain = buffered_and_plain()

    part = part_of(buffer.take())

    assert len(buffer) == 0
    assert part.table.schema.equals(OUTPUT_SCHEMA, check_metadata=True)
    assert part.table.to_pylist() == rows_to_table(plain).to_pylist()
    assert part.table.to_pylist()[2]["choices"][1]["completion_tokens"] == 5
    assert parquet_bytes(part.table) == parquet_bytes(rows_to_table(plain))


def test_a_part_counts_its_rows_and_tokens_as_the_rows_do():
    buffer, plain = buffered_and_plain()

    part = part_of(buffer.take())

    assert (part.rows_ok, part.rows_failed) == (5, 2)
    assert part.prompt_tokens == 4 + 6 + 5 + 9 + 3 + 8 == sum(r.prompt_tokens or 0 for r in plain)
    # Row c has two samples: 3 + 5 tokens, not its first sample's 3.
    assert part.completion_tokens == 2 + 7 + 8 == sum(r.generated_tokens for r in plain)
    assert (part.structured_rows, part.structured_valid) == (2, 1)


def test_an_empty_part_is_an_empty_table_of_the_contract():
    part = part_of([])

    assert part.table.num_rows == 0
    assert part.table.schema.equals(OUTPUT_SCHEMA)
    assert part.rows_ok == part.rows_failed == part.prompt_tokens == part.completion_tokens == 0


def test_stored_row_is_the_row_the_dataclass_builds():
    names = [f.name for f in dataclasses.fields(InputRow)]
    values = (7, "id-7", "chat", None, '[{"role": "user", "content": "hi"}]', '{"seed": 1}')
    values += (None, None, [1, 2, 3])

    row = stored_row(*values)

    assert list(inspect.signature(stored_row).parameters) == names
    assert row == InputRow(*values)
    assert [getattr(row, name) for name in names] == list(values)


def test_a_shard_of_an_older_release_without_a_later_column_reads_it_as_null(tmp_path: Path):
    storage = Storage(str(tmp_path / "store"))
    old_schema = pa.schema([f for f in INPUT_SCHEMA if f.name != "inputs"])
    table = pa.table(
        {
            "line": [1, 2],
            "custom_id": ["a", "b"],
            "kind": ["prompt", "invalid"],
            "prompt": ["hi", None],
            "messages": [None, None],
            "sampling": ['{"seed": 3}', None],
            "error": [None, "field 'prompt': prompt is blank"],
        },
        schema=old_schema,
    )
    path = str(tmp_path / "store" / "shard-00000.parquet")
    storage.makedirs(str(tmp_path / "store"))
    pq.write_table(table, path)

    rows = list(iter_shard_rows(storage, path, with_token_ids=True))

    assert rows == [
        InputRow(1, "a", "prompt", prompt="hi", sampling='{"seed": 3}'),
        InputRow(2, "b", "invalid", error="field 'prompt': prompt is blank"),
    ]


def test_prefix_grouping_orders_rows_by_kind_then_prompt_and_skips_committed_lines(
    tmp_path: Path,
):
    lines = [
        {"custom_id": "p-b", "prompt": "b shared prefix"},
        {"custom_id": "c-z", "messages": [{"role": "user", "content": "z"}]},
        {"custom_id": "p-a", "prompt": "a shared prefix"},
        {"custom_id": "bad", "prompt": ""},
        {"custom_id": "c-a", "messages": [{"role": "user", "content": "a"}]},
        {"custom_id": "p-a2", "prompt": "a shared prefix"},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    storage = Storage(str(tmp_path / "store"))
    shard = store_input(
        source_of(source), storage, "job_feed", shard_size=100, settings=get_settings()
    ).shards[0]
    spec = JobSpec(model="m")

    def state(done: set[int]) -> ShardState:
        return ShardState(
            shard_id=1,
            index=0,
            job_id="job_feed",
            spec=spec,
            input_path=shard.path,
            out_dir=storage.output_dir("job_feed"),
            storage=storage,
            attempt=1,
            next_seq=0,
            done_lines=done,
        )

    stored = list(iter_shard_rows(storage, shard.path))
    grouped = [r.custom_id for r in state(set()).rows()]
    resumed = [r.custom_id for r in state({3, 6}).rows()]

    expected = sorted(stored, key=lambda r: (r.kind, r.messages or r.prompt or ""))
    assert grouped == [r.custom_id for r in expected]
    assert grouped == ["c-a", "c-z", "bad", "p-a", "p-a2", "p-b"]  # stable: p-a before p-a2
    assert resumed == ["c-a", "c-z", "bad", "p-b"]
