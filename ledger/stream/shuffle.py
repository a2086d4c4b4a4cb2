"""A logical worker's shuffled stream of sample ids, computed a chunk at a time.

A logical worker's stream of sample ids is a pure function of its plan (the row ranges
it reads), its cursor and its shuffle buffer: every shuffle draw comes from a
counter-based generator (the SplitMix64 finaliser, :func:`ledger.order._mix`, of
``key + draws * golden``). :class:`IdFeed` computes the next ``k`` ids in a handful of
numpy operations; the workers (:class:`ledger.stream.worker.Feed`) and the main
process's replicas (:mod:`ledger.stream.replica`) both run it.

The shuffle buffer is the reservoir-style buffer of ``tf.data.Dataset.shuffle``: fill
to ``size`` slots; then each output is the slot ``j = draw % size``, refilled with the
next row; once the rows run out, slot ``j`` of the ``n`` left is output and the last
slot moves into it. ``tests/test_replica.py`` holds the sample-at-a-time definition and
checks that :class:`IdFeed` equals it step for step. The main process's replicas of a
stream's workers compute each chunk on a background thread while the one before it is
taken (``ahead``).

In the steady state the slot sequence ``j_0, j_1, ...`` is known in advance, so step
``t`` outputs the row written to slot ``j_t`` by the latest earlier step with the same
slot, or the slot's content before the chunk: a stable (radix) sort of the slots gives
every step its predecessor at once, with no Python loop. The drain at the end of an
epoch (at most ``size`` steps per worker) runs step by step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from ledger.commits import WorkerState
from ledger.order import _GOLDEN, _mix
from ledger.store import background
from ledger.stream.source import ShardedSource

Piece = tuple[int, int, int]  # (shard, first row, row after the last)
Run = tuple[int, int, int, int, int]
"""Rows a chunk read from one piece: ``(k_end, piece, base, piece_after, row_after)``: the
cursor after the chunk's ``k``-th row is ``(piece, base + k)`` up to ``k_end`` (excluded),
and ``(piece_after, row_after)`` (the next piece with rows, once this one is read) at it."""
_Start = tuple[int, int, int, int, np.ndarray, np.ndarray | None]
"""A chunk's starting state: ``(piece, row, rows_read, draws, buffer ids, their positions)``."""
_Chunk = tuple[
    np.ndarray,
    list[Run],
    int,
    tuple[int, int, int] | None,
    np.ndarray,
    np.ndarray | None,
    np.ndarray | None,
    tuple[str, np.ndarray, np.ndarray, np.ndarray] | None,
]
"""A computed chunk: ``(outputs, runs, rows_read at its start, the drain's constant cursor or
None, buffer ids at its end, outputs' positions, buffer positions at its end, what
:meth:`IdFeed.buffer` rebuilds a step's buffer from)``."""


def skip_empty(pieces: list[Piece], shard: int, row: int) -> tuple[int, int]:
    """The reading cursor ``(piece index, row)`` moved past pieces with no row left.

    ``shard`` indexes ``pieces``; ``row`` is the next row of that piece's shard
    (``(len(pieces), 0)`` once every piece is read).
    """
    while shard < len(pieces):
        _, start, stop = pieces[shard]
        row = max(row, start)
        if row < stop:
            break
        shard += 1
        row = 0
    return shard, row


_CHUNK = 16384
"""Steps of a worker's stream computed at once (outputs and the cursor after each): ~1 ms
of numpy, ~20% cheaper per step than 4,096 (the Python around a chunk is amortised)."""


class IdFeed:
    """The sample ids one logical worker hands on, computed a chunk of steps at a time.

    Produces exactly what the sample-at-a-time definition would, call after
    call, from the same pieces, state and buffer. The next :data:`_CHUNK` steps are
    computed at once (outputs, and the cursor after each step); :meth:`take` slices them,
    so a batch costs a few array slices. The buffer's contents at a step inside a chunk
    are rebuilt only when asked for (:meth:`buffer`, at a commit).

    Args:
        source: the rows (their counts and global offsets).
        pieces: the worker's row ranges ``(shard, start, stop)`` in reading order.
        state: where the worker stands.
        buffer: sample ids in the buffer's slots, in slot order.
        size: buffer size (rows); 0: no buffer.
        key: 64-bit key of the buffer's counter-based generator.
        locate: the epoch positions of sample ids (``int64`` in, ``int64`` out), for
            :meth:`take_placed`. A sample's position must be its id plus a constant of
            its shard (as an epoch plan's, ``plan_start[shard] + row``): ``locate`` is
            asked once per shard and for the buffer given, and the positions of the rows
            read then follow their ids through the shuffle (a few array operations per
            chunk instead of a binary search per id).
        ahead: compute each chunk on a background thread while the one before it is
            taken (:meth:`prefetch`), starting with the first: for the main process's
            replicas of a stream's logical workers, whose thread is the training loop's.
            It holds a second chunk (~0.4-0.55 MB) per feed. The workers compute their
            own chunks (``False``): their thread has nothing else to do meanwhile; so do
            a mixture's lane replicas (one feed per worker and source, many of them
            taking a chunk's ids over a long time).
    """

    def __init__(
        self,
        source: ShardedSource,
        pieces: list[Piece],
        state: WorkerState,
        buffer: list[int],
        size: int,
        key: int,
        locate: Callable[[np.ndarray], np.ndarray] | None = None,
        ahead: bool = False,
    ) -> None:
        self.pieces = pieces
        self.locate = locate
        self._base = [int(source.offsets[f]) for f, _, _ in pieces]
        # The state at the start of the current chunk (before its fill, if any).
        self._shard = state.shard
        self._row = state.row
        self._rows_read = state.rows_read
        self._draws = state.draws
        self._emitted = state.emitted
        self._buf = np.asarray(buffer, np.int64).copy()
        # The positions of the buffer's ids (with ``locate``), and by shard the constant
        # from a sample id to its position.
        self._buf_pos = None if locate is None else locate(self._buf)
        self._shift: dict[int, int] = {}
        self.size = size
        self.key = np.uint64(key)
        self._skip_empty()
        # The current chunk: its outputs, and the cursor after each step (:meth:`_after`).
        self._t = 0
        self._out = np.zeros(0, np.int64)
        self._runs: list[Run] = []
        self._read0 = 0
        self._const: tuple[int, int, int] | None = None
        self._rebuild: tuple[str, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._end_buf = self._buf
        self._end_pos = self._buf_pos
        self._placed: np.ndarray | None = None  # positions of ``_out`` (with ``locate``)
        # The next chunk on its way (:meth:`prefetch`): the state it starts at, the future.
        self._ahead = ahead
        self._pending: tuple[_Start, int, Future[_Chunk | None]] | None = None
        self.prefetch()

    # ------------------------------------------------------------------ state

    def _after(self, k: int) -> tuple[int, int, int]:
        """``(shard, row, rows_read)`` after step ``k`` of the current chunk (``k >= 1``).

        A chunk reads one row per step (none in the drain), so the cursor after a step
        is a function of the step: no array per step is kept."""
        if self._const is not None:
            return self._const
        for end, shard, base, end_shard, end_row in self._runs:
            if k < end:
                return shard, base + k, self._read0 + k
            if k == end:
                return end_shard, end_row, self._read0 + k
        raise AssertionError(f"step {k} lies past the chunk's rows")

    def _at(self, i: int, scalar: int) -> int:
        return self._after(self._t)[i] if self._t else scalar

    @property
    def shard(self) -> int:
        return self._at(0, self._shard)

    @property
    def row(self) -> int:
        return self._at(1, self._row)

    @property
    def rows_read(self) -> int:
        return self._at(2, self._rows_read)

    @property
    def draws(self) -> int:
        return self._draws + (self._t if self.size else 0)

    @property
    def emitted(self) -> int:
        return self._emitted + self._t

    def cursor(self) -> tuple[int, int, int, int, int]:
        """``(shard, row, rows_read, draws, emitted)`` now (what the properties say, at once)."""
        t = self._t
        if t == 0:
            return self._shard, self._row, self._rows_read, self._draws, self._emitted
        shard, row, rows_read = self._after(t)
        return shard, row, rows_read, self._draws + (t if self.size else 0), self._emitted + t

    def buffer(self) -> list[int]:
        """Sample ids in the buffer's slots now, in slot order."""
        if self._t == 0 or self._rebuild is None:
            return (self._end_buf if self._t == len(self._out) else self._buf).tolist()
        if self._t == len(self._out):
            return self._end_buf.tolist()
        kind, start, slots, rows = self._rebuild
        t = self._t
        if kind == "steady":
            buf = start.copy()
            _write_last(buf, slots[:t], rows[:t])
            return buf.tolist()
        ids = start.tolist()  # drain: replay the first t steps
        for j in slots[:t].tolist():
            ids[j] = ids[-1]
            ids.pop()
        return ids

    def exhausted(self) -> bool:
        """No row left to read and nothing in the buffer."""
        if self._t < len(self._out):
            return False
        return self._end_shard() >= len(self.pieces) and self._end_buf.size == 0

    def _end_shard(self) -> int:
        return self._after(len(self._out))[0] if len(self._out) else self._shard

    # ------------------------------------------------------------------ rows

    def _skip_empty(self) -> None:
        self._shard, self._row = skip_empty(self.pieces, self._shard, self._row)

    def _rows(
        self, cursor: tuple[int, int, int], m: int
    ) -> tuple[np.ndarray, list[Run], np.ndarray | None, tuple[int, int, int]]:
        """The next ``m`` (or fewer) rows from ``cursor`` (``(piece, row, rows_read)``, past
        empty pieces): their sample ids, the cursor after each row (as :class:`Run` s, see
        :meth:`_after`), (with ``locate``) their positions, and the cursor after them."""
        shard, row, read = cursor
        ids: list[np.ndarray] = []
        runs: list[Run] = []
        places: list[np.ndarray] | None = None if self.locate is None else []
        got = 0
        while got < m and shard < len(self.pieces):
            _, _, stop = self.pieces[shard]
            take = min(m - got, stop - row)
            first = row
            ids.append(np.arange(first, first + take, dtype=np.int64) + self._base[shard])
            if places is not None:
                places.append(ids[-1] + self._shift_of(self.pieces[shard][0], ids[-1][:1]))
            base = first - got  # the row after the call's k-th row is base + k
            got += take
            row += take
            read += take
            p = shard
            shard, row = skip_empty(self.pieces, shard, row)
            runs.append((got, p, base, shard, row))
        after = (shard, row, read)
        if not ids:
            empty = np.zeros(0, np.int64)
            return empty, runs, None if places is None else empty, after
        if len(ids) == 1:
            return ids[0], runs, None if places is None else places[0], after
        placed = None if places is None else np.concatenate(places)
        return np.concatenate(ids), runs, placed, after

    def _shift_of(self, shard: int, first: np.ndarray) -> int:
        """Position minus sample id in ``shard`` (``first``: one of its ids, ``(1,)``)."""
        shift = self._shift.get(shard)
        if shift is None:
            assert self.locate is not None
            shift = self._shift[shard] = int(self.locate(first)[0] - first[0])
        return shift

    # ------------------------------------------------------------------ chunks

    def _roll(self) -> None:
        """Make the end of the current chunk the start of the next."""
        if len(self._out):
            self._shard, self._row, self._rows_read = self._after(len(self._out))
            self._draws = self.draws
            self._emitted = self.emitted
            self._buf = self._end_buf
            self._buf_pos = self._end_pos
        self._t = 0
        self._out = np.zeros(0, np.int64)
        self._runs, self._read0, self._const = [], self._rows_read, None
        self._rebuild = None
        self._end_buf = self._buf
        self._end_pos = self._buf_pos
        self._placed = None

    def _start(self) -> _Start:
        """The state at the start of the current chunk, which the next chunk's
        computation reads (:meth:`_compute`)."""
        return (self._shard, self._row, self._rows_read, self._draws, self._buf, self._buf_pos)

    def prefetch(self) -> None:
        """Compute the chunk after the current one on the process's ``feed`` background
        thread (:func:`ledger.store.background`), if this feed computes ahead (``ahead``)
        and none is on its way. A chunk (~40 numpy calls over :data:`_CHUNK` steps, ~0.5-1
        ms) is then no longer computed on the training loop's thread every
        :data:`_CHUNK` steps: a stream's main-process work per batch of ~256 samples
        drops by ~12 µs of that thread's CPU (``tools/bench_stream.py``), at the same
        throughput. The result is the chunk computing it when needed would give (a pure
        function of the state the current chunk ends at), and is used only if the feed
        still stands there, in the process that computed it.
        """
        if not self._ahead or self._pending is not None:
            return
        start = self._end_state() if len(self._out) else self._start()
        if start[4].size == 0 and start[0] >= len(self.pieces):
            return  # the epoch is over: no chunk to compute
        try:
            future = background("feed").submit(self._compute, start)
        except RuntimeError:  # the interpreter is shutting down: computed when needed
            return
        self._pending = (start, os.getpid(), future)

    def _end_state(self) -> _Start:
        """The state at the end of the current chunk (the next chunk's start)."""
        shard, row, read = self._after(len(self._out))
        draws = self._draws + (len(self._out) if self.size else 0)
        return (shard, row, read, draws, self._end_buf, self._end_pos)

    def _next_chunk(self) -> bool:
        """Compute (or take the prefetched) next chunk of steps; ``False`` at the end of
        the epoch."""
        self._roll()
        start = self._start()
        pending, self._pending = self._pending, None
        if pending is None:
            chunk = self._compute(start)
        else:
            (shard, row, read, draws, buf, _), pid, future = pending
            # The chunk computed ahead, if it starts here and was computed in this process
            # (a forked child has no background thread of its parent's to finish it).
            if (shard, row, read, draws) == start[:4] and buf is start[4] and pid == os.getpid():
                chunk = future.result()
            else:
                future.cancel()
                chunk = self._compute(start)
        if chunk is None:
            return False
        (
            self._out, self._runs, self._read0, self._const, self._end_buf, self._placed,
            self._end_pos, self._rebuild,
        ) = chunk  # fmt: skip
        self.prefetch()
        return True

    def _compute(self, start: _Start) -> _Chunk | None:
        """The chunk of steps from ``start`` (``None`` at the end of the epoch): reads
        only ``start``, the feed's constant fields and its ``locate`` cache, so it may run
        on a background thread (:meth:`prefetch`)."""
        shard, row, read, draws, buf, buf_pos = start
        cursor = (shard, row, read)
        if self.size == 0:
            out, runs, placed, _ = self._rows(cursor, _CHUNK)
            if out.size == 0:
                return None
            return (out, runs, read, None, buf, placed, buf_pos, None)
        if buf.size < self.size and cursor[0] < len(self.pieces):  # the fill before a draw
            fill, _, fill_pos, cursor = self._rows(cursor, self.size - buf.size)
            buf = np.concatenate([buf, fill])
            if buf_pos is not None and fill_pos is not None:
                buf_pos = np.concatenate([buf_pos, fill_pos])
        if buf.size == 0:
            return None
        if cursor[0] < len(self.pieces):
            return self._steady(cursor, draws, buf, buf_pos)
        return self._drain(cursor, draws, buf, buf_pos)

    def _steady(
        self,
        cursor: tuple[int, int, int],
        draws: int,
        buf: np.ndarray,
        buf_pos: np.ndarray | None,
    ) -> _Chunk:
        """Steps that each output a slot and refill it with the next row (and the
        positions follow the ids, with ``locate``)."""
        read0 = cursor[2]
        rows, runs, rows_pos, _ = self._rows(cursor, _CHUNK)  # one replacement row per step
        t = rows.size
        slots = _draw(self.key, draws, t, buf.size)
        order = _by_slot(slots)  # by slot, then step
        by_slot = slots[order]
        size = buf.size
        new_slot = np.empty(t, bool)  # the first step on its slot
        new_slot[0] = True
        np.not_equal(by_slot[1:], by_slot[:-1], out=new_slot[1:])
        # Each step outputs the row the previous step on its slot wrote, or the slot's
        # content before the chunk: ``src`` indexes ``buf`` then ``rows``.
        src = np.empty(t, np.int64)
        np.add(order[:-1], size, out=src[1:])
        np.copyto(src, by_slot, where=new_slot)
        out = np.empty(t, np.int64)
        out[order] = np.concatenate((buf, rows))[src]
        end = buf.copy()  # the last step on each slot: its row stays
        last = np.flatnonzero(new_slot[1:])
        end[by_slot[last]] = rows[order[last]]
        end[by_slot[-1]] = rows[order[-1]]
        placed = end_pos = None
        if buf_pos is not None and rows_pos is not None:
            placed = np.empty(t, np.int64)
            placed[order] = np.concatenate((buf_pos, rows_pos))[src]
            end_pos = buf_pos.copy()
            end_pos[by_slot[last]] = rows_pos[order[last]]
            end_pos[by_slot[-1]] = rows_pos[order[-1]]
        return (out, runs, read0, None, end, placed, end_pos, ("steady", buf, slots, rows))

    def _drain(
        self,
        cursor: tuple[int, int, int],
        draws: int,
        buf: np.ndarray,
        buf_pos: np.ndarray | None,
    ) -> _Chunk:
        """The drain: no row left, the buffer shrinks by one each step."""
        t = buf.size
        counters = np.arange(draws, draws + t, dtype=np.uint64)
        z = _mix(self.key + counters * np.uint64(_GOLDEN))
        # Step i draws among the t - i slots left; the last one moves into the slot drawn.
        # The loop moves slot numbers; ids and positions are gathered after it.
        slots = (z % np.arange(t, 0, -1, dtype=np.uint64)).astype(np.int64)
        at = list(range(t))
        out = [0] * t
        last = t
        for i, j in enumerate(slots.tolist()):
            last -= 1
            out[i] = at[j]
            at[j] = at[last]
        taken = np.array(out, np.int64)
        empty = np.zeros(0, np.int64)
        return (
            buf[taken],
            [],
            0,
            cursor,
            empty,
            None if buf_pos is None else buf_pos[taken],
            None if buf_pos is None else empty,
            ("drain", buf, slots, np.zeros(0, np.int64)),
        )

    # ------------------------------------------------------------------ the stream

    def take(self, k: int) -> np.ndarray:
        """The next ``k`` sample ids (fewer at the end of the epoch), ``int64 (<= k,)``."""
        t = self._t
        if t + k <= len(self._out):  # the common case: inside the current chunk
            self._t = t + k
            return self._out[t : t + k]
        return self._take(k, False)[0]

    def take_placed(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`take`, and the ids' epoch positions (``int64``, same shape).

        Raises:
            TypeError: if the feed was made without ``locate``.
        """
        t = self._t
        if t + k <= len(self._out):
            self._t = t + k
            return self._out[t : t + k], self._positions()[t : t + k]
        ids, placed = self._take(k, True)
        assert placed is not None
        return ids, placed

    def take_placed_after(self, k: int, previous: int) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`take_placed` of ``k`` ids with the id handed on last before them, if
        that id is ``previous`` and all lie in the current chunk (one slice each, no
        copy): ``int64 (k + 1,)`` ids and positions. ``None`` (nothing taken) otherwise.
        """
        t = self._t
        if t == 0 or t + k > len(self._out) or self._out.item(t - 1) != previous:
            return None
        self._t = t + k
        return self._out[t - 1 : t + k], self._positions()[t - 1 : t + k]

    def _positions(self) -> np.ndarray:
        if self._placed is None:
            if self.locate is None:
                raise TypeError("this IdFeed was made without locate: it has no positions")
            self._placed = self.locate(self._out)
        return self._placed

    def _take(self, k: int, placed: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`take` across chunks (and :meth:`take_placed`'s positions if ``placed``)."""
        parts: list[np.ndarray] = []
        places: list[np.ndarray] = []
        got = 0
        while got < k:
            if self._t == len(self._out) and not self._next_chunk():
                break
            n = min(k - got, len(self._out) - self._t)
            parts.append(self._out[self._t : self._t + n])
            if placed:
                places.append(self._positions()[self._t : self._t + n])
            self._t += n
            got += n
        empty = np.zeros(0, np.int64)
        ids = np.concatenate(parts) if parts else empty
        return ids, (np.concatenate(places) if places else empty) if placed else None


def _draw(key: np.uint64, first: int, steps: int, size: int) -> np.ndarray:
    """Slots ``mix(key + c * golden) % size`` of draws ``c = first .. first + steps - 1``,
    ``int64``. ``z - z // size * size``: numpy divides ``uint64`` by a scalar with
    libdivide (a multiply and shifts) but its ``%`` divides element by element, ~5x
    slower; the results are the same."""
    z = np.arange(first, first + steps, dtype=np.uint64)
    z *= np.uint64(_GOLDEN)
    z += key
    z = _mix(z)
    m = np.uint64(size)
    q = z // m
    q *= m
    z -= q
    return z.view(np.int64)


def _by_slot(slots: np.ndarray) -> np.ndarray:
    """Stable argsort of slot numbers: numpy's stable sort is a radix sort (O(n)) for
    16-bit keys, which buffers up to 32,768 slots fit as ``int16`` (16,384 slots of a
    1,000-slot buffer: 162 µs as ``int16``, 248 µs as ``uint16``, 1,259 µs as ``int64``;
    numpy 2.4, one thread's CPU)."""
    if slots.size and int(slots.max()) < 1 << 15:
        return np.argsort(slots.astype(np.int16), kind="stable")
    if slots.size and int(slots.max()) < 1 << 16:
        return np.argsort(slots.astype(np.uint16), kind="stable")
    return np.argsort(slots, kind="stable")


def _write_last(buf: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
    """``buf[slots[i]] = rows[i]`` in step order: the last write to a slot wins."""
    if slots.size == 0:
        return
    order = _by_slot(slots)
    by_slot = slots[order]
    last = np.ones(slots.size, bool)
    last[:-1] = by_slot[1:] != by_slot[:-1]
    buf[by_slot[last]] = rows[order[last]]
