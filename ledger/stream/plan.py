"""The epoch plan of a stream: which rows each logical worker reads, and what a change
of shape carries over into the new one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
            ``None`` for a fresh plan.
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
            return self.carry.get(rank * self.workers + worker, ([], []))[0]
        return [(f, 0, self.source.shard_rows(f)) for f in self.shards(rank, worker)]

    def tails(self, rank: int, worker: int) -> list[Tail]:
        """Partly packed samples ``(sample id, token offset, length)`` to finish first."""
        if self.carry is not None:
            return self.carry.get(rank * self.workers + worker, ([], []))[1]
        return []

    def positions(self, sample_ids: np.ndarray) -> np.ndarray:
        """Positions (``int64``) of sample ids in this epoch's order."""
        shards, rows = self.source.locate(sample_ids)
        return self.plan_start[shards] + rows


def buffer_key(seed: int, epoch: int, rank: int, worker: int) -> int:
    """Key of the shuffle buffer of logical ``worker`` on ``rank`` in ``epoch``."""
    return derive_key(seed, epoch, rank, worker, 0xB0F)


def carry_over(
    plan: EpochPlan,
    states: list[tuple[int, Any]],
    buffers: dict[tuple[int, int], list[int]],
    total: int,
) -> dict[int, tuple[list[Piece], list[Tail]]]:
    """What an old shape left unserved of ``plan.epoch``, dealt to ``total`` new workers.

    For each old logical worker, in rank and worker order: the rows in its shuffle
    buffer (as one-row pieces), the rest of the piece it was reading, its later pieces;
    and the samples its packer had begun (tails). A rank already past the epoch left
    nothing; a rank not yet in it left all its pieces. Pieces, then tails, are dealt
    round robin to the new global workers ``0..total-1``. Every sample (and every token
    of a packed sample) of the epoch is thus served exactly once across the two shapes.

    Args:
        plan: the old shape's plan of the epoch.
        states: ``(rank, PipelineState)`` of every old rank at the commit.
        buffers: old buffers by ``(rank, worker)``, in slot order.
        total: new ``world_size * workers``.

    Returns:
        By new global worker: ``(pieces, tails)``.
    """
    source = plan.source
    pieces: list[Piece] = []
    tails: list[Tail] = []
    for rank, st in states:
        for worker in range(plan.workers):
            mine = plan.pieces(rank, worker)
            if st.epoch < plan.epoch:
                pieces += mine
                tails += plan.tails(rank, worker)
                continue
            if st.epoch > plan.epoch:
                continue
            ws = st.workers[worker]
            ids = buffers.get((rank, worker), [])
            if ids:
                files, rows = source.locate(np.array(ids, np.int64))
                pieces += [
                    (f, r, r + 1) for f, r in zip(files.tolist(), rows.tolist(), strict=True)
                ]
            if ws.shard < len(mine):
                f, start, stop = mine[ws.shard]
                if max(ws.row, start) < stop:
                    pieces.append((f, max(ws.row, start), stop))
                pieces += mine[ws.shard + 1 :]
            if ws.doc >= 0:
                tails.append((ws.doc, ws.doc_offset, ws.doc_length))
            tails += list(ws.tails)
    out: dict[int, tuple[list[Piece], list[Tail]]] = {g: ([], []) for g in range(total)}
    for i, piece in enumerate(pieces):
        out[i % total][0].append(piece)
    for i, tail in enumerate(tails):
        out[i % total][1].append(tail)
    return out
