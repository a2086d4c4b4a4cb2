"""Arrow schema of the event table, the in-memory event chunk, and version constants.

One event is one row of the log. Events are produced a batch at a time as an
:class:`EventChunk` (one numpy array of sample ids plus a few scalars), so the hot path
never builds a Python object per sample.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
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
        from_order: the ids are the epoch's order at positions ``position, position + 1,
            ...`` (a map-style batch; :class:`ledger.order.EpochOrder`): the journal
            records their count instead of the ids (:mod:`ledger.journal`).
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
    from_order: bool = False

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
    chunk, then a few whole-column numpy operations; no Python object per row (except the
    optional ``values`` strings). Runs on the segment builder's background thread while
    the training loop holds the GIL between batches, so each column costs one or two numpy
    calls over the row group (a map-style batch of 256: 6.0-6.3 µs of the thread's CPU
    against 13.7-14.4 with a scatter and an Arrow ``take`` per column, load 8).

    Args:
        chunks: the chunks, in consumption order.
        attempt: attempt number written in every row.
        rank: rank written in every row.

    Returns:
        A table of ``sum(chunk.rows)`` rows.
    """
    if not chunks:
        return EVENT_SCHEMA.empty_table()
    # One tuple of the chunks' fields each (zip transposes the per-chunk tuples).
    fields = zip(*map(_FIELDS, chunks), strict=True)
    (kind_names, epochs, batches, workers, starts, ids, digests, explicit, token_start,
     token_end, length, values, sources, source_epochs) = fields  # fmt: skip
    codes = list(map(_KIND_INDEX.__getitem__, kind_names))
    kind = np.array(codes, np.int8)
    n = np.fromiter(map(len, ids), np.int64, len(chunks))  # sample rows per chunk
    extra = kind != _BATCH  # a digest on a sample/span chunk adds a batch row
    if digests.count(None):
        extra &= np.array([d is not None for d in digests])
    rows = n + extra
    total = int(rows.sum())
    first_row = np.cumsum(rows) - rows
    extra_chunks = np.flatnonzero(extra)
    batch_rows = first_row[extra_chunks] + n[extra_chunks]  # the rows a digest adds
    layout = _Layout(total, batch_rows, n, extra)

    # Positions: a chunk's rows count up from its start, unless it lists its own; a batch
    # row repeats its last sample's (see batch_event), its start if it has none.
    if _none(explicit) and layout.width:
        # 0, 1, ..., n - 1 and the batch row's n - 1 after each chunk's start.
        steps = np.minimum(np.arange(layout.width), max(layout.width - 2, 0))
        position = (np.array(starts, np.int64)[:, None] + steps).ravel()
    elif _none(explicit):
        position = np.arange(total, dtype=np.int64)
        position += np.repeat(np.array(starts, np.int64) - first_row, rows)
        position[batch_rows] -= n[extra_chunks] > 0
    else:
        parts = []
        for start, p, k, e in zip(starts, explicit, n.tolist(), extra.tolist(), strict=True):
            p = p if p is not None else start + np.arange(k, dtype=np.int64)
            parts.append(p)
            if e:
                parts.append(p[-1:] if k else np.array([start], np.int64))
        position = _cat(parts)
    sample_id = layout.spread(_cat(list(ids)), -1)
    if codes.count(codes[0]) == len(codes):
        kinds = np.full(total, codes[0], np.int8)
    else:
        kinds = np.repeat(kind, rows)
    kinds[batch_rows] = _BATCH

    def optional(parts: tuple[np.ndarray | None, ...], dtype: pa.DataType) -> pa.Array:
        if _none(parts):
            return _filled(total, None, dtype)
        zeros = np.zeros(int(n.max()), np.int64)
        data = _cat([p if p is not None else zeros[:k] for p, k in zip(parts, n, strict=True)])
        valid = np.repeat(np.array([p is not None for p in parts]), n)
        array = pa.array(layout.spread(data, 0), mask=~layout.spread(valid, False))
        return array.cast(dtype)

    if _none(values):
        value_column = _filled(total, None, pa.string())
    else:
        # A Python object per value, not per row: rows without one take a null index.
        index = np.full(int(n.sum()), -1, np.int64)
        strings: list[str | None] = []
        for vs, start in zip(values, (np.cumsum(n) - n).tolist(), strict=True):
            if vs is not None:
                index[start : start + len(vs)] = np.arange(len(strings), len(strings) + len(vs))
                strings.extend(vs)
        index = layout.spread(index, -1)
        value_column = pa.array(strings, pa.string()).take(pa.array(index, mask=index < 0))
    if _none(sources):
        source_column = _filled(total, None, EVENT_SCHEMA.field("source").type)
    else:
        source_column = _sources(chunks, first_row, total)
    return pa.Table.from_arrays(
        [
            _filled(total, attempt, pa.int32()),
            _filled(total, rank, pa.int32()),
            _per_chunk(workers, rows, pa.int32(), layout.width),
            _per_chunk(epochs, rows, pa.int32(), layout.width),
            _per_chunk(batches, rows, pa.int64(), layout.width),
            pa.array(position),
            pa.array(sample_id),
            pa.DictionaryArray.from_arrays(kinds, _KIND_DICTIONARY, safe=False),
            optional(token_start, pa.int64()),
            optional(token_end, pa.int64()),
            optional(length, pa.int64()),
            value_column,
            _digests(digests, first_row + np.where(extra, n, 0), total),
            source_column,
            optional(source_epochs, pa.int32()),
        ],
        schema=EVENT_SCHEMA,
    )


_FIELDS = operator.attrgetter(
    "kind", "epoch", "batch", "worker", "position", "sample_ids", "digest",
    "positions", "token_start", "token_end", "length", "values", "sources", "source_epochs",
)  # fmt: skip
_BATCH = _KIND_INDEX[BATCH]
_KIND_DICTIONARY = pa.array(KINDS)


class _Layout:
    """Where the rows a digest adds sit among a table's rows, to interleave a column's
    values on the sample rows with its values on those rows.

    Args:
        total: rows of the table.
        batch_rows: the rows a digest adds, ascending.
        n: sample rows of each chunk.
        extra: whether each chunk adds a batch row.
    """

    def __init__(self, total: int, batch_rows: np.ndarray, n: np.ndarray, extra: np.ndarray):
        self.total = total
        self.batch_rows = batch_rows
        # Every chunk n samples and a batch row (a map-style segment): a (chunks, n + 1)
        # grid, filled with two strided copies instead of a masked scatter.
        self.width = int(n[0]) + 1 if n.size and extra.all() and (n == n[0]).all() else 0

    def spread(self, sample_values: np.ndarray, batch_values: np.ndarray | int) -> np.ndarray:
        """A column from its values on the sample rows and on the batch rows."""
        if not self.batch_rows.size:
            return sample_values
        out = np.empty(self.total, sample_values.dtype)
        if self.width:
            grid = out.reshape(-1, self.width)
            grid[:, :-1] = sample_values.reshape(grid.shape[0], self.width - 1)
            grid[:, -1] = batch_values
        else:
            samples = np.ones(self.total, bool)
            samples[self.batch_rows] = False
            out[samples] = sample_values
            out[self.batch_rows] = batch_values
        return out


def _none(parts: tuple[object, ...]) -> bool:
    """Whether every chunk lacks this optional column (a map in C: a generator over 256
    chunks costs ~15 µs a column; ``tuple.count(None)`` would compare arrays with ``==``)."""
    return all(map(_IS_NONE, parts))


_IS_NONE = functools.partial(operator.is_, None)


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return np.zeros(0, np.int64)
    return np.concatenate(arrays).astype(np.int64, copy=False)


def _per_chunk(
    values: Sequence[int], rows: np.ndarray, dtype: pa.DataType, width: int = 0
) -> pa.Array:
    """A column holding each chunk's value on each of its ``rows`` (one array for every
    row group when every chunk has the same value, as a segment's epoch and worker mostly
    do; ``width``: every chunk has that many rows)."""
    if values.count(values[0]) == len(values):
        return _filled(int(rows.sum()), values[0], dtype)
    return pa.array(np.repeat(np.array(values, dtype.to_pandas_dtype()), width or rows))


def _filled(rows: int, value: int | None, dtype: pa.DataType) -> pa.Array:
    """A column of ``rows`` times ``value`` (``None``: nulls).

    Arrow arrays are immutable, so the row groups of a segment, all of the same size,
    share one (each costs a memset of up to 0.5 MB otherwise, ~9 columns of a map-style
    row group). Only columns of up to :data:`_SHARED_ROWS` rows are kept (at most 16,
    ~8 MB): a whole segment's or a journal's table is made once, and holding its columns
    would hold their memory.
    """
    if rows <= _SHARED_ROWS:
        return _shared(rows, value, dtype)
    return _fill(rows, value, dtype)


def _fill(rows: int, value: int | None, dtype: pa.DataType) -> pa.Array:
    if value is None:
        return pa.nulls(rows, dtype)
    return pa.array(np.full(rows, value, dtype.to_pandas_dtype()))


_shared = functools.lru_cache(maxsize=16)(_fill)
_SHARED_ROWS = 1 << 17
"""Rows of the largest column :func:`_filled` keeps: a segment builder's row group
(:data:`ledger.segments.ROW_GROUP_ROWS` events and their batch rows) fits."""


def _digests(digests: tuple[bytes | None, ...], rows: np.ndarray, total: int) -> pa.Array:
    """The ``digest`` column: each chunk's digest on ``rows[i]`` (its batch row, or a
    batch chunk's own row), null elsewhere; built from its buffers (an Arrow ``take`` of
    the digests cost ~4x as much).

    The null rows' 32 bytes are left as allocated, not zeroed (2 MB a map-style row group,
    0.3 µs a batch): Arrow leaves a null slot's value undefined, and Parquet's writer
    skips null slots, so the segment's bytes do not depend on them
    (``test_digest_column_ignores_null_slots``)."""
    present = [d for d in digests if d is not None]
    if not present:
        return _filled(total, None, pa.binary(DIGEST_BYTES))
    where = rows[np.array([d is not None for d in digests])]
    valid = np.zeros(total, bool)
    valid[where] = True
    data = np.empty((total, DIGEST_BYTES), np.uint8)
    data[where] = np.frombuffer(b"".join(present), np.uint8).reshape(-1, DIGEST_BYTES)
    bitmap = np.packbits(valid, bitorder="little")
    return pa.Array.from_buffers(
        pa.binary(DIGEST_BYTES),
        total,
        [pa.py_buffer(bitmap), pa.py_buffer(data)],
        null_count=total - len(present),
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
