"""A map-style dataset as a source of a mixture with streams: its lanes.

In ``ledger.Mixture({"code": dataset, "prose": stream}, weights=...)`` the map-style
source is read through lanes like a stream (:mod:`ledger.stream.mixing` tells the whole
design); only what a lane reads differs:

* **Its order.** Source epoch ``e`` of a map-style source of ``N`` samples is the seeded
  bijection :class:`ledger.order.EpochOrder` ``(N, source seed, e)`` (the source seed is
  ``derive_key(seed, crc32(name))``, as for every mixture source), the same order a
  mixture of map-style datasets gives the source. Its positions ``[0, N)`` are cut into
  ``G = world_size * workers`` runs of equal length, run ``gw`` for global worker ``gw``
  (as a stream's rows are, :func:`ledger.stream.lanes.cut`). The order is random access,
  so a lane needs no shuffle buffer and nothing but its cursor is state.
* **Its pieces** are ``(e, first, stop)``: positions ``[first, stop)`` of source epoch
  ``e``'s order (where a stream's piece names a shard and rows). A piece carries its
  epoch because after a change of shape a lane may be handed the rest of an older source
  epoch of another lane (:class:`ledger.stream.mixing.Reshape`), whose positions only
  that epoch's order turns into indices.
* **Its samples** are ``dataset[i]``, ``i`` the index (the sample id), loaded one at a
  time in the worker as the lane reaches them. With ``rng="sample"`` or ``"batch"`` the
  global RNGs (torch, numpy, ``random``) are seeded before each one from
  ``(source seed, source epoch, i)`` (:func:`ledger.order.sample_seed`), so a sample's
  draws do not depend on the worker, the batch nor the shape; ``"off"`` seeds nothing.
  numpy and ``random`` are seeded lazily, as a map-style batch's are
  (:func:`ledger.fetch.seeded_lazily`: only once a sample of the process drew from them;
  the sample is the one seeding all three makes either way).
  In a packed mixture an item is a 1-D sequence of token ids (EOS appended, as a
  stream's transform output is). A dataset with a batched ``__getitems__`` (HF
  ``datasets``) is fetched :data:`_AHEAD` indices a call when ``rng="off"`` (nothing is
  seeded, so one call for many samples gives each the same item); a call that raises
  is redone one ``dataset[i]`` at a time, so a bad sample fails where it is reached.
  Seeded, ``dataset[i]`` one at a time keeps each sample's draws its own.

The lane's :class:`~ledger.commits.WorkerState` has a stream lane's fields: ``worker``
the source epoch, ``shard`` the index of the piece being read, ``row`` the next position
of that piece, ``rows_read == emitted`` the positions read this source epoch, ``draws``
0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ledger.commits import WorkerState
from ledger.fetch import batch_getter, failure_of, seeded_lazily
from ledger.order import EpochOrder, sample_seed
from ledger.stream.packing import Packer
from ledger.stream.shuffle import Piece, skip_empty

if TYPE_CHECKING:
    from ledger.stream.lanes import Lanes


@dataclass(frozen=True, slots=True)
class IndexedSource:
    """A map-style dataset (``__len__``, ``__getitem__``) read through a mixture's lanes.

    :class:`ledger.Mixture` wraps each map-style source of a mixture that also holds
    streams in one; the user never builds it.

    Attributes:
        dataset: the dataset.
        packer: the mixture's streams' packer (its items are then token sequences), or
            ``None``.
    """

    dataset: Any
    packer: Packer | None = None

    shuffle_buffer = 0  # the order is random access: no buffer (class constant)
    transform = None

    def __len__(self) -> int:
        return len(self.dataset)

    def config(self) -> dict[str, Any]:
        """What must not change across a resume (the mixture's ``stream`` entry): its
        length, as for a map-style dataset (``verify_data=True`` catches other content)."""
        return {"map": {"len": len(self.dataset)}}

    def pieces(self, seed: int, epoch: int, shuffle: bool, total: int, gw: int) -> list[Piece]:
        """Run ``gw`` of ``total`` equal runs of source ``epoch``'s positions."""
        from ledger.stream.lanes import cut

        return cut([(epoch, 0, len(self.dataset))], total, gw)

    def load(self, seed: int, epoch: int, index: int, seeded: bool) -> tuple[Any, str | None]:
        """``(dataset[index], None)`` seeded as the module docstring says (``seeded``:
        the run's ``rng`` is not ``"off"``); a packed item as ``int64`` tokens + EOS.

        The global RNGs are left seeded (or, numpy's and ``random``'s while no sample of
        the process drew from them, as they were); callers in the main process restore
        the training loop's (:class:`ledger.order.rngs_preserved`).

        Raises:
            Exception: whatever ``dataset[index]`` raised.
        """
        if not seeded:
            return self.finish(self.dataset[index]), None
        item = seeded_lazily(lambda _: self.dataset[index], sample_seed(seed, epoch, index), False)
        return self.finish(item), None

    def finish(self, item: Any) -> Any:
        """A loaded item as the mixture serves it: packed, ``int64`` tokens + EOS."""
        if self.packer is None:
            return item
        tokens = np.asarray(item, dtype=np.int64).reshape(-1)
        out = np.empty(tokens.size + 1, np.int64)
        out[:-1] = tokens
        out[-1] = self.packer.eos_id
        return out


class IndexCursor:
    """Where a map-style lane stands in its pieces of one source epoch, and its indices.

    Args:
        source: the map-style source.
        seed: the source's seed; ``shuffle``: the run's.
        pieces: ``(order epoch, first, stop)`` runs of positions, in reading order.
        shard, row, emitted: the cursor (a lane state's fields).
    """

    def __init__(
        self,
        source: IndexedSource,
        seed: int,
        shuffle: bool,
        pieces: list[Piece],
        shard: int = 0,
        row: int = 0,
        emitted: int = 0,
    ) -> None:
        self.n = len(source)
        self.seed = seed
        self.shuffle = shuffle
        self.pieces = pieces
        self.shard, self.row = skip_empty(pieces, shard, row)
        self.emitted = emitted
        self._orders: dict[int, EpochOrder] = {}

    def _order(self, epoch: int) -> EpochOrder:
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) > 4:
                self._orders.clear()
            order = self._orders[epoch] = EpochOrder(self.n, self.seed, epoch, self.shuffle)
        return order

    def take(self, k: int) -> np.ndarray:
        """The next ``k`` (fewer at the end) indices, ``int64``; advances the cursor."""
        parts: list[np.ndarray] = []
        got = 0
        while got < k and self.shard < len(self.pieces):
            epoch, _, stop = self.pieces[self.shard]
            m = min(k - got, stop - self.row)
            positions = np.arange(self.row, self.row + m, dtype=np.int64)
            parts.append(self._order(epoch).sample_ids(positions).astype(np.int64))
            got += m
            self.shard, self.row = skip_empty(self.pieces, self.shard, self.row + m)
        self.emitted += got
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class IndexIds:
    """Ids-only map-style lane (the main process's replica; as
    :class:`ledger.stream.lanes.LaneIds`)."""

    def __init__(
        self, lanes: Lanes, s: int, epoch: int, pieces: list[Piece], state: WorkerState
    ) -> None:
        self.lanes = lanes
        self.s = s
        self.epoch = epoch
        self.source: IndexedSource = lanes.streams[s]
        self.cursor = IndexCursor(
            self.source, lanes.seeds[s], lanes.shuffle, pieces, state.shard, state.row,
            state.emitted,
        )  # fmt: skip

    def take(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The lane's next ``k`` indices and the source epoch of each, rolling over epochs."""

        def renew(epoch: int) -> None:
            self.cursor = IndexCursor(
                self.source, self.lanes.seeds[self.s], self.lanes.shuffle,
                self.lanes.fresh(self.s, epoch),
            )  # fmt: skip

        ids, epochs, self.epoch = self.lanes.take_rolling(
            self.s, self.epoch, k, lambda m: self.cursor.take(m), renew
        )
        return ids, epochs

    def buffer(self) -> list[int]:
        """Nothing is buffered."""
        return []

    def state(self) -> WorkerState:
        c = self.cursor
        return WorkerState(self.epoch, c.shard, c.row, c.emitted, 0, c.emitted)


_AHEAD = 64
"""Indices a worker's map-style lane computes at once (one Feistel pass each time)."""


class IndexFeed:
    """A map-style lane in a worker: its indices, each loaded by ``dataset[i]`` (as
    :class:`ledger.stream.lanes.LaneFeed`).

    Args:
        lanes: the worker's lanes; ``s``: this source; ``epoch``, ``pieces``, ``state``:
            where the lane stands.
        seeded: seed the global RNGs before each sample (``rng`` not ``"off"``).
        skip_errors: a sample that raises becomes a :class:`~ledger.fetch.Failure`.
    """

    def __init__(
        self,
        lanes: Lanes,
        s: int,
        epoch: int,
        pieces: list[Piece],
        state: WorkerState,
        seeded: bool,
        skip_errors: bool = False,
    ) -> None:
        self.lanes = lanes
        self.s = s
        self.epoch = epoch
        self.source: IndexedSource = lanes.streams[s]
        self.seed = lanes.seeds[s]
        self.seeded = seeded
        self.skip_errors = skip_errors
        self.cursor = IndexCursor(
            self.source, self.seed, lanes.shuffle, pieces, state.shard, state.row
        )
        # (index, loaded item or None: load it when reached)
        self._ahead: deque[tuple[int, Any]] = deque()
        self._getitems = None if seeded else batch_getter(self.source.dataset)

    def _fetch(self, ids: list[int]) -> list[Any]:
        """Items of ``ids`` by one ``__getitems__`` call, or ``None`` each (no batched
        fetch, it raised, or it gave anything but a list of one item per id, such as a dict
        of columns: each is then loaded alone when reached)."""
        if self._getitems is None:
            return [None] * len(ids)
        try:
            items = self._getitems(ids)
        except Exception:
            return [None] * len(ids)
        if not isinstance(items, list) or len(items) != len(ids):
            return [None] * len(ids)
        return [self.source.finish(item) for item in items]

    def reopen(self, epoch: int, index: int) -> tuple[Any, str | None]:
        """A sample begun before (a packed tail), loaded again with its own seed."""
        return self.source.load(self.seed, epoch, index, self.seeded)

    def next(self) -> tuple[int, Any]:
        """The lane's next ``(index, (item, draws))``, rolling over source epochs."""
        fruitless = 0
        while not self._ahead:
            got = self.cursor.take(_AHEAD)
            if got.size:
                self._ahead.extend(zip(got.tolist(), self._fetch(got.tolist()), strict=True))
                break
            fruitless += 1
            if fruitless > 2:
                raise self.lanes.stuck(self.s, self.epoch)
            self.epoch += 1
            self.cursor = IndexCursor(
                self.source, self.seed, self.lanes.shuffle, self.lanes.fresh(self.s, self.epoch)
            )
        index, item = self._ahead.popleft()
        if item is not None:
            return index, (item, None)
        try:
            return index, self.source.load(self.seed, self.epoch, index, self.seeded)
        except Exception as e:
            if not self.skip_errors:
                raise
            return index, (failure_of(0, e), None)
