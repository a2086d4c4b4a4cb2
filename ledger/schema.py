"""Arrow schema of the event table, the in-memory event chunk, and version constants.

One event is one row of the log. Events are produced a batch at a time as an
:class:`EventChunk` (one numpy array of sample ids plus a few scalars), so the hot path
never builds a Python object per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1
"""Version of the on-disk layout: run.json, markers, segments and journals all carry it."""

ORDER_ALGORITHM = "feistel-ff1-splitmix64-r6-v1"
"""Name of the epoch-order construction in :mod:`ledger.order`, recorded in run.json."""

# Event kinds. Strings, dictionary-encoded in Parquet, so SQL reads `kind = 'sample'`.
SAMPLE = "sample"
"""A sample in a batch handed to the training loop."""
SKIP = "skip"
"""A position of the epoch that no batch will serve (the tail dropped by ``drop_last``)."""
KINDS = [SAMPLE, SKIP]

EVENT_SCHEMA = pa.schema(
    [
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("worker", pa.int32(), nullable=False),
        pa.field("epoch", pa.int32(), nullable=False),
        pa.field("batch", pa.int64(), nullable=False),
        pa.field("position", pa.int64(), nullable=False),
        pa.field("sample_id", pa.int64(), nullable=False),
        pa.field("kind", pa.dictionary(pa.int8(), pa.string()), nullable=False),
    ],
    metadata={b"ledger.schema_version": str(SCHEMA_VERSION).encode()},
)
"""Columns of every segment, in order:

- ``attempt`` int32: process lifetime of the run that consumed the event.
- ``rank`` int32: ``torch.distributed`` rank (0 without distributed).
- ``worker`` int32: DataLoader worker that loaded the batch, ``-1`` for the main process.
- ``epoch`` int32: epoch of the event.
- ``batch`` int64: per-rank batch index, counted from 0 over the whole lineage (the
  training step when one batch is one step). For ``skip`` events: the batch that closed
  the epoch.
- ``position`` int64: index in the epoch's global order.
- ``sample_id`` int64: stable id of the sample (map-style: the dataset index).
- ``kind`` string (dictionary-encoded): ``'sample'`` or ``'skip'``.
"""


@dataclass(frozen=True, slots=True)
class EventChunk:
    """Events of one batch (or one skipped tail): contiguous positions, one kind.

    Attributes:
        kind: ``SAMPLE`` or ``SKIP``.
        epoch: epoch of every event.
        batch: per-rank batch index of every event.
        worker: worker id (``-1``: main process).
        position: position of the first event; event ``i`` sits at ``position + i``.
        sample_ids: ``int64`` array, shape ``(rows,)``.
    """

    kind: str
    epoch: int
    batch: int
    worker: int
    position: int
    sample_ids: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.sample_ids.shape[0])


def chunks_to_table(chunks: list[EventChunk], attempt: int, rank: int) -> pa.Table:
    """Concatenate event chunks into one Arrow table with :data:`EVENT_SCHEMA`.

    Vectorised: one ``np.repeat`` per scalar column, no Python object per row.

    Args:
        chunks: the chunks, in consumption order.
        attempt: attempt number written in every row.
        rank: rank written in every row.

    Returns:
        A table of ``sum(chunk.rows)`` rows.
    """
    counts = np.fromiter((c.rows for c in chunks), dtype=np.int64, count=len(chunks))
    total = int(counts.sum())

    def rep(values: list[int], dtype: type) -> np.ndarray:
        return np.repeat(np.asarray(values, dtype=dtype), counts)

    starts = rep([c.position for c in chunks], np.int64)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    ids = (
        np.concatenate([c.sample_ids for c in chunks]).astype(np.int64, copy=False)
        if chunks
        else np.zeros(0, np.int64)
    )
    kinds = pa.DictionaryArray.from_arrays(
        pa.array(rep([KINDS.index(c.kind) for c in chunks], np.int8)), pa.array(KINDS)
    )
    return pa.table(
        {
            "attempt": pa.array(np.full(total, attempt, np.int32)),
            "rank": pa.array(np.full(total, rank, np.int32)),
            "worker": pa.array(rep([c.worker for c in chunks], np.int32)),
            "epoch": pa.array(rep([c.epoch for c in chunks], np.int32)),
            "batch": pa.array(rep([c.batch for c in chunks], np.int64)),
            "position": pa.array(starts + offsets),
            "sample_id": pa.array(ids),
            "kind": kinds,
        },
        schema=EVENT_SCHEMA,
    )
