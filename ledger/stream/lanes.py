"""The lanes of a mixture of streams: one source's stream inside one logical worker.

A lane reads run ``gw`` of its source's epoch (:func:`lane_pieces`), through its own
shuffle buffer and transform, and goes on to the source's next epoch when it runs out
(:mod:`ledger.stream.mixing` tells the whole design). :class:`LaneIds` is the main
process's ids-only lane (an :class:`~ledger.stream.shuffle.IdFeed` per source epoch),
:class:`LaneFeed` the worker's (a :class:`~ledger.stream.worker.Feed`), and
:class:`Positions` the positions one worker takes in a mixture epoch.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ledger.commits import WorkerState
from ledger.errors import LedgerError
from ledger.fetch import failure_of
from ledger.order import derive_key
from ledger.stream.plan import Buffers, EpochPlan, Held, RowDeal, buffer_key
from ledger.stream.sample import load_sample
from ledger.stream.shuffle import IdFeed, Piece
from ledger.stream.source import ShardedSource
from ledger.stream.worker import Feed

if TYPE_CHECKING:
    from ledger.mixture import Mixture
    from ledger.stream.indexed import IndexedSource, IndexFeed, IndexIds
    from ledger.stream.spec import Stream

EMPTY = np.zeros(0, np.int64)


def source_seed(seed: int, name: str) -> int:
    """The seed of a mixture source (as for map-style sources): its lanes' plans,
    buffers and samples are keyed by it."""
    return derive_key(seed, zlib.crc32(name.encode()))


@dataclass(frozen=True, slots=True)
class Positions:
    """The positions one logical worker takes in one mixture epoch, in order: ``gap``,
    then ``first, first + stride, ...`` below ``n``.

    Attributes:
        gap: ``int64 (k,)``: positions an earlier shape left below ``first - gw``.
        first: the first position of the progression.
        stride: ``world_size * workers``.
        n: positions per mixture epoch.
    """

    gap: np.ndarray
    first: int
    stride: int
    n: int

    @property
    def count(self) -> int:
        """Positions in all."""
        return self.gap.size + max(0, -(-(self.n - self.first) // self.stride))

    def at(self, j: int, m: int) -> np.ndarray:
        """Positions ``j .. j + m - 1`` (fewer at the end), ``int64``."""
        k = np.arange(j, min(j + m, self.count), dtype=np.int64)
        g = self.gap.size
        out = self.first + (k - g) * self.stride
        inside = k < g
        out[inside] = self.gap[k[inside]]
        return out


def lane_pieces(
    source: ShardedSource, seed: int, epoch: int, shuffle: bool, total: int, gw: int
) -> list[Piece]:
    """The rows of a source's epoch that lane ``gw`` of ``total`` reads: the shards in the
    stream's seeded order (:class:`ledger.stream.plan.EpochPlan`), concatenated and cut
    into ``total`` runs of equal rows (within one); run ``gw``, as pieces.

    Equal rows, not whole shards as a plain stream deals: every lane of a source takes
    about the same number of its samples, so lanes dealt whole shards of unequal sizes
    would cycle through their source epochs at unequal rates, and serve some samples
    more often than others.
    """
    order = EpochPlan(source, seed, epoch, shuffle, 1, 1).order
    shards = [(int(f), 0, source.shard_rows(int(f))) for f in order.tolist()]
    return cut(shards, total, gw)


def source_pieces(
    stream: Stream | IndexedSource, seed: int, epoch: int, shuffle: bool, total: int, gw: int
) -> list[Piece]:
    """What lane ``gw`` of ``total`` reads of a source's ``epoch``: a stream's rows
    (:func:`lane_pieces`), or a map-style source's positions of its epoch's order
    (:meth:`ledger.stream.indexed.IndexedSource.pieces`)."""
    from ledger.stream.indexed import IndexedSource

    if isinstance(stream, IndexedSource):
        return stream.pieces(seed, epoch, shuffle, total, gw)
    return lane_pieces(stream.source, seed, epoch, shuffle, total, gw)


def lane_ids(
    lanes: Lanes, s: int, epoch: int, pieces: list[Piece], state: WorkerState, buffer: list[int]
) -> LaneIds | IndexIds:
    """The main process's ids-only lane of source ``s``, of its kind."""
    from ledger.stream.indexed import IndexedSource, IndexIds

    if isinstance(lanes.streams[s], IndexedSource):
        return IndexIds(lanes, s, epoch, pieces, state)
    return LaneIds(lanes, s, epoch, pieces, state, buffer)


def lane_feed(
    lanes: Lanes,
    s: int,
    epoch: int,
    pieces: list[Piece],
    state: WorkerState,
    buffer: list[int],
    seed: int,
    rng: str,
    skip_errors: bool,
) -> LaneFeed | IndexFeed:
    """A worker's lane of source ``s``, of its kind (``rng``: the run's RNG mode)."""
    from ledger.stream.indexed import IndexedSource, IndexFeed

    if isinstance(lanes.streams[s], IndexedSource):
        return IndexFeed(lanes, s, epoch, pieces, state, rng != "off", skip_errors)
    return LaneFeed(lanes, s, epoch, pieces, state, buffer, seed, rng == "sample", skip_errors)


def cut(pieces: list[Piece], total: int, gw: int) -> list[Piece]:
    """Run ``gw`` of ``total`` runs of equal rows (within one) of the rows of ``pieces``
    in order."""
    return equal_runs(None, list(pieces), total, _no_buffers).pieces(gw)


def equal_runs(
    source: Any, items: list[Piece | Held], total: int, read: Callable[[list[int]], Buffers]
) -> RowDeal:
    """The rows of ``items`` in ``total`` runs of equal rows (within one): run ``gw`` is
    rows ``gw * R // total`` to ``(gw + 1) * R // total`` of the ``R`` (buffers read on
    demand, see :class:`~ledger.stream.plan.RowDeal`)."""
    deal = RowDeal(
        source, items, lambda g: (g * deal.rows // total, (g + 1) * deal.rows // total), read
    )
    return deal


def _no_buffers(ranks: list[int]) -> Buffers:
    raise AssertionError("pieces only: no buffer to read")


class Lanes:
    """How the lanes of one logical worker roll on to fresh source epochs (picklable)."""

    def __init__(
        self,
        mixture: Mixture,
        seed: int,
        shuffle: bool,
        rank: int,
        world: int,
        workers: int,
        worker: int,
    ) -> None:
        self.streams: tuple[Any, ...] = mixture.sources  # Stream or IndexedSource
        self.seeds = [source_seed(seed, n) for n in mixture.names]
        self.names = mixture.names
        self.shuffle = shuffle
        self.rank = rank
        self.world = world
        self.workers = workers
        self.worker = worker

    def fresh(self, s: int, epoch: int) -> list[Piece]:
        """The pieces of source ``s``'s ``epoch`` for this worker in a fresh plan."""
        return source_pieces(
            self.streams[s], self.seeds[s], epoch, self.shuffle,
            self.world * self.workers, self.rank * self.workers + self.worker,
        )  # fmt: skip

    def key(self, s: int, epoch: int) -> int:
        return buffer_key(self.seeds[s], epoch, self.rank, self.worker)

    def stuck(self, s: int, epoch: int) -> LedgerError:
        return LedgerError(
            f"source {self.names[s]!r} gives logical worker {self.worker} of rank "
            f"{self.rank} no row in its epoch {epoch}: a source needs at least "
            f"world_size * num_workers ({self.world * self.workers}) rows"
        )

    def take_rolling(
        self,
        s: int,
        epoch: int,
        k: int,
        take: Callable[[int], np.ndarray],
        renew: Callable[[int], None],
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """The next ``k`` ids of source ``s``'s lane, rolling over its epochs.

        Args:
            s, epoch: the source and the source epoch the lane stands in.
            k: ids wanted.
            take: ``take(m)``: up to ``m`` more ids of the lane's current epoch.
            renew: ``renew(e)``: start the lane on source epoch ``e`` (fresh pieces).

        Returns:
            ``(ids, epochs, epoch)``: ``k`` ids (``int64``), the source epoch of each,
            and the epoch the lane stands in afterwards.

        Raises:
            LedgerError: if two epochs in a row give the lane no id (a source with fewer
                rows than logical workers).
        """
        got = take(k)
        if got.size == k:
            return got, np.full(k, epoch, np.int64), epoch
        parts, epochs, have, fruitless = [got], [np.full(got.size, epoch, np.int64)], got.size, 0
        while have < k:
            epoch += 1
            renew(epoch)
            more = take(k - have)
            fruitless = 0 if more.size else fruitless + 1
            if fruitless > 1:
                raise self.stuck(s, epoch)
            parts.append(more)
            epochs.append(np.full(more.size, epoch, np.int64))
            have += more.size
        return np.concatenate(parts), np.concatenate(epochs), epoch


class LaneIds:
    """Ids-only lane (the main process's replica): an :class:`IdFeed` per source epoch."""

    def __init__(
        self,
        lanes: Lanes,
        s: int,
        epoch: int,
        pieces: list[Piece],
        state: WorkerState,
        buffer: list[int],
    ) -> None:
        self.lanes = lanes
        self.s = s
        self.epoch = epoch
        stream = lanes.streams[s]
        self.feed = IdFeed(
            stream.source, pieces, state, buffer, stream.shuffle_buffer, lanes.key(s, epoch)
        )

    def take(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The lane's next ``k`` sample ids (rows of its source) and the source epoch of
        each, rolling over epochs."""

        def renew(epoch: int) -> None:
            stream = self.lanes.streams[self.s]
            self.feed = IdFeed(
                stream.source,
                self.lanes.fresh(self.s, epoch),
                WorkerState(0),
                [],
                stream.shuffle_buffer,
                self.lanes.key(self.s, epoch),
            )

        ids, epochs, self.epoch = self.lanes.take_rolling(
            self.s, self.epoch, k, lambda m: self.feed.take(m), renew
        )
        return ids, epochs

    def buffer(self) -> list[int]:
        """Sample ids in the lane's buffer now, in slot order."""
        return self.feed.buffer()

    def state(self) -> WorkerState:
        f = self.feed
        return WorkerState(self.epoch, f.shard, f.row, f.rows_read, f.draws, f.emitted)


class _Held(dict):
    """A worker feed's payloads by sample id, keeping repeats: after a change of shape a
    lane's carried rows may hold one row twice (left by two old lanes in two source
    epochs); both copies are the same payload (same seed), either may be handed on."""

    def __setitem__(self, sid: int, payload: Any) -> None:
        self.setdefault(sid, []).append(payload)

    def pop(self, sid: int) -> Any:  # type: ignore[override]
        copies = self[sid]
        payload = copies.pop()
        if not copies:
            del self[sid]
        return payload


class LaneFeed:
    """A lane in a worker: reads, transforms and shuffles one source's rows."""

    def __init__(
        self,
        lanes: Lanes,
        s: int,
        epoch: int,
        pieces: list[Piece],
        state: WorkerState,
        buffer: list[int],
        seed: int,
        per_sample_rng: bool,
        skip_errors: bool = False,
    ) -> None:
        self.lanes = lanes
        self.s = s
        self.stream = lanes.streams[s]
        self.seed = lanes.seeds[s]
        self.per_sample_rng = per_sample_rng
        self.skip_errors = skip_errors
        self.epoch = epoch
        source = self.stream.source
        records = source.read(buffer, strict=False)
        payloads = [self._load(i, r) for i, r in zip(buffer, records, strict=True)]
        self.feed = self._feed(pieces, state, buffer, payloads)

    def _feed(
        self, pieces: list[Piece], state: WorkerState, buffer: list[int], payloads: list[Any]
    ) -> Feed:
        feed = Feed(
            self.stream.source,
            pieces,
            state,
            buffer,
            payloads,
            self.stream.shuffle_buffer,
            self.lanes.key(self.s, self.epoch),
            self.stream.source.worker_blocks,
            self._load,
        )
        feed._held = _Held()  # a carried epoch may hold a row twice (from two old epochs)
        for sid, payload in zip(buffer, payloads, strict=True):
            feed._held[sid] = payload
        return feed

    def _load(self, sid: int, record: dict[str, Any]) -> tuple[Any, str | None]:
        """``(item, draws)``; with ``skip_errors``, ``(Failure, None)`` if it raised."""
        try:
            return load_sample(self.stream, self.seed, self.epoch, sid, record, self.per_sample_rng)
        except Exception as e:
            if not self.skip_errors:
                raise
            return failure_of(0, e), None

    def reopen(self, epoch: int, row: int) -> tuple[Any, str | None]:
        """A sample begun before (a packed tail), read and transformed again with its seed."""
        record = self.stream.source.read([row])[0]
        return load_sample(self.stream, self.seed, epoch, row, record, self.per_sample_rng)

    def next(self) -> tuple[int, Any]:
        """The lane's next ``(row id, (item, draws))``, rolling over source epochs."""
        fruitless = 0
        while True:
            got = self.feed.next()
            if got is not None:
                return got
            fruitless += 1
            if fruitless > 2:
                raise self.lanes.stuck(self.s, self.epoch)
            self.epoch += 1
            self.feed = self._feed(self.lanes.fresh(self.s, self.epoch), WorkerState(0), [], [])
