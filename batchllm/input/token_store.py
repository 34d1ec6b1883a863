"""Token ids of a job's prompts, kept beside its input shards so each prompt is tokenized once.

The context-sizing pass (engine/sizing.py) has to render and tokenize every prompt to find the
longest; it stores the ids it computed in `tokens-NNNNN.parquet` next to `shard-NNNNN.parquet`
(same rows, same order), and the feed reads them back instead of tokenizing the row again.
Tokenization was more than half of a job's own work; doing it twice was the largest waste.

Only what a plain prompt needs is stored: rows whose preparation failed (the feed prepares
them again and reports why) and list embedding inputs get a null and are prepared in the feed.
A job given `--max-model-len` has no sizing pass and no token file: its feed tokenizes, once.
The ids come from the job's own model tokenizer and chat template, which the engine uses too.
"""

from __future__ import annotations

import io
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.storage import Storage, token_file_of

log = logging.getLogger(__name__)

TOKENS_SCHEMA = pa.schema(
    [
        pa.field("line", pa.int64(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32())),
    ]
)


def token_path(input_path: str) -> str:
    """The token file of an input shard (its name: storage.token_file_of)."""
    return token_file_of(input_path)


class TokenFileWriter:
    """Collects one shard's token ids, a batch at a time, and stores them whole on close
    (an object store has no append; a shard is bounded by --shard-size)."""

    def __init__(self, storage: Storage, input_path: str) -> None:
        self.storage, self.path = storage, token_path(input_path)
        self._sink = io.BytesIO()
        # Token ids compress well and are read back once; speed matters more than size here.
        self._writer = pq.ParquetWriter(self._sink, TOKENS_SCHEMA, compression="lz4")

    def write(self, lines: list[int], token_ids: Sequence[list[int] | object | None]) -> None:
        """Store each line's prompt ids; anything but a list of ids (None, or a prompt with
        images, whose images the feed opens again) is stored as null."""
        if lines:
            kept = [ids if isinstance(ids, list) else None for ids in token_ids]
            table = pa.table([pa.array(lines, pa.int64()), _list_array(kept)], schema=TOKENS_SCHEMA)
            self._writer.write_table(table)

    def close(self) -> None:
        self._writer.close()
        self.storage.write_bytes(self.path, self._sink.getvalue())


def _list_array(token_ids: list[list[int] | None]) -> pa.Array:
    """A list<int32> array built from one flat buffer: pyarrow converting the nested lists
    element by element cost four times as much."""
    lengths = [len(ids) if ids is not None else 0 for ids in token_ids]
    offsets = np.zeros(len(token_ids) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(
        itertools.chain.from_iterable(ids for ids in token_ids if ids is not None),
        dtype=np.int32,
        count=int(offsets[-1]),
    )
    missing = [ids is None for ids in token_ids]
    mask = pa.array(missing, pa.bool_()) if any(missing) else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), mask=mask)


def token_lists(column: Any) -> list[list[int] | None]:
    """A batch's token ids as Python lists (what the engine takes), sliced from the flat
    buffer: to_pylist builds each int object through pyarrow's scalar path, slower."""
    if column.null_count:
        return list(column.to_pylist())
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy()
    return [values[a:b].tolist() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


def iter_token_batches(storage: Storage, input_path: str, batch_rows: int) -> Iterator[Any] | None:
    """The shard's token file as record batches of `batch_rows` rows, or None when there is
    none (no sizing pass) or it cannot be read (then the feed tokenizes, as without one)."""
    path = token_path(input_path)
    try:
        if not storage.exists(path):
            return None
        source = storage.fs.open_input_file(path)
        parquet = pq.ParquetFile(source)
    except (OSError, ValueError) as exc:  # pyarrow: ArrowIOError, ArrowInvalid (not Parquet)
        log.warning("token ids of %s unreadable, tokenizing instead: %s", input_path, exc)
        return None

    def batches() -> Iterator[Any]:
        with source:
            try:
                yield from parquet.iter_batches(batch_size=batch_rows)
            except (OSError, ValueError) as exc:
                # The caller finds the batch missing and tokenizes the rest of the shard.
                log.warning("token ids of %s unreadable, tokenizing instead: %s", input_path, exc)

    return batches()
