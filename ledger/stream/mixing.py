"""Mixtures of streams: ``ledger.Mixture({"code": stream_a, "web": stream_b}, weights=...)``.

Mixing happens inside each logical worker, sample by sample; every choice is a pure
function of the seed and of counters in the worker's state, so nothing random is logged:

1. **Positions.** A mixture epoch is ``epoch_size`` positions (:class:`ledger.Mixture`).
   Of the ``G = world_size * workers`` logical workers, global worker ``gw = rank *
   workers + g`` takes positions ``gw, gw + G, gw + 2G, ...`` of each epoch. The source of
   position ``p`` of epoch ``E`` is the mixture's :meth:`ledger.Mixture.sources_at` of
   ``E * epoch_size + p``: block-stratified and counter-based, the same function as for
   map-style sources, so the shares are exact over every block of positions served.
2. **Lanes.** Each logical worker runs one *lane* per source: the source's stream as a
   plain stream runs in a worker (its own shuffle buffer and transform), reading run
   ``gw`` of the source's epoch cut into ``G`` runs of equal rows (:func:`lane_pieces`;
   the shards in the stream's seeded order), keyed by the source's seed
   (``derive_key(seed, crc32(name))``), and going on to the source's next epoch when it
   runs out. A position of source ``s`` takes the next sample of the worker's lane ``s``, so
   each source keeps its own order and epochs (a small source repeats; every source
   epoch serves each of its samples once) and lanes live on across mixture epochs. A
   sample's transform is seeded from ``(source seed, source epoch, sample id)``.
3. **Packing** (all sources with the same :class:`~ledger.stream.Packer`, or none): the
   worker packs its mixed samples as a stream's worker packs its own
   (:mod:`ledger.stream.packing`); its last sequence of a mixture epoch is padded.
4. **Another shape** at a resume (world size or ``num_workers``), from the commit resumed
   (the *origin*): each source's lanes leave what they had not served (buffers, the rest
   of their source epoch and any later source epoch an old lane had reached), cut into
   equal runs for the new lanes (as :func:`ledger.stream.plan.carry_over` carries a
   stream's);
   in each unfinished mixture epoch, the positions no old worker served below the first
   position no old worker reached, and the samples the packers had begun, are dealt
   round robin to the new workers, which then go on from that position with the new
   stride. Every position of every mixture epoch is served once, and every sample of
   every source epoch once, across the shapes; the order after the change is a function
   of the new shape.

Events: ``sample_id`` is the sample's row in its source, ``source`` its source,
``position`` its place in the mixture epoch, ``worker`` the logical worker.

State: :class:`~ledger.commits.PipelineState` holds ``1 + sources`` worker states per
logical worker ``g``: at ``g * (1 + sources)`` the *mixer* (``worker`` = ``g``,
``emitted`` = positions taken this mixture epoch, ``doc``/``tails`` = the packer's, by
extended id), then one per lane, whose ``worker`` field holds the lane's *source epoch*
(its worker is its place in the tuple) and whose cursor fields are a stream worker's.
Inside the pipeline a sample is named by its *extended id*, ``source epoch * total rows
+ offsets[source] + row`` (:meth:`ledger.Mixture.ext_id`): a sample begun in one source
epoch and finished after a change of shape is transformed again with its own seed. The
batches a packed mixture yields name samples by *flat id*, ``offsets[source] + row``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.utils.data as tud

from ledger import segments
from ledger.commits import Commit, PipelineState, WorkerState, newest_segments, read_commit
from ledger.digest import digest_bytes
from ledger.errors import LedgerError, LogCorrupted, UnsupportedArgument
from ledger.order import derive_key, rngs_preserved
from ledger.pipeline import LoaderSettings, unchanged_phase
from ledger.schema import BUFFER, ORDER_ALGORITHM, SAMPLE, SPAN, EventChunk
from ledger.store import Store
from ledger.stream.packing import PackState, Tail, assemble
from ledger.stream.plan import EpochPlan, buffer_key
from ledger.stream.replica import next_worker
from ledger.stream.sample import load_sample
from ledger.stream.shuffle import IdFeed, Piece
from ledger.stream.source import ShardedSource
from ledger.stream.worker import BatchMeta, Feed, _drawn, identity

if TYPE_CHECKING:
    from ledger.mixture import Mixture
    from ledger.stream.spec import Stream

_EMPTY = np.zeros(0, np.int64)


def source_seed(seed: int, name: str) -> int:
    """The seed of a mixture source (as for map-style sources): its lanes' plans,
    buffers and samples are keyed by it."""
    return derive_key(seed, zlib.crc32(name.encode()))


# ---------------------------------------------------------------------- positions


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


@dataclass(frozen=True, slots=True)
class EpochLeft:
    """What an old shape left of one mixture epoch, dealt to the new global workers.

    Attributes:
        start: the first position no old worker reached (the new progression starts
            there).
        gap: by new global worker: positions below ``start`` no old worker served.
        tails: by new global worker: samples the old packers had begun (extended ids).
        tail_positions: by new global worker: the position of each tail.
    """

    start: int
    gap: dict[int, np.ndarray]
    tails: dict[int, list[Tail]]
    tail_positions: dict[int, list[int]]


@dataclass(frozen=True, slots=True)
class Reshape:
    """What the shape before an origin commit left to the shape after it.

    Attributes:
        epochs: by mixture epoch: what was left of it.
        lanes: by source: ``(source epoch, pieces and tails by new global worker)``: the
            new lanes serve the carried pieces as that source epoch, then fresh ones.
    """

    epochs: dict[int, EpochLeft]
    lanes: list[tuple[int, dict[int, tuple[list[Piece], list[Tail]]]]]


@dataclass(slots=True)
class WorkerPlan:
    """What one logical worker needs to run its part of a mixture epoch (sent to torch's
    worker processes; no store access there).

    Attributes:
        positions: its positions in the epoch.
        tails: samples to finish first (extended ids) and ``tail_positions`` theirs.
        lanes: per source: ``(source epoch, pieces of that epoch)``.
    """

    positions: Positions
    tails: list[Tail]
    tail_positions: list[int]
    lanes: list[tuple[int, list[Piece]]]
    buffers: list[list[int]] = field(default_factory=list)


# ---------------------------------------------------------------------- lanes


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


def cut(pieces: list[Piece], total: int, gw: int) -> list[Piece]:
    """Run ``gw`` of ``total`` runs of equal rows (within one) of the rows of ``pieces``
    in order."""
    rows = np.array([stop - start for _, start, stop in pieces], np.int64)
    ends = np.cumsum(rows)
    n = int(ends[-1]) if ends.size else 0
    lo, hi = gw * n // total, (gw + 1) * n // total
    out: list[Piece] = []
    i = int(np.searchsorted(ends, lo, side="right"))
    while lo < hi and i < len(pieces):
        shard, start, _ = pieces[i]
        first = int(ends[i] - rows[i])
        stop = min(hi, int(ends[i]))
        if stop > lo:
            out.append((shard, start + lo - first, start + stop - first))
        lo = max(lo, stop)
        i += 1
    return out


class _Lanes:
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
        self.streams: tuple[Stream, ...] = mixture.sources
        self.seeds = [source_seed(seed, n) for n in mixture.names]
        self.names = mixture.names
        self.shuffle = shuffle
        self.rank = rank
        self.world = world
        self.workers = workers
        self.worker = worker

    def fresh(self, s: int, epoch: int) -> list[Piece]:
        """The pieces of source ``s``'s ``epoch`` for this worker in a fresh plan."""
        return lane_pieces(
            self.streams[s].source, self.seeds[s], epoch, self.shuffle,
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


class _LaneIds:
    """Ids-only lane (the main process's replica): an :class:`IdFeed` per source epoch."""

    def __init__(
        self,
        lanes: _Lanes,
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
        got = self.feed.take(k)
        if got.size == k:
            return got, np.full(k, self.epoch, np.int64)
        parts = [got]
        epochs = [np.full(got.size, self.epoch, np.int64)]
        have = got.size
        fruitless = 0
        while have < k:
            self.epoch += 1
            stream = self.lanes.streams[self.s]
            pieces = self.lanes.fresh(self.s, self.epoch)
            self.feed = IdFeed(
                stream.source,
                pieces,
                WorkerState(0),
                [],
                stream.shuffle_buffer,
                self.lanes.key(self.s, self.epoch),
            )
            more = self.feed.take(k - have)
            fruitless = 0 if more.size else fruitless + 1
            if fruitless > 1:
                raise self.lanes.stuck(self.s, self.epoch)
            parts.append(more)
            epochs.append(np.full(more.size, self.epoch, np.int64))
            have += more.size
        return np.concatenate(parts), np.concatenate(epochs)

    def state(self) -> WorkerState:
        f = self.feed
        return WorkerState(self.epoch, f.shard, f.row, f.rows_read, f.draws, f.emitted)


class _LaneFeed:
    """A lane in a worker: reads, transforms and shuffles one source's rows."""

    def __init__(
        self,
        lanes: _Lanes,
        s: int,
        epoch: int,
        pieces: list[Piece],
        state: WorkerState,
        buffer: list[int],
        seed: int,
        per_sample_rng: bool,
    ) -> None:
        self.lanes = lanes
        self.s = s
        self.stream = lanes.streams[s]
        self.seed = lanes.seeds[s]
        self.per_sample_rng = per_sample_rng
        self.epoch = epoch
        source = self.stream.source
        payloads = [self._load(i, r) for i, r in zip(buffer, source.read(buffer), strict=True)]
        self.feed = self._feed(pieces, state, buffer, payloads)

    def _feed(
        self, pieces: list[Piece], state: WorkerState, buffer: list[int], payloads: list[Any]
    ) -> Feed:
        return Feed(
            self.stream.source,
            pieces,
            state,
            buffer,
            payloads,
            self.stream.shuffle_buffer,
            self.lanes.key(self.s, self.epoch),
            self._read,
        )

    def _load(self, sid: int, record: dict[str, Any]) -> tuple[Any, str | None]:
        return load_sample(self.stream, self.seed, self.epoch, sid, record, self.per_sample_rng)

    def _read(self, shard: int, row: int, stop: int) -> Iterator[tuple[Any, str | None]]:
        source = self.stream.source
        base = int(source.offsets[shard]) + row
        if stop - row == 1:
            yield self._load(base, source.read([base])[0])
            return
        for i, record in enumerate(source.iter_shard(shard, row)):
            yield self._load(base + i, record)

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


# ---------------------------------------------------------------------- the worker


class MixedRun:
    """One logical worker of a stream mixture in a torch worker: mixes, packs, batches.

    Args:
        mixture: the mixture.
        plan: the worker's plan of the epoch.
        state: its mixer's state; ``lanes``: its lanes' states.
        epoch: the mixture epoch.
        seed, batch_size, collate_fn, per_sample_rng: as for a stream's worker.
    """

    def __init__(
        self,
        mixture: Mixture,
        lanes: _Lanes,
        plan: WorkerPlan,
        mixer: WorkerState,
        lane_states: list[WorkerState],
        epoch: int,
        seed: int,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        per_sample_rng: bool,
    ) -> None:
        self.mixture = mixture
        self.worker = lanes.worker
        self.epoch = epoch
        self.seed = seed
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.offsets = mixture.offsets
        self.positions = plan.positions
        self.k = mixer.emitted
        self.lanes = [
            _LaneFeed(lanes, s, e, pieces, st, buf, seed, per_sample_rng)
            for s, ((e, pieces), st, buf) in enumerate(
                zip(plan.lanes, lane_states, plan.buffers, strict=True)
            )
        ]
        self.packer = mixture.sources[0].packer
        self._queue: list[int] = []  # sources of the next positions
        self._current: np.ndarray | None = None  # tokens of the sample in progress
        doc = (mixer.doc, mixer.doc_offset, mixer.doc_length) if mixer.doc >= 0 else None
        self.packing = PackState(doc, list(mixer.tails), f"worker {self.worker}")
        if doc is not None:
            self._current = self._reopen(doc)
        self._opened: list[tuple[np.ndarray, str | None]] = []

    def _sources(self, m: int) -> None:
        """Queue the sources of the next ``m`` positions (at least)."""
        done = self.k + len(self._queue)
        ps = self.positions.at(done, max(m, 64))
        if ps.size:
            epoch_base = self.epoch * self.mixture.epoch_size
            self._queue += self.mixture.sources_at(self.seed, ps + epoch_base).tolist()

    def _next(self) -> tuple[int, Any] | None:
        """The next mixed sample: ``(extended id, (item, draws))``, or ``None`` at the end."""
        if not self._queue:
            self._sources(1)
            if not self._queue:
                return None
        s = self._queue.pop(0)
        self.k += 1
        lane = self.lanes[s]
        row, loaded = lane.next()
        return self.mixture.ext_id(lane.epoch, s, row), loaded

    def _reopen(self, tail: Tail) -> np.ndarray:
        """The tokens of a sample begun before (a tail, or the sample in progress)."""
        ext, _, length = tail
        epoch, s, row = self.mixture.split_ext(ext)
        lane = self.lanes[s]
        with rngs_preserved(True):
            item, _ = load_sample(
                lane.stream,
                lane.seed,
                epoch,
                row,
                lane.stream.source.read([row])[0],
                lane.per_sample_rng,
            )
        if len(item) != length:
            raise LedgerError(
                f"sample {row} of source {self.mixture.names[s]!r} has {len(item)} tokens "
                f"now, the log says {length}: the transform is not deterministic"
            )
        return np.asarray(item)

    def batches(self) -> Iterator[tuple[BatchMeta, Any]]:
        """``(meta, batch)`` until the worker's part of the epoch ends."""
        while True:
            meta, data = self._items() if self.packer is None else self._sequences()
            if meta.sample_ids.size == 0:
                return
            yield meta, data

    def _items(self) -> tuple[BatchMeta, Any]:
        ids: list[int] = []
        items: list[Any] = []
        draws: list[str | None] = []
        self._sources(self.batch_size)
        while len(ids) < self.batch_size:
            nxt = self._next()
            if nxt is None:
                break
            ids.append(nxt[0])
            items.append(nxt[1][0])
            draws.append(nxt[1][1])
        meta = BatchMeta(self.worker, self.epoch, np.array(ids, np.int64), None, _drawn(draws))
        return meta, self.collate_fn(items) if items else None

    def _pull(self) -> tuple[int, int] | None:
        nxt = self._next()
        if nxt is None:
            return None
        flat, (item, draws) = nxt
        self._opened.append((item, draws))
        return flat, len(item)

    def _open_tail(self, tail: Tail) -> None:
        self._opened.append((self._reopen(tail), None))  # its draws were logged before

    def _sequences(self) -> tuple[BatchMeta, Any]:
        packer = self.packer
        assert packer is not None
        self._opened = []
        before = self.packing.doc
        chosen = self.packing.pack(packer.seq_len, self.batch_size, self._pull, self._open_tail)
        # The tokens of each span: the sample in progress, then the samples opened here in
        # order (one sample id may come twice in a batch: a small source repeats).
        docs: list[np.ndarray] = []
        draws: list[str | None] = []
        opened = iter(self._opened)
        current = self._current
        for i, (_, start, _, _) in enumerate(chosen):
            begins = before is None if i == 0 else chosen[i - 1][2] >= chosen[i - 1][3]
            if begins:
                current, drawn = next(opened)
                draws.append(drawn if start == 0 else None)
            else:
                draws.append(None)
            assert current is not None
            docs.append(current)
        self._current = current if self.packing.doc is not None else None
        ids = [sid for sid, _, _, _ in chosen]
        spans = [(start, end, length) for _, start, end, length in chosen]
        meta = BatchMeta(
            self.worker,
            self.epoch,
            np.array(ids, np.int64),
            np.array(spans, np.int64).reshape(-1, 3),
            _drawn(draws),
        )
        if not chosen:
            return meta, None
        nth = iter(docs)
        flat = (np.array(ids, np.int64) % self.mixture.total).tolist()
        return meta, assemble(packer, flat, spans, lambda _sid: next(nth))


class MixedDataset(tud.IterableDataset):
    """What torch's DataLoader iterates for a stream mixture: physical worker ``p`` plays
    logical worker ``(p + start.next_worker) % workers`` (as :class:`StreamDataset`)."""

    def __init__(self, mixture: Mixture, settings: LoaderSettings, workers: int) -> None:
        self.mixture = mixture
        self.seed = settings.seed
        self.shuffle = settings.shuffle
        self.rank = settings.rank
        self.world = settings.world_size
        self.workers = workers
        self.batch_size = settings.batch_size
        self.collate_fn = settings.collate_fn
        self.per_sample_rng = settings.rng == "sample"
        self.digest = settings.digest
        self.start: PipelineState | None = None
        self.plans: list[WorkerPlan] = []

    def __iter__(self) -> Iterator[tuple[BatchMeta, Any]]:
        info = torch.utils.data.get_worker_info()
        start = self.start
        assert start is not None
        g = ((info.id if info is not None else 0) + start.next_worker) % self.workers
        guard = info is None and self.per_sample_rng
        width = 1 + len(self.mixture.names)
        states = start.workers[g * width : (g + 1) * width]
        lanes = _Lanes(
            self.mixture, self.seed, self.shuffle, self.rank, self.world, self.workers, g
        )
        with rngs_preserved(guard):
            run = MixedRun(
                self.mixture, lanes, self.plans[g], states[0], list(states[1:]), start.epoch,
                self.seed, self.batch_size, self.collate_fn, self.per_sample_rng,
            )  # fmt: skip
            batches = run.batches()
        while True:
            with rngs_preserved(guard):
                item = next(batches, None)
            if item is None:
                return
            if self.digest:
                item[0].digest = digest_bytes(item[1])
            yield item


# ---------------------------------------------------------------------- the replica


class MixedReplica:
    """Ids-only mirror of one logical worker of a stream mixture in the main process:
    predicts the samples of each batch, checks them and gives their positions."""

    def __init__(
        self,
        pipeline: MixedStreamPipeline,
        g: int,
        plan: WorkerPlan,
        mixer: WorkerState,
        lane_states: list[WorkerState],
        epoch: int,
    ) -> None:
        self.pipeline = pipeline
        self.worker = g
        self.epoch = epoch
        self.plan = plan
        self.k = mixer.emitted
        lanes = pipeline.lanes(g)
        self.lanes = [
            _LaneIds(lanes, s, e, pieces, st, buf)
            for s, ((e, pieces), st, buf) in enumerate(
                zip(plan.lanes, lane_states, plan.buffers, strict=True)
            )
        ]
        doc = (mixer.doc, mixer.doc_offset, mixer.doc_length) if mixer.doc >= 0 else None
        self.packing = PackState(doc, list(mixer.tails), f"worker {g}")
        self.doc_position = -1  # position of the sample in progress
        if doc is not None:
            if self.k > 0:
                self.doc_position = int(plan.positions.at(self.k - 1, 1)[0])
            else:  # a tail begun in this shape
                self.doc_position = plan.tail_positions[self._tails_done() - 1]

    def _tails_done(self) -> int:
        return len(self.plan.tails) - len(self.packing.tails)

    def exhausted(self) -> bool:
        return self.k >= self.plan.positions.count and self.packing.exhausted()

    def mixer(self) -> WorkerState:
        d = self.packing.doc if self.packing.doc is not None else (-1, 0, 0)
        return WorkerState(
            self.worker,
            emitted=self.k,
            doc=d[0],
            doc_offset=d[1],
            doc_length=d[2],
            tails=tuple(self.packing.tails),
        )

    def buffers(self) -> list[list[int]]:
        return [lane.feed.buffer() for lane in self.lanes]

    def _take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` mixed samples: ``(extended ids, positions)``."""
        mixture = self.pipeline.mixture
        ps = self.plan.positions.at(self.k, n)
        self.k += ps.size
        flat = np.empty(ps.size, np.int64)
        if ps.size:
            src = mixture.sources_at(self.pipeline.seed, ps + self.epoch * mixture.epoch_size)
            for s in np.unique(src).tolist():
                rows = np.flatnonzero(src == s)
                ids, epochs = self.lanes[s].take(rows.size)
                flat[rows] = mixture.ext_id(epochs, s, ids)
        return flat, ps

    def fold(self, meta: BatchMeta) -> np.ndarray:
        """Advance by one consumed batch and return each row's position.

        Raises:
            LedgerError: if the batch is not the one the plan predicts.
        """
        ids = meta.sample_ids
        if meta.spans is None:
            want, ps = self._take(ids.size)
            self._check(want, ids)
            return ps
        before = self.packing.doc
        tails_before = self._tails_done()
        pulled: list[np.ndarray] = []

        def expect(begun: np.ndarray) -> None:
            want, ps = self._take(begun.size)
            self._check(want, begun)
            pulled.append(ps)

        self.packing.fold(ids, meta.spans, expect)
        tails_popped = self._tails_done() - tails_before
        starts = list(self.plan.tail_positions[tails_before : tails_before + tails_popped])
        begun = np.concatenate([np.array(starts, np.int64), *pulled])
        end, length = meta.spans[:, 1], meta.spans[:, 2]
        begins = np.empty(ids.size, bool)
        if ids.size:
            begins[0] = before is None
            begins[1:] = end[:-1] >= length[:-1]
        # Each span's sample: the one in progress before the batch, then those begun here.
        which = np.cumsum(begins) - 1
        doc_positions = np.concatenate([[self.doc_position], begun]).astype(np.int64)
        positions = doc_positions[which + 1]
        if ids.size:
            self.doc_position = int(positions[-1])
        return positions

    def _check(self, want: np.ndarray, ids: np.ndarray) -> None:
        if want.size == ids.size and np.array_equal(want, ids):
            return
        bad = next((i for i in range(ids.size) if i >= want.size or want[i] != ids[i]), ids.size)
        said = int(want[bad]) if bad < want.size else "the end of its epoch"
        raise LedgerError(
            f"worker {self.worker} produced flat sample {int(ids[bad]) if bad < ids.size else None}, "
            f"but the mixture's plan says {said}: the pipeline is not deterministic"
        )


# ---------------------------------------------------------------------- the pipeline


class MixedStreamPipeline:
    """The pipeline of a :class:`ledger.Mixture` of streams (:class:`ledger.pipeline.Pipeline`).

    Args:
        mixture: the mixture (every source a :class:`ledger.stream.Stream`).
        settings: the loader's settings (``drop_last`` and ``persistent_workers`` off).

    Raises:
        ValueError: for ``drop_last=True`` or ``persistent_workers=True``, or an epoch
            with fewer positions than logical workers.
        UnsupportedArgument: for ``on_error="skip"`` (streams do not support it yet).
    """

    def __init__(self, mixture: Mixture, settings: LoaderSettings) -> None:
        if settings.drop_last or settings.persistent_workers:
            raise ValueError(
                "a Mixture of streams serves every position (drop_last=False) and needs "
                "fresh workers each epoch (persistent_workers=False)"
            )
        if settings.on_error != "raise":
            raise UnsupportedArgument(
                f"on_error={settings.on_error!r} is not supported for a Mixture of streams "
                "(nor for a Stream): catch the error in the transform instead"
            )
        self.mixture = mixture
        self.dataset = mixture
        self.settings = settings
        self.seed = settings.seed
        self.rank = settings.rank
        self.world_size = settings.world_size
        self.k = max(settings.num_workers, 1)
        self.width = 1 + len(mixture.names)
        self.workers = self.k * self.width  # worker states per rank state
        self.store = settings.store
        small = int(np.argmin(mixture.lengths))
        if int(mixture.lengths[small]) < self.world_size * self.k:
            raise ValueError(
                f"source {mixture.names[small]!r} has {int(mixture.lengths[small])} rows, "
                f"fewer than the {self.world_size * self.k} logical workers whose lanes "
                "share each of its epochs: use fewer workers"
            )
        if mixture.epoch_size < self.world_size * self.k:
            raise ValueError(
                f"a mixture epoch of {mixture.epoch_size} positions cannot feed "
                f"{self.world_size * self.k} logical workers: raise epoch_size"
            )
        for name, stream in zip(mixture.names, mixture.sources, strict=True):
            stream.source.record_digests(self.store, f"data/rowgroups/source={name}")
        self.torch_dataset = MixedDataset(mixture, settings, self.k)
        self.torch_loader = tud.DataLoader(
            self.torch_dataset,
            batch_size=None,
            num_workers=settings.num_workers,
            collate_fn=identity,
            **settings.torch_kwargs,
        )
        self.buffers: dict[tuple[int, int], list[int]] = {}  # (worker, source) -> ids
        self.replicas: list[MixedReplica] = []
        self._reshapes: dict[tuple[str, int, int], Reshape] = {}
        self._mixers: list[WorkerState] = []
        self._lane_states: list[list[WorkerState]] = []

    # ------------------------------------------------------------------ config

    def config(self) -> dict[str, Any]:
        s = self.settings
        packer = self.mixture.sources[0].packer
        mix = self.mixture.config()
        for entry, stream in zip(mix["sources"], self.mixture.sources, strict=True):
            entry["stream"] = stream.config()
        return {
            "dataset_len": self.mixture.epoch_size,
            "seed": s.seed,
            "shuffle": s.shuffle,
            "batch_size": s.batch_size,
            "drop_last": s.drop_last,
            "world_size": s.world_size,
            "order": ORDER_ALGORITHM,
            "rng": s.rng,
            "packer": None
            if packer is None
            else {"seq_len": packer.seq_len, "eos_id": packer.eos_id, "pad_id": packer.pad_id},
            "mixture": mix,
            "workers": self.k,
        }

    def check_logged(self, logged: dict[str, Any]) -> None:
        entries = logged.get("mixture", {}).get("sources", [])
        for entry, stream in zip(entries, self.mixture.sources, strict=False):
            stream.source.check(entry.get("stream", {}).get("source", []))

    def batches_per_epoch(self) -> int:
        raise TypeError("a stream mixture's batches per epoch are not known in advance")

    # ------------------------------------------------------------------ plans

    def lanes(
        self, g: int, world: int | None = None, workers: int | None = None, rank: int | None = None
    ) -> _Lanes:
        return _Lanes(
            self.mixture,
            self.seed,
            self.settings.shuffle,
            self.rank if rank is None else rank,
            world or self.world_size,
            workers or self.k,
            g,
        )

    def _lane_pieces(
        self, s: int, epoch: int, origin: str, world: int, workers: int, rank: int, g: int
    ) -> list[Piece]:
        """What lane ``s`` of worker ``g`` of ``rank`` reads in its source ``epoch``, in a
        shape ``(world, workers)`` that began at ``origin``."""
        if origin:
            carried, by_worker = self._reshape(origin, world, workers).lanes[s]
            if epoch == carried:
                return by_worker.get(rank * workers + g, ([], []))[0]
        stream = self.mixture.sources[s]
        seed = source_seed(self.seed, self.mixture.names[s])
        return lane_pieces(
            stream.source, seed, epoch, self.settings.shuffle, world * workers, rank * workers + g
        )

    def _positions(
        self, epoch: int, origin: str, world: int, workers: int, gw: int
    ) -> tuple[Positions, list[Tail], list[int]]:
        """A global worker's positions and tails (with theirs) in a mixture epoch."""
        n = self.mixture.epoch_size
        stride = world * workers
        left = self._reshape(origin, world, workers).epochs.get(epoch) if origin else None
        if left is None:
            return Positions(_EMPTY, gw, stride, n), [], []
        return (
            Positions(left.gap.get(gw, _EMPTY), left.start + gw, stride, n),
            left.tails.get(gw, []),
            left.tail_positions.get(gw, []),
        )

    def _plan(self, state: PipelineState, g: int) -> WorkerPlan:
        gw = self.rank * self.k + g
        positions, tails, tail_positions = self._positions(
            state.epoch, state.origin, self.world_size, self.k, gw
        )
        lanes = []
        buffers = []
        for s in range(len(self.mixture.names)):
            lane = state.workers[g * self.width + 1 + s]
            pieces = self._lane_pieces(
                s, lane.worker, state.origin, self.world_size, self.k, self.rank, g
            )
            lanes.append((lane.worker, pieces))
            buffers.append(self.buffers.get((g, s), []))
        return WorkerPlan(positions, tails, tail_positions, lanes, buffers)

    def _reshape(self, origin: str, world: int, workers: int) -> Reshape:
        """What the shape before ``origin`` left to the shape ``(world, workers)`` after it."""
        key = (origin, world, workers)
        found = self._reshapes.get(key)
        if found is None:
            found = self._carry(read_commit(self.store, origin), world, workers)
            if len(self._reshapes) > 8:
                self._reshapes.clear()
            self._reshapes[key] = found
        return found

    def _carry(self, head: Commit, world: int, workers: int) -> Reshape:
        """See :class:`Reshape` and the module docstring (4.)."""
        n = self.mixture.epoch_size
        total = world * workers
        states = sorted(head.states, key=lambda st: st.rank)
        old_world = head.world_size
        old_k = len(states[0].workers) // self.width
        old_origin = states[0].origin
        buffers = self._old_buffers(head, states)
        epochs: dict[int, EpochLeft] = {}
        for e in range(min(st.epoch for st in states), max(st.epoch for st in states) + 1):
            gaps: list[np.ndarray] = []
            nexts: list[tuple[int, int]] = []
            tails: list[Tail] = []
            tail_positions: list[int] = []
            for st in states:
                if st.epoch > e:
                    continue  # the rank served all of epoch e
                for g in range(old_k):
                    gw = st.rank * old_k + g
                    pos, old_tails, old_tail_pos = self._positions(
                        e, old_origin, old_world, old_k, gw
                    )
                    k = 0
                    if st.epoch == e:
                        mixer = st.workers[g * self.width]
                        k = mixer.emitted
                        done = len(old_tails) - len(mixer.tails)
                        if mixer.doc >= 0:
                            tails.append((mixer.doc, mixer.doc_offset, mixer.doc_length))
                            at = pos.at(k - 1, 1)[0] if k else old_tail_pos[done - 1]
                            tail_positions.append(int(at))
                        tails += list(mixer.tails)
                        tail_positions += old_tail_pos[done:]
                    else:
                        tails += old_tails
                        tail_positions += old_tail_pos
                    if k < pos.gap.size:
                        gaps.append(pos.gap[k:])
                    nxt = pos.first + max(k - pos.gap.size, 0) * pos.stride
                    if nxt < n:
                        nexts.append((nxt, pos.stride))
            start = min(n, max((x for x, _ in nexts), default=n))
            left = np.sort(
                np.concatenate(
                    [*gaps, *(np.arange(x, start, stride, dtype=np.int64) for x, stride in nexts)]
                    or [_EMPTY]
                )
            )
            epochs[e] = EpochLeft(
                start,
                {w: left[w::total] for w in range(total)},
                {w: tails[w::total] for w in range(total)},
                {w: tail_positions[w::total] for w in range(total)},
            )
        lanes = []
        for s in range(len(self.mixture.names)):
            stream = self.mixture.sources[s]
            old = [
                (st.rank, g, st.workers[g * self.width + 1 + s])
                for st in states
                for g in range(old_k)
            ]
            last = max(lane.worker for _, _, lane in old)
            pieces: list[Piece] = []
            for rank, g, lane in old:
                for e in range(lane.worker, last + 1):
                    mine = self._lane_pieces(s, e, old_origin, old_world, old_k, rank, g)
                    if e > lane.worker:
                        pieces += mine
                        continue
                    ids = buffers.get((rank, g, s), [])
                    if ids:
                        files, rows = stream.source.locate(np.array(ids, np.int64))
                        pieces += [
                            (f, r, r + 1)
                            for f, r in zip(files.tolist(), rows.tolist(), strict=True)
                        ]
                    if lane.shard < len(mine):
                        f, lo, hi = mine[lane.shard]
                        if max(lane.row, lo) < hi:
                            pieces.append((f, max(lane.row, lo), hi))
                        pieces += mine[lane.shard + 1 :]
            dealt: dict[int, tuple[list[Piece], list[Tail]]] = {
                w: (cut(pieces, total, w), []) for w in range(total)
            }
            lanes.append((last, dealt))
        return Reshape(epochs, lanes)

    def _old_buffers(
        self, head: Commit, states: list[PipelineState]
    ) -> dict[tuple[int, int, int], list[int]]:
        """Lane buffers at ``head``: ``(rank, worker, source) -> ids`` in slot order."""
        refs = None
        out: dict[tuple[int, int, int], list[int]] = {}
        for st in states:
            if not any(w.rows_read > w.emitted for i, w in enumerate(st.workers) if i % self.width):
                continue
            if refs is None:
                refs = newest_segments(self.store, head, len(head.states))
            ref = refs[st.rank]
            if ref is None:
                raise LogCorrupted(f"commit {head.id} has buffered samples but no segment")
            for (g, s), ids in self._read_buffers(ref, st.batch).items():
                out[(st.rank, g, s)] = ids
        return out

    def _read_buffers(self, ref: Any, batch: int) -> dict[tuple[int, int], list[int]]:
        table = segments.read(
            self.store,
            ref.path,
            rows=ref.rows,
            checksum=ref.sha256,
            columns=["worker", "batch", "position", "sample_id", "kind", "source"],
        )
        table = table.filter(pc.equal(table["kind"].cast(pa.string()), BUFFER))
        table = table.filter(pc.equal(table["batch"], batch))
        index = {name: i for i, name in enumerate(self.mixture.names)}
        out: dict[tuple[int, int], list[tuple[int, int]]] = {}
        names = table["source"].cast(pa.string()).to_pylist()
        for w, name, slot, sid in zip(
            table["worker"].to_pylist(),
            names,
            table["position"].to_pylist(),
            table["sample_id"].to_pylist(),
            strict=True,
        ):
            if name not in index:
                raise LogCorrupted(f"{ref.path}: a buffer event names source {name!r}")
            out.setdefault((int(w), index[name]), []).append((int(slot), int(sid)))
        return {key: [sid for _, sid in sorted(v)] for key, v in out.items()}

    # ------------------------------------------------------------------ states

    def initial_state(self) -> PipelineState:
        self.buffers = {}
        self.replicas = []
        lanes = [[WorkerState(0)] * len(self.mixture.names) for _ in range(self.k)]
        return self.epoch_start(0, 0, "", lanes)

    def epoch_start(
        self, epoch: int, batch: int, origin: str, lanes: list[list[WorkerState]]
    ) -> PipelineState:
        """The state at the start of ``epoch`` (or of the first later one that gives this
        rank a position), with the lanes where they stand."""
        while True:
            busy = []
            mixers = []
            for g in range(self.k):
                gw = self.rank * self.k + g
                pos, tails, _ = self._positions(epoch, origin, self.world_size, self.k, gw)
                busy.append(pos.count > 0 or bool(tails))
                mixers.append(WorkerState(g, tails=tuple(tails)))
            if any(busy):
                workers = tuple(w for g in range(self.k) for w in (mixers[g], *lanes[g]))
                first = busy.index(True)
                return PipelineState(self.rank, epoch, 0, batch, workers, first, origin=origin)
            if not origin:
                raise LedgerError(
                    f"rank {self.rank} gets no position in mixture epoch {epoch}: raise "
                    "epoch_size or use fewer workers"
                )
            epoch += 1

    def begin(self, state: PipelineState) -> Iterable[tuple[Any, Any]]:
        self.buffers = self.current_buffers()
        plans = [self._plan(state, g) for g in range(self.k)]
        self.replicas = [
            MixedReplica(
                self,
                g,
                plans[g],
                state.workers[g * self.width],
                list(state.workers[g * self.width + 1 : (g + 1) * self.width]),
                state.epoch,
            )
            for g in range(self.k)
        ]
        self._mixers = [r.mixer() for r in self.replicas]
        self._lane_states = [[lane.state() for lane in r.lanes] for r in self.replicas]
        self.torch_dataset.start = state
        self.torch_dataset.plans = plans
        return self.torch_loader

    def current_buffers(self) -> dict[tuple[int, int], list[int]]:
        """Each lane's buffer now, by ``(worker, source)``, in slot order."""
        if not self.replicas:
            return self.buffers
        return {
            (r.worker, s): ids for r in self.replicas for s, ids in enumerate(r.buffers()) if ids
        }

    def record(
        self, state: PipelineState, meta: BatchMeta
    ) -> tuple[PipelineState, list[EventChunk]]:
        """Fold one consumed batch: the events to log and the state after it.

        Raises:
            LedgerError: if the batch is not the one the plan predicts.
        """
        if meta.worker != state.next_worker or meta.epoch != state.epoch:
            raise LedgerError(
                f"a batch of worker {meta.worker} (epoch {meta.epoch}) arrived where worker "
                f"{state.next_worker} (epoch {state.epoch}) was next"
            )
        replica = self.replicas[meta.worker]
        positions = replica.fold(meta)
        _, codes, ids = self.mixture.split_ext(meta.sample_ids)
        codes = codes.astype(np.int16)
        spans = meta.spans
        chunk = EventChunk(
            SPAN if spans is not None else SAMPLE,
            state.epoch,
            state.batch,
            meta.worker,
            0,
            ids,
            positions=positions,
            token_start=spans[:, 0] if spans is not None else None,
            token_end=spans[:, 1] if spans is not None else None,
            length=spans[:, 2] if spans is not None else None,
            values=meta.draws,
            digest=meta.digest,
            sources=codes,
            source_names=self.mixture.names,
        )
        g = meta.worker
        self._mixers[g] = replica.mixer()
        self._lane_states[g] = [lane.state() for lane in replica.lanes]
        after = next_worker(self.replicas, g)  # type: ignore[arg-type]
        if after < 0:  # the rank's part of the mixture epoch is over; lanes go on
            self.buffers = self.current_buffers()
            lanes = self._lane_states
            self.replicas = []
            return self.epoch_start(state.epoch + 1, state.batch + 1, state.origin, lanes), [chunk]
        workers = tuple(w for i in range(self.k) for w in (self._mixers[i], *self._lane_states[i]))
        nxt = PipelineState(
            self.rank,
            state.epoch,
            state.epoch_batch + 1,
            state.batch + 1,
            workers,
            after,
            origin=state.origin,
        )
        return nxt, [chunk]

    def skip(
        self, state: PipelineState, batches: int, reason: str
    ) -> tuple[PipelineState, list[EventChunk]]:
        """As for a stream: the next batches are produced and logged as ``rollback`` events
        (a stream's next batches are known only by running them)."""
        from ledger.stream.pipeline import StreamPipeline

        return StreamPipeline.skip(self, state, batches, reason)  # type: ignore[arg-type]

    def finish(self, state: PipelineState, start_epoch: int) -> None:
        if state.epoch == start_epoch:
            raise LedgerError(
                f"the workers stopped in mixture epoch {state.epoch} while the plan still "
                f"holds positions for worker {state.next_worker}"
            )

    def snapshot(self, state: PipelineState) -> list[EventChunk]:
        """``buffer`` events: each lane's buffer, in slot order (``source`` names it)."""
        out = []
        for (g, s), ids in sorted(self.current_buffers().items()):
            if not ids:
                continue
            out.append(
                EventChunk(
                    BUFFER,
                    state.epoch,
                    state.batch,
                    g,
                    0,
                    np.array(ids, np.int64),
                    positions=np.arange(len(ids), dtype=np.int64),
                    sources=np.full(len(ids), s, np.int16),
                    source_names=self.mixture.names,
                )
            )
        return out

    def enter_phase(self, phase: dict[str, Any] | None) -> None:
        return None

    def new_phase(
        self, store: Store, head: Commit, current: dict[str, Any] | None, logged: dict[str, Any]
    ) -> dict[str, Any]:
        # TODO(mixture-streams-phases): new weights for a stream mixture need the phase's
        # start in every worker's positions; refused (ConfigMismatch) until then.
        return unchanged_phase(self.config(), current, logged)

    def replay(self, store: Store, head: Commit) -> tuple[PipelineState, list[EventChunk]]:
        """Rebuild the rank's state and lane buffers at ``head`` (another shape: see the
        module docstring, 4.).

        Raises:
            LogCorrupted: if a buffer snapshot disagrees with its lane's cursor.
        """
        self.store = store
        self.replicas = []
        self._reshapes = {}
        states = head.states
        if head.world_size != self.world_size or len(states[0].workers) != self.workers:
            self.buffers = {}
            epoch = min(st.epoch for st in states)
            reshape = self._reshape(head.id, self.world_size, self.k)
            lanes = [[WorkerState(carried) for carried, _ in reshape.lanes] for _ in range(self.k)]
            return self.epoch_start(epoch, states[0].batch, head.id, lanes), []
        state = head.state(self.rank)
        buffers: dict[tuple[int, int], list[int]] = {}
        if any(w.rows_read > w.emitted for i, w in enumerate(state.workers) if i % self.width):
            ref = newest_segments(store, head, len(states))[self.rank]
            if ref is None:
                raise LogCorrupted(f"commit {head.id} has buffered samples but no segment")
            buffers = self._read_buffers(ref, state.batch)
        for g in range(self.k):
            for s, stream in enumerate(self.mixture.sources):
                lane = state.workers[g * self.width + 1 + s]
                held = len(buffers.get((g, s), []))
                want = lane.rows_read - lane.emitted if stream.shuffle_buffer else 0
                if held != want:
                    raise LogCorrupted(
                        f"commit {head.id}: worker {g}'s lane of {self.mixture.names[s]!r} read "
                        f"{lane.rows_read} rows and handed on {lane.emitted}, so its buffer "
                        f"holds {want}, but the log's snapshot holds {held}"
                    )
        self.buffers = buffers
        return state, []


def check_sources(sources: tuple[Any, ...], names: tuple[str, ...]) -> None:
    """Refuse streams a mixture cannot mix: packers that differ.

    Raises:
        ValueError: naming the first source whose packer differs from the first's.
    """
    first = sources[0].packer
    for name, stream in zip(names, sources, strict=True):
        if stream.packer != first:
            raise ValueError(
                f"source {name!r} packs with {stream.packer}, source {names[0]!r} with "
                f"{first}: the streams of a Mixture share one packer (or none)"
            )
