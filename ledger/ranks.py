"""The per-rank table of a commit: each rank's state, new segment and newest segment.

A version-2 commit marker is a small JSON file naming a binary file,
``ranks/<id>.ranks`` (``commits/<id>.ranks`` in logs written before), with one row of
integers per rank (layout below): the rank's :class:`~ledger.commits.PipelineState`
after the commit, the segment it wrote at the commit (if any) and the *newest* segment
of the rank in the lineage, carried forward from the parent's table when the rank wrote
none. Resume thus reads the head marker, its table and one segment per rank, whatever
the length of the history.

The rows are exactly what each rank sends rank 0 at a collective commit (:func:`pack`),
so rank 0 assembles the table with numpy, with no Python object per rank
(:func:`from_rows`). On disk the ``(W, L)`` ``int64`` matrix is stored column by column,
byte-shuffled (the k-th bytes of all values together, as Blosc's shuffle filter does) and
zstd-compressed (:func:`encode`): values shared by the ranks cost almost nothing, so a
map-style row costs about the 32 bytes of its segment's SHA-256. Segment paths are not
stored: they are :func:`ledger.segments.segment_path` of the attempt, rank and step.
Decoding is one decompression and one transpose; rows become Python objects only when
asked for (:class:`RankTable`). ``tools/scale.py`` measures sizes and times.

Row layout (``int64``):

====  =================================================================================
0     status at the commit (:data:`NO_NEWS`, :data:`NEWS`, :data:`FAILED`; rows sent)
1-7   segment written at this commit: present (0/1), rows, bytes, SHA-256 (4 values,
      little-endian)
8-9   ``origin``: step and attempt of the commit (step -1: none)
10-14 ``epoch``, ``epoch_batch``, ``batch``, ``epoch_start``, ``next_worker``
15-16 K (logical workers), T (integers of tails)
17-25 newest segment when the rank wrote none at this commit: present (0/1), attempt,
      step, rows, bytes, SHA-256 (4 values)
26-27 the final batch of the rank's newest segment: recorded (0/1), its
      :func:`final_batch_fingerprint` (carried forward with the newest segment; layout
      version 2, :data:`ENCODING`, only)
28-   9*K worker fields (worker-major, :data:`WORKER_FIELDS` order), K tail lengths
      (integers), T tail integers (``sample, offset, length`` triples); zero padding
====  =================================================================================

Layout version 1 (:data:`ENCODING_V1`, logs written before the final batch's fingerprint)
has no columns 26-27: its worker fields start at column 26. Both are read; only version 2
is written. A map-style resume checks the fingerprint of the batch its order puts last
against columns 26-27 instead of decoding the segment's final row group
(:func:`ledger.replay.replay_by_marker`); a version-1 table is resumed by decoding.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import pyarrow as pa

from ledger.errors import LogCorrupted

WORKER_FIELDS = (
    "worker",
    "shard",
    "row",
    "rows_read",
    "draws",
    "emitted",
    "doc",
    "doc_offset",
    "doc_length",
)
"""Integer fields of :class:`~ledger.commits.WorkerState`, in a row's order."""

ENCODING = "int64-columns-shuffle-zstd-v2"
"""Name of the on-disk encoding written, recorded in the marker: layout version 2."""

ENCODING_V1 = "int64-columns-shuffle-zstd"
"""Layout version 1 (no final batch's fingerprint), read for logs written before it."""

HEADS = {ENCODING_V1: 26, ENCODING: 28}
"""Leading columns (before the worker fields) of each layout, by encoding name."""

_INTS = ("epoch", "epoch_batch", "batch", "epoch_start", "next_worker")
_HEAD = HEADS[ENCODING]
_FINAL = slice(26, 28)  # layout 2: final batch recorded (0/1), its fingerprint
NO_NEWS, NEWS, FAILED = 0, 1, 2
_PATH = re.compile(r"events/attempt=(\d+)/rank=(\d+)/seg-(\d+)\.parquet")


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """A segment named by a commit marker.

    Attributes:
        rank: rank that wrote it.
        path: path relative to the log root.
        rows: number of events (rows).
        bytes: file size (bytes).
        sha256: hex SHA-256 of the file.
    """

    rank: int
    path: str
    rows: int
    bytes: int
    sha256: str


def _path(attempt: int, rank: int, step: int) -> str:
    return f"events/attempt={attempt}/rank={rank}/seg-{step:012d}.parquet"


def _sha(values: np.ndarray) -> str:
    return np.ascontiguousarray(values, dtype="<i8").tobytes().hex()


class RankTable(Sequence[Any]):
    """The per-rank rows of a commit, decoded into Python objects on demand.

    Indexing yields :class:`~ledger.commits.PipelineState` (the sequence is the commit's
    ``states``); :meth:`segments` and :meth:`newest` give segment references.

    Args:
        rows: ``int64`` array ``(W, L)`` (layout in the module docstring).
        attempt: the attempt that wrote the commit (segments written at it are its).
        head: leading columns of the layout (:data:`HEADS`): 28, or 26 for version 1.
    """

    def __init__(self, rows: np.ndarray, attempt: int, head: int = _HEAD) -> None:
        self.rows = rows
        self.attempt = attempt
        self.head = head
        self._states: dict[int, Any] = {}

    @property
    def encoding(self) -> str:
        """The encoding name of this table's layout (recorded in its marker)."""
        return ENCODING if self.head == _HEAD else ENCODING_V1

    def final_batch(self, rank: int) -> int | None:
        """The :func:`final_batch_fingerprint` of the final batch in ``rank``'s newest
        segment, or ``None`` when the table does not record one (layout version 1, a
        segment ending without a sample of a batch, a hand-made commit)."""
        if self.head < _HEAD or not 0 <= rank < len(self) or self.rows[rank, 26] != 1:
            return None
        return int(self.rows[rank, 27])

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i not in self._states:
            self._states[i] = self._state(i)
        return self._states[i]

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def _state(self, i: int) -> Any:
        from ledger.commits import PipelineState, WorkerState

        row = self.rows[i].tolist()
        width, total, h = row[15], row[16], self.head
        body = row[h : h + 9 * width]
        lengths = row[h + 9 * width : h + 10 * width]
        flat = row[h + 10 * width : h + 10 * width + total]
        workers = []
        at = 0
        for k in range(width):
            t = flat[at : at + lengths[k]]
            at += lengths[k]
            workers.append(
                WorkerState(
                    **dict(zip(WORKER_FIELDS, body[9 * k : 9 * k + 9], strict=True)),
                    tails=tuple((t[j], t[j + 1], t[j + 2]) for j in range(0, len(t), 3)),
                )
            )
        origin = "" if row[8] < 0 else f"{row[8]:012d}-{row[9]:04d}"
        epoch, epoch_batch, batch, epoch_start, next_worker = row[10:15]
        return PipelineState(
            i, epoch, epoch_batch, batch, tuple(workers), next_worker, epoch_start, origin
        )

    def segments(self) -> tuple[SegmentRef, ...]:
        """The segments written at this commit, in rank order."""
        if len(self.rows) <= 64:  # a few ranks: plain lists beat numpy's per-call costs
            head = self.rows[:, :13].tolist()
            digests = np.ascontiguousarray(self.rows[:, 4:8], dtype="<i8").tobytes().hex()
            return tuple(
                SegmentRef(
                    r,
                    _path(self.attempt, r, row[12]),
                    row[2],
                    row[3],
                    digests[64 * r : 64 * r + 64],
                )
                for r, row in enumerate(head)
                if row[1] == 1
            )
        has = np.flatnonzero(self.rows[:, 1] == 1)
        picked = self.rows[has]
        return tuple(
            SegmentRef(
                r, _path(self.attempt, r, int(row[12])), int(row[2]), int(row[3]), _sha(row[4:8])
            )
            for r, row in zip(has.tolist(), picked, strict=True)
        )

    def newest(self, rank: int) -> SegmentRef | None:
        """The newest segment of ``rank`` in the lineage (``None``: the rank has none)."""
        if not 0 <= rank < len(self):
            return None
        row = self.rows[rank]
        if row[1] == 1:
            return SegmentRef(
                rank,
                _path(self.attempt, rank, int(row[12])),
                int(row[2]),
                int(row[3]),
                _sha(row[4:8]),
            )
        if row[17] == 1:
            return SegmentRef(
                rank,
                _path(int(row[18]), rank, int(row[19])),
                int(row[20]),
                int(row[21]),
                _sha(row[22:26]),
            )
        return None


def final_batch_fingerprint(epoch: int, batch: int, positions: np.ndarray, ids: np.ndarray) -> int:
    """A signed 64-bit fingerprint of a batch's events: its epoch, batch index, and the
    positions and sample ids of its ``sample``/``error``/``rollback`` events in position
    order (what a resume checks of the final batch, :func:`ledger.replay.replay`).

    BLAKE2b with an 8-byte digest (RFC 7693) over the little-endian ``int64`` values
    ``epoch, batch, rows``, then the positions, then the ids: ~2 µs for 256 events.

    Args:
        epoch, batch: the batch's epoch and per-rank batch index.
        positions: ``int64 (rows,)``, ascending.
        ids: ``int64 (rows,)``, the sample id at each position.
    """
    h = hashlib.blake2b(digest_size=8, person=b"ledger-final")
    h.update(np.array([epoch, batch, positions.shape[0]], "<i8").tobytes())
    h.update(np.ascontiguousarray(positions, "<i8").tobytes())
    h.update(np.ascontiguousarray(ids, "<i8").tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def final_batch_of(chunks: Sequence[Any], kinds: Iterable[str]) -> int | None:
    """:func:`final_batch_fingerprint` of the batch a segment of ``chunks``
    (:class:`~ledger.schema.EventChunk`, in the segment's order) ends with, over its
    chunks of ``kinds``; ``None`` when no chunk of the final batch is of ``kinds``."""
    if not chunks:
        return None
    last = chunks[-1].batch
    wanted = set(kinds)
    picked = []
    for chunk in reversed(chunks):
        if chunk.batch != last:
            break  # batch indexes never decrease within a segment
        if chunk.kind in wanted and chunk.sample_ids.shape[0]:
            picked.append(chunk)
    if not picked:
        return None
    picked.reverse()
    positions = np.concatenate(
        [
            c.positions
            if c.positions is not None
            else np.arange(c.position, c.position + c.sample_ids.shape[0], dtype=np.int64)
            for c in picked
        ]
    ).astype(np.int64, copy=False)
    ids = np.concatenate([c.sample_ids for c in picked]).astype(np.int64, copy=False)
    if positions.size > 1 and not (positions[1:] >= positions[:-1]).all():
        order = np.argsort(positions, kind="stable")
        positions, ids = positions[order], ids[order]
    return final_batch_fingerprint(picked[0].epoch, last, positions, ids)


def pack(state: Any, ref: SegmentRef | None, status: int, final: int | None = None) -> np.ndarray:
    """One rank's row (layout in the module docstring), as an ``int64`` vector.

    Args:
        state: the rank's :class:`~ledger.commits.PipelineState` after the commit.
        ref: the segment it wrote, at its standard path (``segment_path`` of its attempt,
            its rank and ``state.batch``), or ``None``.
        status: :data:`NO_NEWS`, :data:`NEWS` or :data:`FAILED`.
        final: the fingerprint of the batch ``ref`` ends with (:func:`final_batch_of`),
            or ``None`` (not recorded; a resume then decodes the segment).

    Raises:
        ValueError: if ``ref``'s path is not the standard one.
    """
    workers = state.workers
    tails = [x for w in workers for t in w.tails for x in t]
    head = np.zeros(_HEAD, np.int64)
    head[0] = status
    if ref is not None:
        m = _PATH.fullmatch(ref.path)
        if m is None or int(m.group(3)) != state.batch or int(m.group(2)) != state.rank:
            raise ValueError(f"segment {ref.path} is not at the standard path of its commit")
        head[1:4] = (1, ref.rows, ref.bytes)
        head[4:8] = np.frombuffer(bytes.fromhex(ref.sha256), "<i8")
    if state.origin:
        step, attempt = state.origin.split("-")
        head[8:10] = (int(step), int(attempt))
    else:
        head[8:10] = (-1, 0)
    head[10:15] = [getattr(state, n) for n in _INTS]
    head[15:17] = (len(workers), len(tails))
    if ref is not None and final is not None:
        head[_FINAL] = (1, final)
    body = [getattr(w, n) for w in workers for n in WORKER_FIELDS]
    body += [3 * len(w.tails) for w in workers]
    return np.concatenate([head, np.asarray(body + tails, np.int64)])


def from_rows(
    rows: np.ndarray, parent: RankTable | Sequence[SegmentRef | None] | None
) -> np.ndarray:
    """The table of a commit from the gathered rows: fills in each rank's newest segment
    from ``parent`` where the rank wrote none (vectorised).

    Args:
        rows: ``int64`` array ``(W, L)``, row ``r`` from rank ``r`` (:func:`pack`).
        parent: the parent commit's table, or (for a version-1 parent) each rank's
            newest segment of its lineage; ``None`` for the first commit.

    Returns:
        The table's rows (a new array). A rank that wrote no segment carries its newest
        segment's final-batch fingerprint (columns 26-27) from a version-2 parent.
    """
    out = rows.copy()
    n = out.shape[0]
    out[:, 17:26] = 0
    if parent is None:
        return out
    if isinstance(parent, RankTable) and parent.head == _HEAD:
        m = min(n, len(parent))
        kept = out[:m, 1] == 1
        out[:m, _FINAL] = np.where(kept[:, None], out[:m, _FINAL], parent.rows[:m, _FINAL])
    if isinstance(parent, RankTable):
        p = parent.rows[:n]
        m = p.shape[0]
        newest = np.zeros((m, 9), np.int64)
        own = p[:, 1] == 1
        newest[own, 0] = 1
        newest[own, 1] = parent.attempt
        newest[own, 2] = p[own, 12]
        newest[own, 3:5] = p[own, 2:4]
        newest[own, 5:9] = p[own, 4:8]
        newest[~own] = p[~own, 17:26]
    else:
        m = min(n, len(parent))
        newest = np.zeros((m, 9), np.int64)
        for r, ref in enumerate(list(parent)[:m]):
            if ref is None:
                continue
            match = _PATH.fullmatch(ref.path)
            if match is None:
                raise ValueError(f"segment {ref.path} is not at a standard path")
            newest[r, :3] = (1, int(match.group(1)), int(match.group(3)))
            newest[r, 3:5] = (ref.rows, ref.bytes)
            newest[r, 5:9] = np.frombuffer(bytes.fromhex(ref.sha256), "<i8")
    wrote = out[:m, 1] == 1
    out[:m, 17:26] = np.where(wrote[:, None], 0, newest)
    return out


def build(
    states: Sequence[Any], segments: Sequence[SegmentRef], newest: Sequence[SegmentRef | None]
) -> np.ndarray:
    """The table of a commit from Python objects (for commits not made by a
    :class:`~ledger.log.Ledger`, such as benchmarks' and tests' hand-made ones)."""
    by_rank = {s.rank: s for s in segments}
    rows = [pack(s, by_rank.get(s.rank), NEWS) for s in states]
    width = max((len(r) for r in rows), default=_HEAD)
    matrix = (
        np.stack([np.pad(r, (0, width - len(r))) for r in rows])
        if rows
        else np.zeros((0, _HEAD), np.int64)
    )
    return from_rows(matrix, newest)


def encode(rows: np.ndarray) -> bytes:
    """The on-disk bytes of a table: columns, byte-shuffled, zstd (deterministic, so a
    retried commit writes the same bytes)."""
    columns = np.ascontiguousarray(rows.T, dtype="<i8")
    shuffled = columns.view(np.uint8).reshape(-1, 8).T.tobytes()
    # Level 3: on byte-shuffled columns it compresses as well as level 9 (a stream table of
    # 10^4 ranks: 188 vs 190 bytes per rank) in a quarter of the time (tools/scale.py).
    return bytes(pa.Codec("zstd", compression_level=3).compress(shuffled, asbytes=True))


def decode(
    data: bytes, shape: tuple[int, int], attempt: int, where: str, encoding: str = ENCODING
) -> RankTable:
    """Parse a table written by :func:`encode` with ``shape`` ``(W, L)`` in the layout of
    ``encoding`` (a name in :data:`HEADS`).

    Raises:
        LogCorrupted: if ``data`` does not decompress to ``W * L`` integers (naming
            ``where``).
    """
    w, width = shape
    head = HEADS[encoding]
    # A shape claiming far more than the bytes could hold is refused before anything is
    # allocated (zstd of these tables stays well under 2^14:1 beyond 64 MB).
    if w < 0 or width < head or w * width * 8 > max(1 << 26, len(data) << 14):
        raise LogCorrupted(f"{where}: a rank table of shape {shape} cannot hold {len(data)} bytes")
    try:
        raw = pa.Codec("zstd").decompress(data, decompressed_size=w * width * 8, asbytes=True)
    except (pa.ArrowException, ValueError) as e:
        raise LogCorrupted(f"{where} is not a rank table: {e}") from e
    if len(raw) != w * width * 8:
        raise LogCorrupted(f"{where} holds {len(raw)} bytes, not a {w} x {width} rank table")
    # Byte b of column c of rank r is at [b, c, r]: one transposing copy to [r, c, b].
    shuffled = np.frombuffer(raw, np.uint8).reshape(8, width, w)
    rows = shuffled.transpose(2, 1, 0).copy().view("<i8").reshape(w, width)
    return RankTable(rows, attempt, head)
