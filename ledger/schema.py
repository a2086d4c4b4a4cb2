"""Arrow schema of the event table, the in-memory event chunk, and version constants.

One event is one row of the log. Events are produced a batch at a time as an
:class:`EventChunk` (one numpy array of sample ids plus a few scalars), so the hot path
never builds a Python object per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 2
"""Version of the on-disk layout: run.json, markers, segments and journals all carry it.

Version 2 (this one) changed only the commit marker: a small JSON header naming a
Parquet table of the ranks (:mod:`ledger.ranks`), with each rank's newest segment carried
forward. Version 1 markers held every rank's state and segment inline in JSON; they are
still read (:func:`ledger.commits.parse_marker_v1`), and the other files did not change.
"""

READABLE_VERSIONS = (1, 2)
"""Versions of run.json, attempt records and markers this ledger reads."""

DIGEST_BYTES = 32
"""Bytes of a batch's content digest (SHA-256, :mod:`ledger.digest`)."""

ORDER_ALGORITHM = "feistel-ff1-splitmix64-r6-v1"
"""Name of the epoch-order construction in :mod:`ledger.order`, recorded in run.json."""

# Event kinds. Strings, dictionary-encoded in Parquet, so SQL reads `kind = 'sample'`.
SAMPLE = "sample"
"""A sample in a batch handed to the training loop."""
SKIP = "skip"
"""A position of the epoch that no batch will serve (the tail dropped by ``drop_last``)."""
ROLLBACK = "rollback"
"""A position of a batch skipped on purpose (:meth:`ledger.DataLoader.skip`, loss-spike
recovery): the model never saw it. ``value`` is JSON ``{"reason": ...}``."""
SPAN = "span"
"""Tokens ``[token_start, token_end)`` of a sample, packed into a sequence of a batch."""
BUFFER = "buffer"
"""A sample held in a shuffle buffer at a commit (``position`` is its slot)."""
BATCH = "batch"
"""A batch handed to the training loop: ``digest`` is its content digest, no sample."""
ERROR = "error"
"""A sample whose loading raised, left out of its batch (``on_error="skip"``): ``value`` is
JSON ``{"type": ..., "message": ...}`` of the exception."""
KINDS = [SAMPLE, SKIP, SPAN, BUFFER, BATCH, ERROR, ROLLBACK]

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
        pa.field("token_start", pa.int64()),
        pa.field("token_end", pa.int64()),
        pa.field("length", pa.int64()),
        pa.field("value", pa.string()),
        pa.field("digest", pa.binary(DIGEST_BYTES)),
        pa.field("source", pa.dictionary(pa.int16(), pa.string())),
        pa.field("source_epoch", pa.int32()),
    ],
    metadata={b"ledger.schema_version": str(SCHEMA_VERSION).encode()},
)
"""Columns of every segment, in order:

- ``attempt`` int32: process lifetime of the run that consumed the event.
- ``rank`` int32: ``torch.distributed`` rank (0 without distributed).
- ``worker`` int32: DataLoader worker that loaded the batch, ``-1`` for the main process
  (streams: the logical worker, ``0..num_workers-1``).
- ``epoch`` int32: epoch of the event.
- ``batch`` int64: per-rank batch index, counted from 0 over the whole lineage (the
  training step when one batch is one step). For ``skip`` events: the batch that closed
  the epoch; for ``buffer`` events: the next batch at the commit.
- ``position`` int64: index in the epoch's global order (``buffer`` events: the slot).
- ``sample_id`` int64: stable id of the sample (map-style: the dataset index; streams:
  the global row number over the sorted file list); ``-1`` for ``batch`` events.
- ``kind`` string (dictionary-encoded): ``'sample'``, ``'skip'`` (a position of
  ``drop_last``'s tail), ``'rollback'`` (a position of a batch skipped on purpose, the
  skip events of loss-spike recovery: ``value`` = JSON ``{"reason": ...}``), ``'error'``
  (a sample whose loading raised, left out of its batch: ``value`` = JSON
  ``{"type": ..., "message": ...}``), ``'span'`` (tokens
  ``[token_start, token_end)`` of a sample packed into a sequence of the batch),
  ``'buffer'`` (a sample in a shuffle buffer at the commit) or ``'batch'`` (one per
  batch, after its samples: ``digest`` is the batch's content digest,
  :func:`ledger.digest.digest_bytes`; ``position`` is its last sample's).
- ``token_start``, ``token_end`` int64: the span's tokens (``span`` only, else null).
- ``length`` int64: the sample's length in tokens, EOS included (``span`` only).
- ``value`` string: JSON of the draws the transform recorded with ``ctx.record``, on the
  event that first consumed the sample; for ``error`` and ``rollback`` events, what
  happened (else null). Always JSON or null.
- ``digest`` fixed-size binary (32 bytes): the batch's content digest (``batch`` events
  only, else null). Logs written before this column existed lack it (Arrow readers fill
  nulls) and hold the digest as 64 hex characters in ``value`` instead.
- ``source`` string (dictionary-encoded): the name of the mixture source
  (:class:`ledger.Mixture`) the sample came from; ``sample_id`` is then the sample's
  index in that source. Null outside mixtures. Logs written before this column existed
  lack it (Arrow readers fill nulls).
- ``source_epoch`` int32: for a mixture of streams, the epoch of the sample's source that
  served it (its lane's, :mod:`ledger.stream.mixing`), which seeds its transform; ``epoch``
  stays the mixture epoch. Null elsewhere (a map-style source's epoch is the mixture
  epoch's function). Runs of equal values, so Parquet stores it in a few bytes per batch.
  Logs written before this column existed lack it (Arrow readers fill nulls); their
  stream mixtures' batches cannot be re-created.
"""

SOURCE_COLUMNS = EVENT_SCHEMA.names[:-1]
"""Columns of segments written before the ``source_epoch`` column."""

DIGEST_COLUMNS = EVENT_SCHEMA.names[:-2]
"""Columns of segments written before the ``source`` column."""

LEGACY_COLUMNS = EVENT_SCHEMA.names[:-3]
"""Columns of segments written before the ``digest`` column (schema version 1)."""

EVENT_COLUMN_SETS = (EVENT_SCHEMA.names, SOURCE_COLUMNS, DIGEST_COLUMNS, LEGACY_COLUMNS)
"""Every column list a readable segment may have, newest first."""


@dataclass(slots=True, eq=False)
class EventChunk:
    """Events of one batch (or one skipped tail, or one buffer snapshot), one kind.

    Treat it as immutable (it is not frozen only because a frozen dataclass's constructor
    costs ~3 µs more, once per batch).

    Attributes:
        kind: ``SAMPLE``, ``SKIP``, ``SPAN``, ``BUFFER``, ``BATCH``, ``ERROR`` or
            ``ROLLBACK``.
        epoch: epoch of every event.
        batch: per-rank batch index of every event.
        worker: worker id (``-1``: main process).
        position: position of the first event; event ``i`` sits at ``position + i``
            unless ``positions`` is given.
        sample_ids: ``int64`` array, shape ``(rows,)``.
        positions: ``int64`` array of positions, shape ``(rows,)``, or ``None``.
        token_start, token_end, length: ``int64`` arrays ``(rows,)`` for spans, or ``None``.
        values: per-row JSON strings (or ``None`` entries), or ``None`` for all null.
        digest: for a ``sample``/``span`` chunk, the batch's content digest (32 bytes):
            it becomes one ``batch`` event after the chunk's rows (so recording a batch
            and its digest is one chunk, one journal record). For a ``batch`` chunk, its
            own digest. ``None``: no digest.
        sources: ``int16`` array ``(rows,)``: each row's mixture source, an index into
            ``source_names``; ``None`` outside mixtures.
        source_names: the mixture's source names, when ``sources`` is given.
        source_epochs: ``int64`` array ``(rows,)``: each row's source epoch (a mixture of
            streams), or ``None``.
    """

    kind: str
    epoch: int
    batch: int
    worker: int
    position: int
    sample_ids: np.ndarray
    positions: np.ndarray | None = None
    token_start: np.ndarray | None = None
    token_end: np.ndarray | None = None
    length: np.ndarray | None = None
    values: list[str | None] | None = None
    digest: bytes | None = None
    sources: np.ndarray | None = None
    source_names: tuple[str, ...] | None = None
    source_epochs: np.ndarray | None = None

    @property
    def rows(self) -> int:
        """Rows this chunk becomes in a segment (a digest adds a ``batch`` row)."""
        extra = self.digest is not None and self.kind != BATCH
        return int(self.sample_ids.shape[0]) + int(extra)

    def split_digest(self) -> tuple[EventChunk, EventChunk | None]:
        """``(this chunk without its digest, the batch event carrying it or None)``."""
        if self.digest is None or self.kind == BATCH:
            return self, None
        if self.positions is not None and self.positions.size:
            last = int(self.positions[-1])
        else:
            last = self.position + max(int(self.sample_ids.shape[0]) - 1, 0)
        bare = EventChunk(
            self.kind,
            self.epoch,
            self.batch,
            self.worker,
            self.position,
            self.sample_ids,
            self.positions,
            self.token_start,
            self.token_end,
            self.length,
            self.values,
            None,
            self.sources,
            self.source_names,
            self.source_epochs,
        )
        return bare, batch_event(self.epoch, self.batch, self.worker, last, self.digest)


def batch_event(epoch: int, batch: int, worker: int, position: int, digest: bytes) -> EventChunk:
    """The ``batch`` event recording the content digest (32 bytes) of one batch.

    ``position`` is the position of the batch's last sample: the row repeats its
    predecessor's value, so the column's delta encoding stays at 1 bit per row (the
    first sample's position, 255 back, widened every value of the Parquet miniblock
    holding it to 9 bits; an outlier such as -1 would widen it more).
    """
    return EventChunk(BATCH, epoch, batch, worker, position, _NO_SAMPLE, digest=digest)


_NO_SAMPLE = np.array([-1], np.int64)
_NO_SAMPLE.flags.writeable = False
_KIND_INDEX = {kind: i for i, kind in enumerate(KINDS)}


def chunks_to_table(chunks: list[EventChunk], attempt: int, rank: int) -> pa.Table:
    """Concatenate event chunks into one Arrow table with :data:`EVENT_SCHEMA`.

    A ``sample``/``span`` chunk carrying a digest becomes its rows followed by one
    ``batch`` row (:meth:`EventChunk.split_digest`). Vectorised: one tuple of scalars per
    chunk, then whole-column numpy operations; no Python object per row (except the
    optional ``values`` strings).

    Args:
        chunks: the chunks, in consumption order.
        attempt: attempt number written in every row.
        rank: rank written in every row.

    Returns:
        A table of ``sum(chunk.rows)`` rows.
    """
    # kind, epoch, batch, worker, position, sample rows, has a batch row
    meta = np.array(
        [
            (
                _KIND_INDEX[c.kind],
                c.epoch,
                c.batch,
                c.worker,
                c.position,
                c.sample_ids.shape[0],
                c.digest is not None and c.kind != BATCH,
            )
            for c in chunks
        ],
        dtype=np.int64,
    ).reshape(len(chunks), 7)
    kind, epoch, batch, worker, position, n, extra = meta.T
    rows = n + extra
    total = int(rows.sum())
    n_samples = int(n.sum())
    first_row = np.cumsum(rows) - rows  # each chunk's first row
    first_sample = np.cumsum(n) - n  # each chunk's first row among the sample rows
    chunk_of = np.repeat(np.arange(len(chunks)), n)  # sample row -> chunk
    offset = np.arange(n_samples, dtype=np.int64) - first_sample[chunk_of]
    dest = first_row[chunk_of] + offset  # sample row -> row of the table
    extra_chunks = np.flatnonzero(extra)
    extra_rows = first_row[extra_chunks] + n[extra_chunks]  # the batch rows

    def cat(arrays: list[np.ndarray]) -> np.ndarray:
        if not arrays:
            return np.zeros(0, np.int64)
        return np.concatenate(arrays).astype(np.int64, copy=False)

    def spread(sample_values: np.ndarray, batch_values: np.ndarray | int) -> np.ndarray:
        """A column from its values on the sample rows and on the batch rows."""
        if not extra_chunks.size:
            return sample_values
        out = np.empty(total, sample_values.dtype)
        out[dest] = sample_values
        out[extra_rows] = batch_values
        return out

    if all(c.positions is None for c in chunks):
        sample_positions = position[chunk_of] + offset
    else:
        sample_positions = cat(
            [
                c.positions
                if c.positions is not None
                else c.position + np.arange(c.sample_ids.shape[0])
                for c in chunks
            ]
        )
    # A batch row sits at its last sample's position (see batch_event).
    last = first_sample[extra_chunks] + n[extra_chunks] - 1
    batch_positions = np.where(
        n[extra_chunks] > 0,
        sample_positions[np.maximum(last, 0)] if n_samples else 0,
        position[extra_chunks],
    )

    def per_row(values: np.ndarray, dtype: type) -> pa.Array:
        return pa.array(np.repeat(values, rows).astype(dtype, copy=False))

    def nullable(sample_values: np.ndarray, sample_valid: np.ndarray) -> pa.Array:
        valid = spread(sample_valid, False)
        return pa.array(spread(sample_values, 0), mask=~valid)

    def optional(name: str) -> pa.Array:
        parts = [getattr(c, name) for c in chunks]
        if all(p is None for p in parts):
            return pa.nulls(total, pa.int64())
        data = cat(
            [
                p if p is not None else np.zeros(c.sample_ids.shape[0])
                for p, c in zip(parts, chunks, strict=True)
            ]
        )
        valid = np.repeat(np.array([p is not None for p in parts]), n)
        return nullable(data, valid)

    if all(c.values is None for c in chunks):
        values = pa.nulls(total, pa.string())
    else:
        # A Python object per value, not per row: rows without one take a null index.
        index = np.full(n_samples, -1, np.int64)
        strings: list[str | None] = []
        for c, start in zip(chunks, first_sample.tolist(), strict=True):
            if c.values is not None:
                k = c.sample_ids.shape[0]
                index[start : start + k] = np.arange(len(strings), len(strings) + k)
                strings.extend(c.values)
        index = spread(index, -1)
        values = pa.array(strings, pa.string()).take(pa.array(index, mask=index < 0))
    with_digest = [i for i, c in enumerate(chunks) if c.digest is not None]
    if not with_digest:
        digests = pa.nulls(total, pa.binary(DIGEST_BYTES))
    else:
        # The digest sits on the chunk's batch row, or on a batch chunk's own row.
        chunk_rows = np.array(with_digest, np.int64)
        where = first_row[chunk_rows] + np.where(extra[chunk_rows] == 1, n[chunk_rows], 0)
        index = np.full(total, -1, np.int64)
        index[where] = np.arange(len(with_digest))
        raw = pa.array([chunks[i].digest for i in with_digest], pa.binary(DIGEST_BYTES))
        digests = raw.take(pa.array(index, mask=index < 0))
    if all(c.sources is None for c in chunks):
        sources = pa.nulls(total, EVENT_SCHEMA.field("source").type)
    else:
        sources = _sources(chunks, first_row, total)
    source_epochs = optional("source_epochs").cast(pa.int32())
    kinds = pa.DictionaryArray.from_arrays(
        pa.array(spread(np.repeat(kind, n).astype(np.int8), _KIND_INDEX[BATCH])),
        pa.array(KINDS),
    )
    return pa.table(
        {
            "attempt": pa.array(np.full(total, attempt, np.int32)),
            "rank": pa.array(np.full(total, rank, np.int32)),
            "worker": per_row(worker, np.int32),
            "epoch": per_row(epoch, np.int32),
            "batch": per_row(batch, np.int64),
            "position": pa.array(spread(sample_positions, batch_positions)),
            "sample_id": pa.array(spread(cat([c.sample_ids for c in chunks]), -1)),
            "kind": kinds,
            "token_start": optional("token_start"),
            "token_end": optional("token_end"),
            "length": optional("length"),
            "value": values,
            "digest": digests,
            "source": sources,
            "source_epoch": source_epochs,
        },
        schema=EVENT_SCHEMA,
    )


def _sources(chunks: list[EventChunk], first_row: np.ndarray, total: int) -> pa.Array:
    """The ``source`` column: each chunk's codes (on its sample rows; its batch row has
    none) mapped into one dictionary of names."""
    names: list[str] = []
    codes = np.full(total, -1, np.int16)
    for c, start in zip(chunks, first_row.tolist(), strict=True):
        if c.sources is not None and c.source_names is not None:
            remap = np.empty(len(c.source_names), np.int16)
            for i, name in enumerate(c.source_names):
                if name not in names:
                    names.append(name)
                remap[i] = names.index(name)
            codes[start : start + c.sources.size] = remap[c.sources]
    return pa.DictionaryArray.from_arrays(
        pa.array(codes, mask=codes < 0), pa.array(names, pa.string())
    )
