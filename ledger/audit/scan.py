"""One pass over a log's segments: per-epoch coverage and duplicates, per-segment counts.

Counting distinct sample ids is the expensive part of an audit: DuckDB's
``COUNT(DISTINCT)`` over 10^8 events hashes every row (about 15 s and 5 GB here). This
module reads only the ``epoch``, ``kind``, ``sample_id`` and ``token_start`` columns of
each segment (decoded by Arrow on a thread pool, several segments at a time) and marks
ids in one byte-per-id numpy bitmap per epoch: ``seen[ids] = True``, then one
``count_nonzero``. That is exact and bounded by the dataset length, not the log length;
``tools/bench.py --audit`` measures it on a log of 10^8 events.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from ledger.audit.views import arrow_filesystem
from ledger.commits import Commit, SegmentRef
from ledger.compaction import Piece, list_compactions, pieces
from ledger.errors import LogCorrupted
from ledger.schema import EVENT_SCHEMA, SAMPLE, SKIP, SPAN
from ledger.segments import open_segment
from ledger.store import Store, sha256

_COLUMNS = ["epoch", "kind", "sample_id", "token_start", "position"]
_MAX_BITMAP = 1 << 33
"""Largest id range (bytes) counted with a bitmap; beyond it, ids are sorted instead."""

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called after each segment is counted."""


@dataclass(slots=True)
class EpochCounts:
    """Counts of one epoch over a set of commits.

    Attributes:
        epoch: the epoch.
        samples: consumed events (``'sample'`` events and first spans of packed samples).
        distinct: distinct sample ids among them.
        skipped: ``'skip'`` events.
        skipped_distinct: distinct ids among them.
        covered: distinct ids consumed or skipped.
    """

    epoch: int
    samples: int = 0
    distinct: int = 0
    skipped: int = 0
    skipped_distinct: int = 0
    covered: int = 0

    @property
    def duplicates(self) -> int:
        """Consumptions of an id already consumed earlier in the epoch."""
        return self.samples - self.distinct


@dataclass(frozen=True, slots=True)
class SegmentCounts:
    """Counts of one segment.

    Attributes:
        commit_id: the commit whose marker names the segment.
        step: that commit's step.
        attempt: its attempt.
        rank: the rank that wrote the segment.
        events: rows (all kinds).
        samples: consumed events.
        path: the segment's path relative to the root.
        last_epoch: largest epoch of its consumed events (-1: none, or not counted).
    """

    commit_id: str
    step: int
    attempt: int
    rank: int
    events: int
    samples: int
    path: str = ""
    last_epoch: int = -1


@dataclass(slots=True)
class ScanResult:
    """What :func:`scan` counted: per epoch (counted commits only) and per segment."""

    epochs: dict[int, EpochCounts] = field(default_factory=dict)
    segments: list[SegmentCounts] = field(default_factory=list)
    packed: bool = False


class _Ids:
    """The ids of one epoch: a byte per possible id, or (for huge ranges) a list to sort."""

    def __init__(self, size: int, bitmap: bool = True) -> None:
        self.size = size
        # A byte per id: numpy has no bit-level scatter, and bytes keep it one pass. Few
        # ids (the skips of an epoch) are kept as arrays instead: no 'size' bytes to touch.
        self.bitmap = np.zeros(size, np.bool_) if bitmap and size <= _MAX_BITMAP else None
        self.parts: list[np.ndarray] = []

    def add(self, ids: np.ndarray, where: str) -> None:
        if ids.size == 0:
            return
        try:
            if int(ids.min()) < 0:  # numpy would wrap a negative index around
                raise IndexError
            if self.bitmap is not None:
                self.bitmap[ids] = True  # raises IndexError for an id >= size
            elif int(ids.max()) >= self.size:
                raise IndexError
            else:
                self.parts.append(np.unique(ids))
        except IndexError:
            bad = ids[(ids < 0) | (ids >= self.size)][0]
            raise LogCorrupted(
                f"{where} holds sample id {bad}, outside the dataset's [0, {self.size})"
            ) from None

    def count(self) -> int:
        if self.bitmap is not None:
            return int(np.count_nonzero(self.bitmap))
        return int(self._unique().size)

    def union_count(self, other: _Ids) -> int:
        """Distinct ids in this set or ``other`` (of the same size)."""
        if self.bitmap is not None and other.bitmap is None:
            extra = other._unique()
            return self.count() + int(np.count_nonzero(~self.bitmap[extra]))
        return int(np.union1d(self._unique(), other._unique()).size)

    def _unique(self) -> np.ndarray:
        if self.bitmap is not None:
            return np.flatnonzero(self.bitmap)
        return np.unique(np.concatenate(self.parts)) if self.parts else np.zeros(0, np.int64)


_SCHEMA = pa.schema([EVENT_SCHEMA.field(c) for c in _COLUMNS])


def _consumed(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """Masks of a batch's consumed and skipped rows (``bool (rows,)`` each)."""
    kind = batch.column("kind")
    names = kind.dictionary.to_pylist()
    idx = kind.indices.to_numpy(zero_copy_only=False)
    none = np.zeros(len(idx), np.bool_)
    consumed = idx == names.index(SAMPLE) if SAMPLE in names else none
    skipped = idx == names.index(SKIP) if SKIP in names else none
    if SPAN in names and "token_start" in batch.schema.names:
        span = idx == names.index(SPAN)
        if span.any():
            start = batch.column("token_start").fill_null(-1).to_numpy(zero_copy_only=False)
            consumed = consumed | (span & (start == 0))
    return consumed, skipped


def scan(
    store: Store,
    counted: Iterable[Commit],
    other: Iterable[Commit] = (),
    *,
    dataset_len: int,
    packed: bool = False,
    progress: Progress | None = None,
    threads: int | None = None,
) -> ScanResult:
    """Count the segments of ``counted`` per epoch, and every segment's events.

    Args:
        store: the log root.
        counted: commits whose events are counted per epoch (a lineage, in order).
        other: further commits whose segments are counted per segment only (abandoned
            branches).
        dataset_len: ids must lie in ``[0, dataset_len)``.
        packed: the run packs samples (has ``span`` events; their ``token_start`` column is
            then read too, to count a packed sample once).
        progress: called with ``(segments done, segments in all)``.
        threads: segment files read ahead at once (default 4).

    Returns:
        Per epoch of ``counted``, and per segment of both (in the order given).

    Raises:
        LogCorrupted: if a segment is missing, unreadable, of another size, SHA-256 or
            row count than its marker says (each file is hashed as it is read), or holds
            an id outside ``[0, dataset_len)``.
    """
    jobs = [(c, True, s) for c in counted for s in c.segments] + [
        (c, False, s) for c in other for s in c.segments
    ]
    events = np.zeros(len(jobs), np.int64)
    samples = np.zeros(len(jobs), np.int64)
    last_epoch = np.full(len(jobs), -1, np.int64)
    result = ScanResult(packed=packed)
    ids: dict[int, tuple[_Ids, _Ids]] = {}
    if len({s.path for _, _, s in jobs}) != len(jobs):
        raise LogCorrupted("two markers name the same segment: the commit chain is damaged")
    columns = ["epoch", "kind", "sample_id"] + (["token_start"] if packed else [])
    for i, table in enumerate(read_verified(store, [s for _, _, s in jobs], columns, threads)):
        if progress is not None:
            progress(i + 1, len(jobs))
        where = store.full(jobs[i][2].path)
        for batch in table.to_batches():
            if batch.num_rows == 0:
                continue
            consumed, skipped = _consumed(batch)
            events[i] += batch.num_rows
            if not jobs[i][1]:
                samples[i] += int(np.count_nonzero(consumed))
                continue
            epoch = batch.column("epoch")
            bounds = pc.min_max(epoch)
            lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
            sample_ids = batch.column("sample_id").to_numpy()
            any_skip = bool(skipped.any())
            for e in range(lo, hi + 1):
                mine = epoch.to_numpy() == e if lo != hi else None
                used = sample_ids[consumed if mine is None else consumed & mine]
                if used.size == 0 and not any_skip:
                    continue
                counts = result.epochs.setdefault(e, EpochCounts(e))
                if e not in ids:
                    ids[e] = (_Ids(dataset_len), _Ids(dataset_len, bitmap=False))
                seen, skips = ids[e]
                counts.samples += used.size
                samples[i] += used.size
                if used.size:
                    last_epoch[i] = max(last_epoch[i], e)
                seen.add(used, where)
                if any_skip:
                    dropped = sample_ids[skipped if mine is None else skipped & mine]
                    counts.skipped += dropped.size
                    skips.add(dropped, where)
    for i, (commit, _, ref) in enumerate(jobs):
        if events[i] != ref.rows:
            raise LogCorrupted(
                f"segment {store.full(ref.path)} has {events[i]} rows, its marker says {ref.rows}"
            )
        result.segments.append(
            SegmentCounts(
                commit.id,
                commit.step,
                commit.attempt,
                ref.rank,
                int(events[i]),
                int(samples[i]),
                ref.path,
                int(last_epoch[i]),
            )
        )
    for e, (seen, skips) in ids.items():
        result.epochs[e].distinct = seen.count()
        result.epochs[e].skipped_distinct = skips.count()
        result.epochs[e].covered = seen.union_count(skips)
    result.epochs = {e: c for e, c in sorted(result.epochs.items()) if c.samples or c.skipped}
    if progress is not None:
        progress(len(jobs), len(jobs))
    return result


def _dataset(store: Store, paths: list[str]) -> ds.Dataset:
    """The segments at ``paths`` (relative) as one dataset; a segment retired by a
    compaction is the row groups of the compacted file that hold it."""
    placed = pieces(store)
    fmt = ds.ParquetFileFormat()
    fs = arrow_filesystem(store)
    parents: dict[str, ds.ParquetFileFragment] = {}
    fragments = []
    for rel in paths:
        piece = placed.get(rel)
        if piece is None:
            fragments.append(fmt.make_fragment(store.full(rel), fs))
            continue
        if piece.path not in parents:
            parents[piece.path] = fmt.make_fragment(store.full(piece.path), fs)
            parents[piece.path].ensure_complete_metadata()
        fragments.append(parents[piece.path].subset(row_group_ids=piece.row_groups))
    return ds.FileSystemDataset(fragments, _SCHEMA, fmt, fs)


def read_verified(
    store: Store,
    refs: list[SegmentRef],
    columns: list[str],
    threads: int | None,
    match: tuple[str, int] | None = None,
) -> Iterator[pa.Table]:
    """The ``columns`` of each segment of ``refs``, in order, each checked against its
    marker (size, SHA-256, rows) before it is decoded.

    Each file is read once: a pool of threads reads, hashes (``hashlib`` releases the GIL)
    and decodes (so does Arrow) up to ``threads`` files ahead of the caller.

    Args:
        store: the log root.
        refs: the segments, as their markers name them.
        columns: event columns to decode.
        threads: files read ahead at once (default 4).
        match: ``(column, value)``: only rows whose ``column`` equals ``value`` are
            returned; a row group is decoded whole only if that column holds the value.

    Raises:
        LogCorrupted: naming the file, if one is missing, differs from its marker, or is
            not a readable segment.
    """
    want = pa.schema([EVENT_SCHEMA.field(c) for c in columns])
    ahead = max(1, threads or 4)
    placed = pieces(store)
    compacted = _CompactedFiles(store)

    def load(ref: SegmentRef) -> pa.Table:
        piece = placed.get(ref.path)
        try:
            if piece is not None:  # its rows in a compacted file, read and checked once
                table = compacted.read(piece, ref, columns)
                if match is not None:
                    name, value = match
                    table = table.filter(pc.equal(table[name], value))
            else:
                pf = open_segment(
                    store, ref.path, rows=ref.rows, checksum=ref.sha256, size=ref.bytes
                )
                if match is None:
                    table = pf.read(columns=columns, use_threads=False)
                else:
                    name, value = match
                    groups = [
                        g
                        for g in range(pf.num_row_groups)
                        if pc.any(pc.equal(pf.read_row_group(g, [name])[name], value)).as_py()
                    ]
                    table = pf.read_row_groups(groups, columns=columns, use_threads=False)
                    table = table.filter(pc.equal(table[name], value))
            return table if table.schema.equals(want) else table.cast(want)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise LogCorrupted(
                f"segment {store.full(ref.path)} does not hold the event columns: {e}"
            ) from e

    with ThreadPoolExecutor(ahead, thread_name_prefix="ledger-scan") as pool:
        pending: deque[Future[pa.Table]] = deque()
        try:
            for ref in refs:
                pending.append(pool.submit(load, ref))
                if len(pending) > ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


class _CompactedFiles:
    """Compacted files, each read and checked against its compaction once, while the
    pieces of a scan are read from it (the newest two are kept; pieces come in order).
    A ``ParquetFile`` is not safe to read from two threads: each thread opens its own
    over the shared bytes."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.files = {f.path: f for c in list_compactions(store) for f in c.files}
        self.data: dict[str, pa.Buffer] = {}
        self.lock = threading.Lock()
        self.local = threading.local()

    def _buffer(self, path: str) -> pa.Buffer:
        with self.lock:
            data = self.data.get(path)
            if data is None:
                f = self.files[path]
                try:
                    raw = self.store.read_bytes(f.path)
                except FileNotFoundError as e:
                    raise LogCorrupted(f"compacted file {self.store.full(path)} is missing") from e
                if len(raw) != f.bytes or sha256(raw) != f.sha256:
                    raise LogCorrupted(
                        f"compacted file {self.store.full(path)} differs from the size or "
                        "SHA-256 its compaction names: it was altered"
                    )
                data = pa.py_buffer(raw)
                if len(self.data) >= 2:
                    self.data.pop(next(iter(self.data)))
                self.data[path] = data
            return data

    def read(self, piece: Piece, ref: SegmentRef, columns: list[str]) -> pa.Table:
        if (piece.sha256, piece.rows) != (ref.sha256, ref.rows):
            raise LogCorrupted(
                f"segment {self.store.full(ref.path)} was compacted with another SHA-256 or "
                "row count than its marker names"
            )
        mine: dict[str, pq.ParquetFile] = getattr(self.local, "files", None) or {}
        self.local.files = mine
        pf = mine.get(piece.path)
        if pf is None:
            mine.clear()
            pf = mine[piece.path] = pq.ParquetFile(pa.BufferReader(self._buffer(piece.path)))
        table = pf.read_row_groups(piece.row_groups, columns=columns, use_threads=False)
        if table.num_rows != ref.rows:
            raise LogCorrupted(
                f"{self.store.full(piece.path)} holds {table.num_rows} rows of segment "
                f"{ref.path}, its marker says {ref.rows}"
            )
        return table


def last_position(store: Store, paths: list[str], epoch: int, packed: bool) -> int | None:
    """Largest position of a consumed event of ``epoch`` in the segments at ``paths``."""
    columns = ["epoch", "kind", "position"] + (["token_start"] if packed else [])
    best: int | None = None
    for batch in _dataset(store, paths).to_batches(
        columns=columns, filter=pc.field("epoch") == epoch
    ):
        consumed, _ = _consumed(batch)
        if consumed.any():
            top = int(batch.column("position").to_numpy()[consumed].max())
            best = top if best is None else max(best, top)
    return best
