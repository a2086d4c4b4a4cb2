"""Parquet segments: one immutable file of events per rank per commit.

Encodings keep the log near its information content. ``sample_id`` is
``BYTE_STREAM_SPLIT`` in pages of up to 2**16 rows, then zstd at level 3: a shuffled id
below N has ~log2(N) bits, its low bytes are random and stored as they are, its high
bytes are near-constant and fold to almost nothing, so an id costs about log2(N)/8 bytes
(``DELTA_BINARY_PACKED`` costs ~log2(2N) bits, the span of a delta between two random
ids). Byte streams only separate in zstd's 128 KB blocks when a page holds 2**16 rows
(each stream is then 64 KB), so a segment of fewer than :data:`ROW_GROUP_ROWS` events
(a commit every few hundred batches) keeps ``DELTA_BINARY_PACKED``, which is smaller
there. ``batch`` and ``position`` are ``DELTA_BINARY_PACKED`` (they delta to ~0 bits),
the columns constant over a batch are plain, all then zstd; ``kind`` and ``source`` are
dictionary-encoded. Measured by ``tools/bench.py`` (N = 10**6, batch 256, a commit every
1,000 batches): 1.097 x log2(N)/8 bytes per event with digests on, 1.036 x without.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ledger.errors import LedgerError, LogCorrupted
from ledger.schema import EVENT_SCHEMA, EventChunk, chunks_to_table
from ledger.store import Fetched, Store, background, sha256

ROW_GROUP_ROWS = 1 << 16
"""Rows per Parquet row group: the unit encoded in the background, and read on resume."""

# Columns constant over a batch (attempt, rank, worker, epoch) stay PLAIN: zstd folds
# their runs to the same size, at ~25% less encoding CPU than the delta encoder (and than
# dictionary encoding, measured at 39.7 vs 32.2 µs per batch of 256 for the same bytes).
_DELTA = {name: "DELTA_BINARY_PACKED" for name in ("batch", "position")}


def writer_options(rows: int) -> dict[str, Any]:
    """Encoding options of :class:`pyarrow.parquet.ParquetWriter` for a file of events.

    Args:
        rows: events the file is meant to hold: from :data:`ROW_GROUP_ROWS` on,
            ``sample_id`` is ``BYTE_STREAM_SPLIT`` (see the module's docstring), below it
            ``DELTA_BINARY_PACKED``.

    Returns:
        ``column_encoding``, ``compression_level``, ``max_rows_per_page`` and
        ``data_page_size`` (pages of :data:`ROW_GROUP_ROWS` rows: a page of fewer rows
        makes zstd mix the ids' random and near-constant byte streams in one block, and
        each page costs a header in every column).
    """
    split = rows >= ROW_GROUP_ROWS
    return {
        "column_encoding": {
            **_DELTA,
            "sample_id": "BYTE_STREAM_SPLIT" if split else "DELTA_BINARY_PACKED",
        },
        # Level 3 finds the runs of the batch events' -1 (eight 0xff bytes) in the
        # near-constant streams: 2.544 vs 2.576 bytes per id at level 1, same CPU.
        "compression_level": {"sample_id": 3} if split else None,
        "max_rows_per_page": ROW_GROUP_ROWS,
        "data_page_size": 1 << 22,  # 2**16 rows of any fixed-width column fit
    }


# Min/max statistics where a reader prunes or checks with them: resume finds the final
# batch's row group by ``batch`` (:func:`ledger.replay.replay`), ``verify`` checks
# ``attempt`` and ``rank``, and queries filter on the others. The digest's, the spans' and
# ``value``'s min/max answer no query; they cost 0.0085 bytes per event at batch 256.
_STATISTICS = ["attempt", "rank", "worker", "epoch", "batch", "position", "sample_id", "kind"]


def segment_path(attempt: int, rank: int, step: int) -> str:
    """Relative path of the segment of ``rank`` at commit ``step`` of ``attempt``."""
    return f"events/attempt={attempt}/rank={rank}/seg-{step:012d}.parquet"


def orphans(store: Store, named: set[str]) -> list[str]:
    """Segment files that no commit marker names: orphans of a commit that failed or
    crashed between the segment PUT and the marker.

    Args:
        store: the log root.
        named: relative paths of the segments the markers name.

    Returns:
        Relative paths of the orphans, sorted. Replay never reads them (it finds segments
        through the markers only); audits may report them.
    """
    found = store.glob("events/attempt=*/rank=*/seg-*.parquet")
    return [rel for rel in found if rel not in named]


def _writer(sink: pa.BufferOutputStream, rows: int) -> pq.ParquetWriter:
    return pq.ParquetWriter(
        sink,
        EVENT_SCHEMA,
        compression="zstd",
        use_dictionary=["kind", "source"],  # a mixture names few sources
        write_statistics=_STATISTICS,
        write_batch_size=ROW_GROUP_ROWS,  # the same bytes as the default 1,024, ~8% less CPU
        **writer_options(rows),
    )


def encode(table: pa.Table) -> bytes:
    """Serialise an event table to Parquet bytes with the log's encodings.

    Args:
        table: rows with :data:`ledger.schema.EVENT_SCHEMA` (``kind`` may be plain strings).

    Returns:
        The Parquet file's bytes.
    """
    sink = pa.BufferOutputStream()
    with _writer(sink, table.num_rows) as writer:
        _write_tail(writer, table.cast(EVENT_SCHEMA))
    return bytes(sink.getvalue().to_pybytes())


def _write_tail(writer: pq.ParquetWriter, table: pa.Table) -> None:
    """Write the events, the final batch's in a row group of their own.

    A resume reads only the final batch of a rank's newest segment
    (:func:`ledger.replay.replay`): its own row group, found through the ``batch``
    column's statistics, decodes a few hundred rows instead of up to
    :data:`ROW_GROUP_ROWS`. Costs one row group's metadata (~0.5 KB) per segment.
    """
    if table.num_rows == 0:
        writer.write_table(table, row_group_size=1)
        return
    batches = table["batch"].to_numpy()
    split = int(np.searchsorted(batches, batches[-1], side="left"))
    if split and not np.all(batches[split:] == batches[-1]):
        split = 0  # batches out of order (cannot happen for a segment): one layout only
    for part in (table.slice(0, split), table.slice(split)):
        if part.num_rows:
            writer.write_table(part, row_group_size=ROW_GROUP_ROWS)


class SegmentBuilder:
    """Encodes a segment while events arrive, so a commit only encodes the tail.

    Every :data:`ROW_GROUP_ROWS` appended rows become one row group, encoded on a
    background thread (Arrow's Parquet writer releases the GIL), so on a multi-core
    machine the encoding overlaps with training. :meth:`finish` encodes what is left and
    returns the file's bytes. The builder is an optimisation only: the caller keeps the
    chunks until the commit succeeds, and can always re-encode them with :func:`encode`.

    Args:
        attempt: attempt written in every row.
        rank: rank written in every row.
    """

    def __init__(self, attempt: int, rank: int) -> None:
        self.attempt = attempt
        self.rank = rank
        self._sink = pa.BufferOutputStream()
        # Made with the first row group, when the segment's size is known to be at least
        # ROW_GROUP_ROWS, or at finish (a smaller segment): it picks the encodings.
        self._writer: pq.ParquetWriter | None = None
        self._chunks: list[EventChunk] = []
        self._rows = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ledger-segment")
        self._pending: list[Future[None]] = []

    def add(self, chunk: EventChunk) -> None:
        """Add one batch's events (cheap: a list append; encoding happens per row group)."""
        self._chunks.append(chunk)
        self._rows += chunk.rows
        if self._rows >= ROW_GROUP_ROWS:
            chunks, self._chunks, self._rows = self._chunks, [], 0
            self._pending.append(self._pool.submit(self._write, chunks))

    def _write(self, chunks: list[EventChunk]) -> None:
        table = chunks_to_table(chunks, self.attempt, self.rank)
        if self._writer is None:
            self._writer = _writer(self._sink, table.num_rows)
        self._writer.write_table(table, row_group_size=max(table.num_rows, 1))

    def finish(self) -> bytes:
        """Encode the remaining events and return the whole Parquet file.

        Raises:
            Exception: whatever the background encoding raised; the builder is then
                unusable and the caller re-encodes its chunks with :func:`encode`.
        """
        try:
            for future in self._pending:
                future.result()
            if self._writer is None:
                self._writer = _writer(self._sink, self._rows)
            if self._chunks:
                _write_tail(self._writer, chunks_to_table(self._chunks, self.attempt, self.rank))
            self._writer.close()
            return bytes(self._sink.getvalue().to_pybytes())
        finally:
            self._pool.shutdown(wait=True)


def open_segment(
    store: Store,
    rel: str,
    *,
    rows: int | None = None,
    checksum: str | None = None,
    size: int | None = None,
    fetched: Fetched | None = None,
) -> pq.ParquetFile:
    """Open a segment for reading, checking its checksum and row count when given.

    Args:
        store: the log's store.
        rel: relative path of the segment.
        rows: expected number of rows (from the commit marker), or ``None``.
        checksum: expected hex SHA-256 of the file, or ``None`` to skip the check.
        size: expected size in bytes, or ``None``.
        fetched: files the caller read already (:meth:`Store.read_many`), by path.

    A segment retired by a compaction is read from the compacted file that holds it
    (:func:`open_events`), and its rows encoded as a Parquet file of their own.

    Returns:
        The Parquet file, read from memory (row groups can be read one by one).

    Raises:
        LogCorrupted: if the file is missing, unreadable, or differs from the marker.
    """
    found = open_events(store, rel, rows=rows, checksum=checksum, size=size, fetched=fetched)
    if isinstance(found, pa.Table):  # a compacted segment's rows, as a file of their own
        return pq.ParquetFile(pa.BufferReader(encode(found)))
    return found


class CheckedLater:
    """A segment read and hashed on a background thread, for a resume, which decodes
    only its final batch (:func:`ledger.replay.replay`).

    The thread reads the file, hands the bytes on (:meth:`file` parses them in the
    caller's thread) and then computes their SHA-256 (~1 ms per 1.4 MB; hashlib and
    file reads release the GIL), so reading and hashing overlap with the caller's work
    on another core. The bytes decoded are the bytes hashed. The caller must call
    :meth:`confirm` before it trusts anything it read, and also when reading raised,
    so that an altered file is named as such.

    With ``keep=False`` (a caller that needs only the check, :meth:`check`) a local file
    is hashed through a read-only memory map instead: no copy of it is made, which
    slowed the caller's numpy work on the other core by ~0.1 ms per 1.4 MB.

    Args:
        store: the log's store.
        rel: relative path of the segment.
        rows: expected number of rows (from the commit marker), or ``None``.
        checksum: expected hex SHA-256 of the file, or ``None`` to skip the check.
        keep: ``False``: the caller will not ask for :meth:`file`.
    """

    def __init__(
        self,
        store: Store,
        rel: str,
        *,
        rows: int | None,
        checksum: str | None,
        keep: bool = True,
    ) -> None:
        self.store = store
        self.rel = rel
        self.rows = rows
        self.checksum = checksum
        self._data: Future[bytes | pa.Table | None] = Future()
        work = self._read_and_hash if keep else self._hash_mapped
        self._hash = background("checksum").submit(work)

    def _hash_mapped(self) -> str | None:
        path = self.store.local_path(self.rel)
        if path is None or self.checksum is None:
            return self._read_and_hash()
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except FileNotFoundError:  # perhaps retired by a compaction: read its piece
            return self._read_and_hash()
        except OSError as e:
            self._data.set_exception(LogCorrupted(f"segment {self.store.full(self.rel)}: {e}"))
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                found = sha256(b"")
            else:
                with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
                    found = hashlib.sha256(mapped).hexdigest()
        except OSError as e:
            self._data.set_exception(LogCorrupted(f"segment {self.store.full(self.rel)}: {e}"))
            return None
        finally:
            os.close(fd)
        self._data.set_result(None)
        return found

    def _read_and_hash(self) -> str | None:
        try:
            data = _read(self.store, self.rel, self.rows, self.checksum)
        except BaseException as e:
            self._data.set_exception(e)
            return None
        self._data.set_result(data)
        if isinstance(data, pa.Table) or self.checksum is None:
            return None  # a compacted piece was checked as it was read
        return sha256(data)

    def file(self) -> pq.ParquetFile:
        """The segment, parsed from the bytes being hashed (waits for the read).

        Raises:
            LogCorrupted: if the file is missing, or does not parse (after :meth:`confirm`:
                an altered file is named as such rather than as unreadable).
        """
        data = self._data.result()
        if data is None:
            raise LedgerError("CheckedLater(keep=False) keeps no bytes to parse")
        if isinstance(data, pa.Table):  # a compacted segment's rows, checked as read
            return pq.ParquetFile(pa.BufferReader(encode(data)))
        try:
            return _parse(self.store, self.rel, data, self.rows, _CODES)
        except LogCorrupted:
            self.confirm()
            raise

    def confirm(self) -> None:
        """Wait for the hash; a no-op without a checksum.

        Raises:
            LogCorrupted: if the file's SHA-256 differs from the marker's, or it is missing.
        """
        found = self._hash.result()
        if found is not None and self.checksum is not None:
            _check_checksum(self.store, self.rel, found, self.checksum)

    def check(self) -> None:
        """:meth:`confirm`, and also raise what reading the file raised, for a caller that
        never asked for :meth:`file` (a resume checked by the marker's fingerprint).

        Raises:
            LogCorrupted: if the file is missing, unreadable, or its SHA-256 differs from
                the marker's.
        """
        self.confirm()
        self._data.result()


def open_events(
    store: Store,
    rel: str,
    *,
    rows: int | None = None,
    checksum: str | None = None,
    size: int | None = None,
    fetched: Fetched | None = None,
) -> pq.ParquetFile | pa.Table:
    """A segment's events, checked as :func:`open_segment` checks them, without making a
    Parquet file of a compacted one: the segment's file, or for a segment retired by a
    compaction, its rows as a table with the columns of :data:`ledger.schema.EVENT_SCHEMA`
    (:func:`ledger.compaction.piece_events`; encoding each piece again as a file of its
    own cost ~1 ms, which a command that walks a compacted history of 10^4 commits paid
    for each).

    Raises:
        LogCorrupted: if the segment is missing, unreadable, or differs from the marker.
    """
    data = _read(store, rel, rows, checksum, fetched)
    if isinstance(data, pa.Table):
        return data
    _check_size(store, rel, data, size)
    if checksum is not None:
        _check_checksum(store, rel, sha256(data), checksum)
    return _parse(store, rel, data, rows)


def _read(
    store: Store,
    rel: str,
    rows: int | None,
    checksum: str | None,
    fetched: Fetched | None = None,
) -> bytes | pa.Table:
    """The segment's bytes (from ``fetched`` when it holds them), or (retired by a
    compaction) its checked rows (:func:`ledger.compaction.piece_events`)."""
    try:
        return store.read_known(rel, fetched)
    except FileNotFoundError as e:
        from ledger.compaction import piece_events, pieces  # compaction imports this module

        piece = pieces(store).get(rel)
        if piece is not None:
            return piece_events(store, piece, rel, rows, checksum)
        raise LogCorrupted(f"segment {store.full(rel)} named by a commit marker is missing") from e


def _check_size(store: Store, rel: str, data: bytes, size: int | None) -> None:
    if size is not None and len(data) != size:
        raise LogCorrupted(
            f"segment {store.full(rel)} has {len(data)} bytes, its commit marker says {size}: "
            "the file was altered after commit"
        )


def _check_checksum(store: Store, rel: str, found: str, checksum: str) -> None:
    if found != checksum:
        raise LogCorrupted(
            f"segment {store.full(rel)} has sha256 {found}, its commit marker says {checksum}: "
            "the file was altered after commit"
        )


# Read as the dictionary codes stored (every segment has the column): under the Arrow
# schema's int8 codes the decoded strings are encoded again, ~60 us more for a batch.
_CODES = ["kind"]


def _parse(
    store: Store, rel: str, data: bytes, rows: int | None, read_dictionary: list[str] | None = None
) -> pq.ParquetFile:
    where = store.full(rel)
    try:
        pf = pq.ParquetFile(pa.BufferReader(data), read_dictionary=read_dictionary)
        num_rows = pf.metadata.num_rows
    except (pa.ArrowException, OSError, ValueError) as e:  # ValueError: a mangled footer
        raise LogCorrupted(f"segment {where} is not a readable Parquet file: {e}") from e
    if rows is not None and num_rows != rows:
        raise LogCorrupted(f"segment {where} has {num_rows} rows, its marker says {rows}")
    return pf


def read(
    store: Store,
    rel: str,
    *,
    rows: int | None = None,
    checksum: str | None = None,
    columns: list[str] | None = None,
    fetched: Fetched | None = None,
) -> pa.Table:
    """Read a whole segment (see :func:`open_segment` for the checks, the errors and
    ``fetched``).

    Returns:
        The events, in the order they were written.
    """
    pf = open_segment(store, rel, rows=rows, checksum=checksum, fetched=fetched)
    try:
        return pf.read(columns=columns)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise LogCorrupted(f"segment {store.full(rel)} is not a readable Parquet file: {e}") from e
