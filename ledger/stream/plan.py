"""The epoch plan of a stream: which rows each logical worker reads, and what a change
of shape carries over into the new one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ledger.errors import LogCorrupted
from ledger.order import EpochOrder, derive_key
from ledger.stream.packing import Tail
from ledger.stream.shuffle import Piece
from ledger.stream.source import ShardedSource


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """Which shards each logical worker reads in one epoch, and the epoch's positions.

    The shard order is a seeded permutation (:class:`ledger.order.EpochOrder` over the
    shards); shard ``order[i]`` goes to global logical worker ``i % (W * workers)``, where
    rank ``r``'s worker ``l`` is global worker ``r * workers + l``. ``position`` of a row
    is its index in the concatenation of the shards in that order.

    A worker reads *pieces*: row ranges ``(shard, start, stop)``; in a fresh plan each is
    a whole shard. An epoch interrupted by a change of world size or workers is finished
    from a ``carry``: the pieces and document tails the old shape left unread, dealt to
    the new workers (:func:`carry_over`).

    Args:
        source: the rows.
        seed, epoch, shuffle: as for the loader (``shuffle=False``: shards in path order).
        world_size: ranks.
        workers: logical workers per rank (>= 1).
        carry: by global logical worker, ``(pieces, tails)`` left by an earlier shape, or
            ``None`` for a fresh plan; it may hold some workers only (a loader's own plan
            holds its rank's: asking for another worker's pieces is then a ``KeyError``).
    """

    source: ShardedSource
    seed: int
    epoch: int
    shuffle: bool
    world_size: int
    workers: int
    carry: dict[int, tuple[list[Piece], list[Tail]]] | None = None
    order: np.ndarray = field(init=False, repr=False)
    plan_start: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.source.infos)
        order = EpochOrder(n, derive_key(self.seed, 0x5A4D), self.epoch, self.shuffle)
        perm = order.range(0, n)
        rows = np.diff(self.source.offsets)[perm]
        start = np.empty(n, np.int64)
        start[perm] = np.concatenate([[0], np.cumsum(rows)[:-1]]) if n else []
        object.__setattr__(self, "order", perm)
        object.__setattr__(self, "plan_start", start)

    def shards(self, rank: int, worker: int) -> list[int]:
        """Shard indices (into ``source.files``) of a logical worker in a fresh plan."""
        total = self.world_size * self.workers
        return self.order[rank * self.workers + worker :: total].tolist()

    def pieces(self, rank: int, worker: int) -> list[Piece]:
        """Row ranges ``(shard, start, stop)`` a logical worker reads, in order."""
        if self.carry is not None:
            return self.carry[rank * self.workers + worker][0]
        return [(f, 0, self.source.shard_rows(f)) for f in self.shards(rank, worker)]

    def tails(self, rank: int, worker: int) -> list[Tail]:
        """Partly packed samples ``(sample id, token offset, length)`` to finish first."""
        if self.carry is not None:
            return self.carry[rank * self.workers + worker][1]
        return []

    def positions(self, sample_ids: np.ndarray) -> np.ndarray:
        """Positions (``int64``) of sample ids in this epoch's order."""
        shards, rows = self.source.locate(sample_ids)
        return self.plan_start[shards] + rows


def buffer_key(seed: int, epoch: int, rank: int, worker: int) -> int:
    """Key of the shuffle buffer of logical ``worker`` on ``rank`` in ``epoch``."""
    return derive_key(seed, epoch, rank, worker, 0xB0F)


CARRY_ROUND_ROBIN = "round-robin-v1"
"""The dealing of logs written before ``row-blocks-v1`` (their ``run.json`` names none)."""
CARRY_ALGORITHM = "row-blocks-v1"
"""How a change of shape deals what the old workers left (recorded in ``run.json`` as
``carry``; a run keeps the dealing it began with, see :func:`carry_over`)."""
CARRY_ALGORITHMS = (CARRY_ROUND_ROBIN, CARRY_ALGORITHM)


Buffers = dict[tuple[int, ...], list[int]]
"""Old shuffle buffers by key (``(rank, worker)``, or ``(rank, worker, source)`` for a
mixture's lanes): sample ids in slot order."""


@dataclass(frozen=True, slots=True)
class Held:
    """The rows an old logical worker (or lane) held in its shuffle buffer at the commit:
    ``count`` of them (its state's ``rows_read - emitted``), in slot order, read from the
    rank's newest segment (``key[0]``) only by the new workers they are dealt to."""

    key: tuple[int, ...]
    count: int


class RowDeal:
    """The rows of ``items`` (pieces, and buffers old workers held) laid end to end and
    cut into one run per new worker; a run's buffers are read the first time it, or a
    run of the same old rank, is asked for.

    Args:
        source: the rows' source (to locate buffered ids).
        items: pieces ``(shard, start, stop)`` and :class:`Held` buffers, in order.
        bounds: new worker -> its run ``[lo, hi)`` of the :attr:`rows`.
        read: given old ranks, their buffers (every key of those ranks).
    """

    def __init__(
        self,
        source: Any,
        items: list[Piece | Held],
        bounds: Callable[[int], tuple[int, int]],
        read: Callable[[list[int]], Buffers],
    ) -> None:
        self.source = source
        self.items = items
        self.bounds = bounds
        self.read = read
        self.sizes = np.array(
            [i.count if isinstance(i, Held) else i[2] - i[1] for i in items], np.int64
        )
        self.ends = np.cumsum(self.sizes)
        self.rows = int(self.ends[-1]) if len(items) else 0
        self._buffers: Buffers = {}
        self._ranks_read: set[int] = set()
        self._runs: dict[int, list[Piece]] = {}

    def _overlap(self, g: int) -> list[tuple[int, int, int]]:
        """``(item, first, stop)``: the items run ``g`` takes, and which of their rows."""
        lo, hi = self.bounds(g)
        ends, sizes = self.ends, self.sizes
        out = []
        k = int(np.searchsorted(ends, lo, side="right"))
        while k < len(self.items) and lo < hi:
            first = int(ends[k] - sizes[k])
            if first >= hi:
                break
            if sizes[k]:
                out.append((k, lo - first, min(hi, int(ends[k])) - first))
            lo = int(ends[k])
            k += 1
        return out

    def fetch(self, gs: Iterable[int]) -> None:
        """Read (in one call of ``read``) the buffers runs ``gs`` take, not yet read.

        Raises:
            LogCorrupted: if a buffer read holds another number of rows than its count.
        """
        held = [
            item
            for g in gs
            for k, _, _ in self._overlap(g)
            if isinstance(item := self.items[k], Held) and item.key[0] not in self._ranks_read
        ]
        ranks = sorted({item.key[0] for item in held})
        if not ranks:
            return
        got = self.read(ranks)
        for item in self.items:
            if isinstance(item, Held) and item.key[0] in ranks:
                found = len(got.get(item.key, []))
                if found != item.count:
                    where = f"rank {item.key[0]}'s worker {item.key[1]}"
                    if len(item.key) > 2:
                        where += f" (lane of source {item.key[2]})"
                    raise LogCorrupted(
                        f"{where} read {item.count} rows more than it handed on, so its buffer "
                        f"holds {item.count}, but the log's snapshot holds {found}"
                    )
        self._buffers.update(got)
        self._ranks_read.update(ranks)

    def pieces(self, g: int) -> list[Piece]:
        """Run ``g``: pieces, buffered rows as one-row pieces (read if not yet)."""
        if g not in self._runs:
            self.fetch([g])
            out: list[Piece] = []
            for k, a, b in self._overlap(g):
                item = self.items[k]
                if isinstance(item, Held):
                    out += _one_row_pieces(self.source, self._buffers[item.key][a:b])
                else:
                    out.append((item[0], item[1] + a, item[1] + b))
            self._runs[g] = out
        return self._runs[g]


def carry_over(
    plan: EpochPlan,
    states: list[tuple[int, Any]],
    read: Callable[[list[int]], Buffers],
    total: int,
    dealing: str = CARRY_ALGORITHM,
    wanted: range | None = None,
    buffered: bool = True,
) -> dict[int, tuple[list[Piece], list[Tail]]]:
    """What an old shape left unserved of ``plan.epoch``, dealt to ``total`` new workers.

    For each old logical worker, in rank and worker order: the rows in its shuffle
    buffer (as one-row pieces), the rest of the piece it was reading, its later pieces;
    and the samples its packer had begun (tails). A rank already past the epoch left
    nothing; a rank not yet in it left all its pieces. Every sample (and every token of
    a packed sample) of the epoch is thus served exactly once across the two shapes.

    Dealing (``run.json``'s ``carry``):

    - ``row-blocks-v1``: the ``R`` rows left, in that order, are cut into ``total``
      contiguous runs, new global worker ``g`` taking the ``g``-th (``R // total`` rows,
      one more for the first ``R % total`` workers; pieces cut at the boundaries), and
      the tails likewise by count. A new worker's run covers the buffers of about ``W_old /
      W_new`` old ranks, so a new rank reads only those ranks' segments and holds only
      those rows (the counts come from the states, and each buffer read is checked
      against its count).
    - ``round-robin-v1`` (logs written before it): pieces, then tails, dealt round robin
      (piece ``i`` to worker ``i % total``); every new rank reads every old buffer.

    Args:
        plan: the old shape's plan of the epoch (every old worker's pieces).
        states: ``(rank, PipelineState)`` of every old rank at the commit.
        read: given old ranks, their buffers by ``(rank, worker)``, in slot order.
        total: new ``world_size * workers``.
        dealing: one of :data:`CARRY_ALGORITHMS`.
        wanted: the new global workers whose share to compute (default: all).
        buffered: whether the stream has a shuffle buffer (else no worker holds rows).

    Returns:
        By new global worker in ``wanted``: ``(pieces, tails)``.

    Raises:
        LogCorrupted: if a buffer read holds another number of rows than its state says.
        ValueError: for an unknown ``dealing``.
    """
    if dealing not in CARRY_ALGORITHMS:
        raise ValueError(f"unknown carry dealing {dealing!r}; known: {CARRY_ALGORITHMS}")
    wanted = range(total) if wanted is None else wanted
    items: list[Piece | Held] = []
    tails: list[Tail] = []
    for rank, st in states:
        for worker in range(plan.workers):
            mine = plan.pieces(rank, worker)
            if st.epoch < plan.epoch:
                items += mine
                tails += plan.tails(rank, worker)
                continue
            if st.epoch > plan.epoch:
                continue
            ws = st.workers[worker]
            if buffered and ws.rows_read > ws.emitted:
                items.append(Held((rank, worker), ws.rows_read - ws.emitted))
            if ws.shard < len(mine):
                f, start, stop = mine[ws.shard]
                if max(ws.row, start) < stop:
                    items.append((f, max(ws.row, start), stop))
                items += mine[ws.shard + 1 :]
            if ws.doc >= 0:
                tails.append((ws.doc, ws.doc_offset, ws.doc_length))
            tails += list(ws.tails)
    if dealing == CARRY_ROUND_ROBIN:  # one run of everything, dealt piece by piece
        every = RowDeal(plan.source, items, lambda g: (0, every.rows), read)
        whole = every.pieces(0)
        return {g: (whole[g::total], tails[g::total]) for g in wanted}
    deal = RowDeal(
        plan.source,
        items,
        lambda g: (_cut(g, deal.rows, total), _cut(g + 1, deal.rows, total)),
        read,
    )
    deal.fetch(wanted)  # every run's buffers in one read
    ntails = len(tails)
    return {
        g: (deal.pieces(g), tails[_cut(g, ntails, total) : _cut(g + 1, ntails, total)])
        for g in wanted
    }


def _cut(g: int, n: int, total: int) -> int:
    """Where new worker ``g``'s run of ``n`` things dealt to ``total`` workers starts: each
    worker takes ``n // total``, and the first ``n % total`` one more (so a worker with
    nothing comes after every worker with something, as round robin deals: a rank's
    first logical worker is the first to serve)."""
    base, extra = divmod(n, total)
    return g * base + min(g, extra)


def _one_row_pieces(source: Any, ids: list[int]) -> list[Piece]:
    """Buffered sample ids as one-row pieces ``(shard, row, row + 1)``."""
    files, rows = source.locate(np.array(ids, np.int64))
    return [(f, r, r + 1) for f, r in zip(files.tolist(), rows.tolist(), strict=True)]
