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

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ledger.commits import Commit, SegmentRef
from ledger.compaction import Piece, list_compactions, piece_table, pieces
from ledger.errors import LogCorrupted
from ledger.history import SEGMENTS_SCHEMA, History, segments_table
from ledger.schema import ERROR, EVENT_COLUMN_SETS, EVENT_SCHEMA, ROLLBACK, SAMPLE, SKIP, SPAN
from ledger.segments import open_segment
from ledger.store import Fetched, Store, sha256

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
        skipped_distinct: distinct ids among them, bad samples and rolled-back ones.
        covered: distinct ids consumed, skipped, bad or rolled back.
        errors: ``'error'`` events: bad samples left out of their batch.
        rolled_back: ``'rollback'`` events: samples of batches skipped on purpose.
    """

    epoch: int
    samples: int = 0
    distinct: int = 0
    skipped: int = 0
    skipped_distinct: int = 0
    covered: int = 0
    errors: int = 0
    rolled_back: int = 0

    @property
    def duplicates(self) -> int:
        """Consumptions of an id already consumed earlier in the epoch."""
        return self.samples - self.distinct


SEGMENT_COUNTS = pa.schema(
    [
        ("commit_id", pa.string()),
        ("step", pa.int64()),
        ("attempt", pa.int32()),
        ("rank", pa.int32()),
        ("events", pa.int64()),
        ("samples", pa.int64()),
        ("path", pa.string()),
        ("last_epoch", pa.int64()),
    ]
)
"""Columns of :attr:`ScanResult.segments`, one row per segment: the commit whose marker
names it (``commit_id``, ``step``, ``attempt``), the ``rank`` that wrote it, its
``events`` (rows, all kinds) and ``samples`` (consumed events), its ``path`` relative to
the root, and ``last_epoch``, the largest epoch of its consumed events (-1: none, or not
counted)."""


@dataclass(slots=True)
class ScanResult:
    """What :func:`scan` counted: per epoch (counted commits only) and per segment.

    Attributes:
        epochs: per epoch of the counted commits (those with consumed or skipped events).
        segments: per segment, counted commits' first, in the order scanned
            (:data:`SEGMENT_COUNTS`).
        packed: the run packs samples.
        last_positions: per epoch, the largest position of a consumed event in it.
        error: with ``problems`` (``ledger verify``): why the epochs were not counted (a
            sample id outside the dataset), ``""`` when they were.
    """

    epochs: dict[int, EpochCounts] = field(default_factory=dict)
    segments: pa.Table = field(default_factory=SEGMENT_COUNTS.empty_table)
    packed: bool = False
    last_positions: dict[int, int] = field(default_factory=dict)
    error: str = ""


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


def _consumed(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """Masks of a batch's consumed and skipped rows (``bool (rows,)`` each)."""
    consumed, skipped, _, _ = _kinds(batch)
    return consumed, skipped


def _kinds(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Masks of a batch's consumed, skipped, bad (``error``) and rolled-back rows."""
    kind = batch.column("kind")
    names = kind.dictionary.to_pylist()
    idx = kind.indices.to_numpy(zero_copy_only=False)
    none = np.zeros(len(idx), np.bool_)
    consumed = idx == names.index(SAMPLE) if SAMPLE in names else none
    skipped = idx == names.index(SKIP) if SKIP in names else none
    errors = idx == names.index(ERROR) if ERROR in names else none
    rolled = idx == names.index(ROLLBACK) if ROLLBACK in names else none
    if SPAN in names and "token_start" in batch.schema.names:
        span = idx == names.index(SPAN)
        if span.any():
            start = batch.column("token_start").fill_null(-1).to_numpy(zero_copy_only=False)
            consumed = consumed | (span & (start == 0))
    return consumed, skipped, errors, rolled


def scan(
    store: Store,
    counted: Iterable[Commit],
    other: Iterable[Commit] = (),
    **options: Any,
) -> ScanResult:
    """Count the segments of ``counted`` per epoch, and every segment's events: the
    segments of the commits, in order (:func:`segment_jobs`), scanned by
    :func:`scan_segments` (whose keyword arguments ``options`` are)."""
    return scan_segments(store, segment_jobs(list(counted), list(other)), **options)


JOBS_SCHEMA = pa.schema([*SEGMENTS_SCHEMA, ("counted", pa.bool_())])
"""Columns of a scan's jobs, one row per segment, in scan order: the ``segments`` view's
columns and ``counted`` (its commit is one whose events are counted per epoch)."""


def segment_jobs(counted: list[Commit], other: list[Commit]) -> pa.Table:
    """The segments of ``counted`` then ``other``, commit by commit in rank order, as a
    scan's jobs (:data:`JOBS_SCHEMA`): numpy over their rank tables, no object per segment
    (version-1 commits: from their references)."""
    commits = counted + other
    history = History.of(commits)
    table = history.segments() if history is not None else segments_table(commits)
    ids = pa.array([c.id for c in counted], pa.string())
    return table.append_column("counted", pc.is_in(table["commit_id"], value_set=ids))


def scan_segments(
    store: Store,
    jobs: pa.Table,
    *,
    dataset_len: int,
    packed: bool = False,
    progress: Progress | None = None,
    threads: int | None = None,
    problems: dict[int, str] | None = None,
    key: str = "sample_id",
    positions: bool = True,
    placed: tuple[np.ndarray, pa.Table] | None = None,
) -> ScanResult:
    """Count the segments ``jobs`` (:data:`JOBS_SCHEMA`) per epoch where ``counted``, and
    every segment's events.

    Segments are read ahead by a thread pool (:func:`_read_units`); their rows are
    counted a chunk of many segments at a time (about 10^6 rows), so the work per segment
    in Python is a few array slices, not a pass of its own. The pieces of a compacted
    file that the scan reads in a row are read as one table; which they are is found with
    numpy over the jobs' columns (no object per segment).

    Args:
        store: the log root.
        jobs: the segments, counted commits' first (a lineage, in order), then further
            commits' (abandoned branches), counted per segment only.
        dataset_len: ids must lie in ``[0, dataset_len)``.
        packed: the run packs samples (has ``span`` events; their ``token_start`` column is
            then read too, to count a packed sample once).
        progress: called with ``(segments done, segments in all)``.
        threads: units read ahead at once (default 4; for a local root at most the CPUs
            the process may run on).
        problems: when given (``ledger verify``), a segment that is missing or differs
            from its marker is not an error: the problem is recorded here, by the
            segment's row in ``jobs``, in the words of :func:`check_segment`, and the
            segment is left out of the counts.
        key: the column counted once per epoch: ``sample_id``, or for a mixture
            (whose sources repeat by design) ``position``, in ``[0, dataset_len)`` too.
        positions: ``False``: the ``position`` column is not read (unless it is ``key``)
            and :attr:`ScanResult.last_positions` stays empty (``ledger verify``, which
            does not need them, decodes one column less per segment).
        placed: each job's row in a :func:`ledger.compaction.piece_table` (``int64``, -1:
            a file of its own) and that table, when the caller found them already
            (:func:`ledger.audit.views.scan_jobs`); ``None``: found here.

    Returns:
        Per epoch of the counted commits, and per segment of all (in the order given).

    Raises:
        LogCorrupted: if two jobs name one segment, a segment is missing, unreadable, of
            another size, SHA-256 or row count than its marker says (each file is hashed
            as it is read), or holds an id outside ``[0, dataset_len)``.
    """
    distinct = pc.unique(jobs["path"])  # a third of count_distinct's cost
    if len(distinct) - distinct.null_count != jobs.num_rows:
        raise LogCorrupted("two markers name the same segment: the commit chain is damaged")
    plan = _Plan(store, jobs, placed)
    counter = _Counter(store, plan, dataset_len, keep_going=problems is not None, key=key)
    columns = ["epoch", "kind", "sample_id"]
    columns += ["position"] if positions or key == "position" else []
    columns += ["token_start"] if packed else []
    buffered: list[_Unit] = []
    rows = done = 0
    for unit in _read_units(store, plan, columns, threads, problems):
        if buffered and (
            plan.counted[unit.lo] != plan.counted[buffered[0].lo] or rows >= _CHUNK_ROWS
        ):
            counter.add(buffered)
            buffered, rows = [], 0
        buffered.append(unit)
        rows += unit.table.num_rows if unit.table is not None else 0
        done += unit.hi - unit.lo
        if progress is not None:
            progress(done, plan.n)
    counter.add(buffered)
    return counter.result(packed)


_CHUNK_ROWS = 1 << 20
"""Rows counted at once: enough to make the per-chunk work negligible per segment."""


class _Plan:
    """A scan's jobs as numpy columns, with where each compacted segment's rows are.

    Attributes:
        jobs: the jobs table (:data:`JOBS_SCHEMA`).
        n: jobs.
        counted: ``bool (n,)``.
        rows: ``int64 (n,)``: rows of each segment, as its marker names them.
        at: ``int64 (n,)``: the segment's row in ``pieces`` (-1: a file of its own).
        pieces: :func:`ledger.compaction.piece_table`.
        units: ``int64 (u + 1,)``: unit ``k`` is the jobs ``[units[k], units[k + 1])``.
    """

    def __init__(
        self, store: Store, jobs: pa.Table, known: tuple[np.ndarray, pa.Table] | None = None
    ) -> None:
        self.jobs = jobs
        self.n = n = jobs.num_rows
        self.counted = jobs["counted"].to_numpy(zero_copy_only=False).astype(np.bool_)
        self.rows = jobs["rows"].to_numpy()
        self.pieces = table = piece_table(store) if known is None else known[1]
        if known is not None:  # scan_segments' placed
            self.at = np.asarray(known[0], np.int64)
        elif table.num_rows and n:
            at = pc.index_in(jobs["path"], value_set=table["path"]).fill_null(-1)
            self.at = np.asarray(at.to_numpy(), np.int64)
        else:
            self.at = np.full(n, -1, np.int64)
        placed = self.at >= 0
        self.placed = placed
        self.mismatch = np.zeros(n, np.bool_)
        breaks = np.ones(n, np.bool_)
        if n > 1:
            same = self.counted[1:] == self.counted[:-1]
            own = ~placed[1:] & ~placed[:-1]
            joins = same & own
            if placed.any():
                take = pa.array(self.at, mask=~placed)
                piece = table.take(take)
                for name in ("sha256", "rows", "commit_id"):
                    differs = pc.not_equal(piece[name], jobs[name]).fill_null(False)
                    self.mismatch |= differs.to_numpy(zero_copy_only=False)
                file = piece["file"].combine_chunks().dictionary_encode().indices
                code = file.fill_null(-1).to_numpy(zero_copy_only=False)
                first_row = piece["first_row"].fill_null(0).to_numpy()
                first_group = piece["first_group"].fill_null(0).to_numpy()
                groups = piece["groups"].fill_null(0).to_numpy()
                prows = piece["rows"].fill_null(0).to_numpy()
                new = first_row[1:] >= 0
                follows = np.where(
                    new & (first_row[:-1] >= 0),
                    first_row[1:] == first_row[:-1] + prows[:-1],
                    ~new & (first_group[1:] == first_group[:-1] + groups[:-1]),
                )
                both = placed[1:] & placed[:-1] & (code[1:] == code[:-1])
                joins |= same & both & follows
            breaks[1:] = ~joins
            # Segments of their own: a few dozen per unit (a future and a chunk each).
            index = np.arange(n)
            start = np.maximum.accumulate(np.where(breaks, index, 0))
            breaks |= ~placed & ((index - start) % _PER_UNIT == 0)
        self.units = np.concatenate([np.flatnonzero(breaks), [n]]).astype(np.int64)

    def path(self, i: int) -> str:
        return str(self.jobs["path"][i].as_py())

    def refs(self, lo: int, hi: int) -> list[tuple[str, int, SegmentRef]]:
        """``(commit id, attempt, segment)`` of the jobs ``[lo, hi)``."""
        part = self.jobs.slice(lo, hi - lo).to_pydict()
        return [
            (cid, attempt, SegmentRef(rank, path, rows, size, digest))
            for cid, attempt, rank, path, rows, size, digest in zip(
                *(part[k] for k in ("commit_id", "attempt", "rank", "path", "rows", "bytes")),
                part["sha256"],
                strict=True,
            )
        ]


@dataclass(slots=True)
class _Unit:
    """Rows of the consecutive jobs ``[lo, hi)`` of a scan, read as one table (``None``
    when the jobs' file failed a check: ``problems``)."""

    lo: int
    hi: int
    table: pa.Table | None


class _Counter:
    """Folds chunks of units into per-epoch and per-segment counts (vectorised)."""

    def __init__(
        self,
        store: Store,
        plan: _Plan,
        dataset_len: int,
        keep_going: bool,
        key: str = "sample_id",
    ) -> None:
        self.store = store
        self.key = key
        self.plan = plan
        self.dataset_len = dataset_len
        self.events = np.zeros(plan.n, np.int64)
        self.samples = np.zeros(plan.n, np.int64)
        self.last_epoch = np.full(plan.n, -1, np.int64)
        self.epochs: dict[int, EpochCounts] = {}
        self.ids: dict[int, tuple[_Ids, _Ids]] = {}
        self.last_positions: dict[int, int] = {}
        self.error = ""
        self.keep_going = keep_going

    def add(self, units: list[_Unit]) -> None:
        units = [u for u in units if u.table is not None and u.table.num_rows]
        tables = [u.table for u in units if u.table is not None]
        if not units:
            return
        index = np.concatenate([np.arange(u.lo, u.hi) for u in units])
        counts = self.plan.rows[index]
        # One dictionary for 'kind' across the files, then one chunk per column.
        table = pa.concat_tables(tables).unify_dictionaries().combine_chunks()
        job = np.repeat(index, counts)  # the job (segment) of each row
        self.events[index] += counts  # a job is in one unit: no index repeats
        batch = table.to_batches()[0]
        consumed, skipped, errors, rolled = _kinds(batch)
        n = self.plan.n
        if not self.plan.counted[units[0].lo]:  # abandoned branches: per-segment counts only
            self.samples += np.bincount(job[consumed], minlength=n)
            return
        epoch = batch.column("epoch").to_numpy()
        ids = batch.column(self.key).to_numpy()
        # Bad samples and rolled-back batches are accounted for in their epoch (never
        # consumed): they count towards coverage with the skipped positions.
        left_out = errors | rolled
        either = consumed | skipped | left_out
        outside = either & ((ids < 0) | (ids >= self.dataset_len))
        if self.error:
            return
        if outside.any():
            row = int(np.flatnonzero(outside)[0])
            where = self.store.full(self.plan.path(int(job[row])))
            self.error = (
                f"{where} holds sample id {ids[row]}, outside the dataset's [0, {self.dataset_len})"
            )
            if not self.keep_going:
                raise LogCorrupted(self.error)
            return
        self.samples += np.bincount(job[consumed], minlength=n)
        _fold_max(self.last_epoch, job[consumed], epoch[consumed])
        names = batch.schema.names
        position = batch.column("position").to_numpy() if "position" in names else None
        for e in _present(epoch[either]):
            mine = epoch == e
            used = ids[consumed & mine]
            dropped = ids[skipped & mine]
            counted = self.epochs.setdefault(e, EpochCounts(e))
            if e not in self.ids:
                self.ids[e] = (_Ids(self.dataset_len), _Ids(self.dataset_len, bitmap=False))
            seen, skips = self.ids[e]
            counted.samples += used.size
            counted.skipped += dropped.size
            seen.add(used, "")
            skips.add(dropped, "")
            if left_out.any():
                counted.errors += int(np.count_nonzero(errors & mine))
                counted.rolled_back += int(np.count_nonzero(rolled & mine))
                skips.add(ids[left_out & mine], "")
            if used.size and position is not None:
                top = int(position[consumed & mine].max())
                self.last_positions[e] = max(self.last_positions.get(e, top), top)

    def result(self, packed: bool) -> ScanResult:
        result = ScanResult(packed=packed, error=self.error)
        jobs = self.plan.jobs
        result.segments = pa.table(
            [
                jobs["commit_id"],
                jobs["step"],
                jobs["attempt"],
                jobs["rank"],
                self.events,
                self.samples,
                jobs["path"],
                self.last_epoch,
            ],
            schema=SEGMENT_COUNTS,
        )
        for e, (seen, skips) in self.ids.items():
            self.epochs[e].distinct = seen.count()
            self.epochs[e].skipped_distinct = skips.count()
            self.epochs[e].covered = seen.union_count(skips)
        result.epochs = {
            e: c
            for e, c in sorted(self.epochs.items())
            if c.samples or c.skipped or c.errors or c.rolled_back
        }
        result.last_positions = {e: p for e, p in self.last_positions.items() if e in result.epochs}
        return result


def _present(values: np.ndarray) -> list[int]:
    """The distinct values of ``values`` (epochs), sorted: one ``bincount`` when they span
    a short range (a chunk holds an epoch or two), which costs a fraction of
    ``np.unique``'s sort of 10^6 rows."""
    if values.size == 0:
        return []
    low, high = int(values.min()), int(values.max())
    if high - low >= 1 << 16:
        return [int(v) for v in np.unique(values)]
    return (np.flatnonzero(np.bincount(values - low)) + low).tolist()


def _fold_max(out: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    """``out[at] = max(out[at], values)`` per distinct ``at``, for sorted ``at`` (one
    ``reduceat``; ``np.maximum.at`` is ~100x slower on 10^6 rows)."""
    if at.size == 0:
        return
    starts = np.flatnonzero(np.concatenate([[True], at[1:] != at[:-1]]))
    keys = at[starts]
    out[keys] = np.maximum(out[keys], np.maximum.reduceat(values, starts))


def _read_units(
    store: Store,
    plan: _Plan,
    columns: list[str],
    threads: int | None,
    problems: dict[int, str] | None,
) -> Iterator[_Unit]:
    """The ``columns`` of the jobs' segments, in order, each checked against its marker
    before it is decoded; consecutive pieces of one compacted file come as one unit.

    A pool of threads reads, hashes (``hashlib`` releases the GIL) and decodes (so does
    Arrow) up to ``threads`` units ahead of the caller; an object store's files of a
    unit are fetched at once (:meth:`Store.read_many`). With ``problems``, a unit that
    fails a check comes with no table and its problem recorded (see :func:`scan`).
    """
    want = pa.schema([EVENT_SCHEMA.field(c) for c in columns])
    compacted = _CompactedFiles(store)

    def load(lo: int, hi: int) -> _Unit:
        rows = int(plan.rows[lo:hi].sum())
        try:
            if not plan.placed[lo]:
                table = _segment_tables(store, plan.refs(lo, hi), columns, want, problems)
            else:
                table = compacted.read_run(plan, lo, hi, columns)
            if table.num_rows != rows:  # each check above makes this unreachable
                raise LogCorrupted(
                    f"segment {store.full(plan.path(lo))} and the {hi - lo - 1} read with it "
                    f"hold {table.num_rows} rows, their markers say {rows}"
                )
            return _Unit(lo, hi, table if table.schema.equals(want) else table.cast(want))
        except _Problems as p:
            if problems is None:
                raise LogCorrupted(p.first) from None
            problems.update({lo + k: text for k, text in p.found.items()})
            return _Unit(lo, hi, None)
        except LogCorrupted as e:
            if problems is None:
                raise
            problems.update(dict.fromkeys(range(lo, hi), str(e)))
            return _Unit(lo, hi, None)
        except (pa.ArrowException, OSError, ValueError) as e:
            error = f"segment {store.full(plan.path(lo))} does not hold the event columns: {e}"
            if problems is None:
                raise LogCorrupted(error) from e
            problems.update(dict.fromkeys(range(lo, hi), error))
            return _Unit(lo, hi, None)

    ahead = max(1, threads or _default_threads(store))
    bounds = plan.units.tolist()
    with ThreadPoolExecutor(ahead, thread_name_prefix="ledger-scan") as pool:
        pending: deque[Future[_Unit]] = deque()
        try:
            for lo, hi in itertools.pairwise(bounds):
                pending.append(pool.submit(load, lo, hi))
                if len(pending) > ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _default_threads(store: Store) -> int:
    """Units a scan reads ahead by default: 4 for an object store (its reads wait on the
    network), at most the CPUs this process may run on for a local root, whose reads are
    decoding work (on 2 cores, 2 threads scan 10^4 small segments in ~8% less time and
    CPU than 4, which only contend for them; ``tools/scale.py``'s logs, alternating)."""
    if not store.is_local:
        return 4
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class _Problems(Exception):
    """Checks that a unit failed: by position in the unit, one line each (``ledger
    verify``'s words); ``first`` is the line a command that stops at the first says."""

    def __init__(self, found: dict[int, str], first: str) -> None:
        super().__init__(first)
        self.found = found
        self.first = first


def _segment_tables(
    store: Store,
    jobs: list[tuple[str, int, SegmentRef]],
    columns: list[str],
    want: pa.Schema,
    problems: dict[int, str] | None,
) -> pa.Table:
    """The ``columns`` of consecutive segments (files of their own; ``(commit id,
    attempt, segment)`` each), each checked against its marker, as one table. Without
    ``problems`` the first failed check raises :class:`LogCorrupted`
    (:func:`open_segment`'s words); with it, every segment of the unit is checked and
    :class:`_Problems` names each one that fails, in :func:`check_segment`'s words."""
    tables = []
    found: dict[int, str] = {}
    fetched = store.read_ahead([ref.path for _, _, ref in jobs])  # the unit's files at once
    for k, (cid, attempt, ref) in enumerate(jobs):
        if problems is None:
            pf = open_segment(
                store, ref.path, rows=ref.rows, checksum=ref.sha256, size=ref.bytes,
                fetched=fetched,
            )  # fmt: skip
            table = pf.read(columns=columns, use_threads=False)
        else:
            checked = check_segment(store, cid, attempt, ref, columns, fetched)
            if isinstance(checked, str):
                found[k] = checked
                continue
            table = checked
        tables.append(table)
    if found:
        raise _Problems(found, found[min(found)])
    if len(tables) > 1:
        try:  # one schema check for the unit, not one per file (each costs ~12 us)
            table = pa.concat_tables(tables)
        except pa.ArrowInvalid:  # files of other column types (older writers): cast each
            table = pa.concat_tables(t if t.schema.equals(want) else t.cast(want) for t in tables)
    else:
        table = tables[0]
    return table if table.schema.equals(want) else table.cast(want)


_PER_UNIT = 64
"""Segments (files of their own) read by one task of the pool and counted as one unit."""


def check_segment(
    store: Store,
    commit: str,
    attempt: int,
    ref: SegmentRef,
    columns: list[str],
    fetched: Fetched | None = None,
) -> pa.Table | str:
    """``ledger verify``'s checks of one segment: it exists, has the size, SHA-256 and
    rows its marker names, the event columns, and only its own attempt and rank (Parquet
    statistics). Returns its ``columns``, or the problem in one line.

    The file is opened with Arrow's Parquet reader directly: ``pq.ParquetFile`` costs
    about as much again in Python per file, which counts at 10^4 segments. Its columns
    are named by their Parquet paths (a third of the cost of Arrow's schema, and the
    same names for the flat event columns); only a file that fails the check has its
    Arrow schema read, for the message. ``fetched``: files the caller read already
    (:meth:`Store.read_many`), by path."""
    where = f"{ref.path} (commit {commit})"
    try:
        data = store.read_known(ref.path, fetched)
    except FileNotFoundError:
        return f"{where} is missing"
    if len(data) != ref.bytes:
        return f"{where} has {len(data)} bytes, the marker says {ref.bytes}"
    if sha256(data) != ref.sha256:
        return f"{where} has another SHA-256 than its marker"
    try:
        reader = pq.ParquetReader()
        # The bytes are in memory: pre-buffering them again costs ~5% of a small file.
        reader.open(pa.BufferReader(data), pre_buffer=False)
        meta = reader.metadata
        # A nested column's path has a dot, so it never passes for an event column.
        names = [".".join(path) for path in reader.column_paths]
        problem = _segment_content(where, meta, names, attempt, ref)
        if problem is not None:
            if problem is _COLUMNS:
                return f"{where} has columns {reader.schema_arrow.names}, not the event schema"
            return problem
        return reader.read_all(column_indices=[names.index(n) for n in columns], use_threads=False)
    except (pa.ArrowException, OSError, ValueError) as e:  # mangled footers, statistics
        return f"{where} is not readable Parquet: {e}"


_COLUMNS = "columns"
""":func:`_segment_content`'s answer for a file without the event columns."""


def _segment_content(
    where: str, meta: pq.FileMetaData, names: list[str], attempt: int, ref: SegmentRef
) -> str | None:
    if meta.num_rows != ref.rows:
        return f"{where} has {meta.num_rows} rows, the marker says {ref.rows}"
    if names not in EVENT_COLUMN_SETS:
        return _COLUMNS
    groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
    for col, want in (("attempt", attempt), ("rank", ref.rank)):
        i = names.index(col)
        for group in groups:
            st = group.column(i).statistics
            # The raw values (integers: no conversion through the logical type) at once.
            if st is not None and st.has_min_max and not st.min_raw == st.max_raw == want:
                return f"{where} holds {col} {st.min}..{st.max}, its path says {want}"
    return None


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
        threads: files read ahead at once (default: as :func:`scan_segments`, 4 for an
            object store, at most the CPUs the process may run on for a local root).
        match: ``(column, value)``: only rows whose ``column`` equals ``value`` are
            returned; a row group is decoded whole only if that column holds the value.

    Raises:
        LogCorrupted: naming the file, if one is missing, differs from its marker, or is
            not a readable segment.
    """
    want = pa.schema([EVENT_SCHEMA.field(c) for c in columns])
    ahead = max(1, threads or _default_threads(store))
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
        self.checked: dict[str, tuple[Any, Any]] = {}
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
        start = sum(pf.metadata.row_group(g).num_rows for g in range(piece.first_group))
        # Pieces share row groups (64K rows, a segment is ~10^2): each thread keeps the
        # groups it decoded last, so a group is decoded once per thread, not per piece.
        wanted = (piece.path, piece.first_group, piece.groups, tuple(columns))
        last = getattr(self.local, "groups", None)
        if last is not None and last[0] == wanted:
            read = last[1]
        else:
            read = pf.read_row_groups(piece.row_groups, columns=columns, use_threads=False)
            self.local.groups = (wanted, read)
        table = piece.rows_of(read, start)
        if table.num_rows != ref.rows:
            raise LogCorrupted(
                f"{self.store.full(piece.path)} holds {table.num_rows} rows of segment "
                f"{ref.path}, its marker says {ref.rows}"
            )
        return table

    def _checked(self, path: str, pieces: int) -> tuple[pa.Buffer, np.ndarray]:
        """The file's bytes and the cumulative rows of its row groups (``int64
        (groups + 1,)``), after checking it against its compaction once.

        Raises:
            _Problems: if the file is missing, altered or unreadable (the same problem for
                each of the unit's ``pieces``).
        """
        with self.lock:
            known = self.checked.get(path)
            if known is None:
                known = self.checked[path] = self._check(path)
        data, bounds = known
        if isinstance(data, str):
            raise _Problems(dict.fromkeys(range(pieces), data), str(bounds))
        return data, bounds

    def _check(self, path: str) -> tuple[Any, Any]:
        f = self.files[path]
        full = self.store.full(path)
        try:
            raw = self.store.read_bytes(f.path)
        except FileNotFoundError:
            return f"compacted file {f.path} is missing", f"compacted file {full} is missing"
        if len(raw) != f.bytes or sha256(raw) != f.sha256:
            return (
                f"compacted file {f.path} differs from its compaction's size or SHA-256",
                f"compacted file {full} differs from the size or SHA-256 its compaction "
                "names: it was altered",
            )
        data = pa.py_buffer(raw)
        try:
            meta = pq.ParquetFile(pa.BufferReader(data)).metadata
            sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        except (pa.ArrowException, OSError, ValueError) as e:
            return (
                f"compacted file {f.path} is not readable Parquet: {e}",
                f"compacted file {full} is not readable Parquet: {e}",
            )
        if meta.num_rows != f.rows:
            return (
                f"compacted file {f.path} has {meta.num_rows} rows, its compaction says {f.rows}",
                f"compacted file {full} has {meta.num_rows} rows, its compaction says {f.rows}",
            )
        return data, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def read_run(self, plan: _Plan, lo: int, hi: int, columns: list[str]) -> pa.Table:
        """The rows of the consecutive pieces of one compacted file that are the jobs
        ``[lo, hi)`` of ``plan``, as one table: the file is checked once, each piece
        against its marker, and each piece's row groups hold the rows its marker names.

        Raises:
            _Problems: naming each piece (or the file) that does not check.
        """
        held = plan.pieces.take(pa.array(plan.at[lo:hi], pa.int64()))
        path = held["file"][0].as_py()
        data, bounds = self._checked(path, hi - lo)
        wrong = np.flatnonzero(plan.mismatch[lo:hi])
        if wrong.size:
            found = {}
            for k in wrong.tolist():
                job = plan.jobs.slice(lo + k, 1).to_pylist()[0]
                found[k] = (
                    f"{job['path']} (commit {job['commit_id']}) was compacted as "
                    f"{held['rows'][k].as_py()} rows of commit {held['commit_id'][k].as_py()} "
                    "with another SHA-256 or row count than its marker names"
                )
            raise _Problems(
                found,
                f"segment {self.store.full(plan.path(lo + int(wrong[0])))} was compacted with "
                "another SHA-256 or row count than its marker names",
            )
        first = held["first_group"].to_numpy()
        end = first + held["groups"].to_numpy()
        first_row = held["first_row"].to_numpy()
        if first_row[0] >= 0:  # rows [first_row, first_row + rows) of the file
            count = held["rows"].to_numpy()
            inside = (bounds[first] <= first_row) & (first_row + count <= bounds[end])
            rows = np.where(inside, count, -1)  # -1: its row groups do not hold its rows
        else:  # the old layout: the piece is its row groups
            rows = bounds[end] - bounds[first]
        wrong = np.flatnonzero(rows != plan.rows[lo:hi])
        if wrong.size:
            k = int(wrong[0])
            text = (
                f"{self.store.full(path)} holds {rows[k]} rows of segment "
                f"{plan.path(lo + k)}, its marker says {plan.rows[lo + k]}"
            )
            raise _Problems({int(j): text for j in wrong}, text)
        mine: dict[str, pq.ParquetFile] = getattr(self.local, "files", None) or {}
        self.local.files = mine
        pf = mine.get(path)
        if pf is None:
            mine.clear()
            pf = mine[path] = pq.ParquetFile(pa.BufferReader(data))
        start, stop = int(first[0]), int(end[-1])
        if start == 0 and stop == len(bounds) - 1:
            read = pf.read(columns=columns, use_threads=False)
        else:
            read = pf.read_row_groups(range(start, stop), columns=columns, use_threads=False)
        if first_row[0] < 0:
            return read
        return read.slice(int(first_row[0]) - int(bounds[start]), int(plan.rows[lo:hi].sum()))
