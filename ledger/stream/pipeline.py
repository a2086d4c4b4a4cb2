"""Streams: shard rows -> per-sample transform -> shuffle buffer -> packing -> batches.

Each rank runs ``max(num_workers, 1)`` *logical workers*. Per epoch, a seeded plan deals
the shards (in a seeded order) to the ``world_size * workers`` logical workers round
robin; each logical worker reads its shards in order, row by row, through its own shuffle
buffer, whose draws come from a counter-based generator keyed by
``(seed, epoch, rank, worker)``. Every step is deterministic, so the stream of a logical
worker is a pure function of its state (:class:`ledger.commits.WorkerState`) and its
buffer's contents.

The main process never sees data it does not consume: it keeps an ids-only *replica* of
each logical worker (:mod:`ledger.stream.replica`, the same stream computed a chunk at a
time), folds every consumed batch into it, checks that the batch is what the replica
predicts, and snapshots the replicas at each commit. A resume rebuilds each worker from
its replica: it re-reads the rows in its buffer and the document its packer was in the
middle of, and nothing else.

Shuffle buffer algorithm: the reservoir-style buffer of ``tf.data.Dataset.shuffle``
(fill to ``size``; then each output is a uniformly drawn slot, refilled with the next
row; at the end of the stream the remaining slots are drawn without replacement).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ledger.commits import WorkerState
from ledger.digest import digest_bytes
from ledger.errors import LedgerError
from ledger.order import (
    EpochOrder,
    derive_key,
    rngs_preserved,
    sample_seed,
    seed_globals,
)
from ledger.stream.shuffle import IdFeed, Piece, skip_empty
from ledger.stream.source import ShardedSource


@dataclass(frozen=True, slots=True)
class Packer:
    """Concatenates tokenised samples, each followed by ``eos_id``, into sequences.

    A sample that does not fit is split: the rest starts the next sequence. The last
    sequence of a logical worker's epoch is padded with ``pad_id`` (its ``sample_ids`` are
    ``-1`` there), so every token of every sample is served exactly once per epoch.

    Args:
        seq_len: tokens per sequence (>= 1).
        eos_id: token appended after each sample.
        pad_id: token that fills the end of a worker's last sequence of an epoch.
    """

    seq_len: int
    eos_id: int = 0
    pad_id: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")


class SampleContext:
    """What a transform gets besides the record.

    Attributes:
        sample_id: the sample's id (global row number).
        epoch: the epoch.
        draws: values recorded with :meth:`record` (logged with the sample).
    """

    __slots__ = ("_rng", "_run_seed", "_seed", "draws", "epoch", "sample_id")

    def __init__(self, sample_id: int, epoch: int, seed: int | None, *, run_seed: int = 0) -> None:
        self.sample_id = sample_id
        self.epoch = epoch
        self._seed = seed  # None: derived from run_seed when first asked for
        self._run_seed = run_seed
        self._rng: np.random.Generator | None = None
        self.draws: dict[str, Any] = {}

    @property
    def rng(self) -> np.random.Generator:
        """A numpy ``Generator`` (PCG64) seeded from ``(seed, epoch, sample id)``."""
        if self._rng is None:
            if self._seed is None:
                self._seed = sample_seed(self._run_seed, self.epoch, self.sample_id)
            self._rng = np.random.Generator(np.random.PCG64(self._seed))
        return self._rng

    def record(self, **values: Any) -> None:
        """Log JSON-serialisable values with the sample (e.g. the augmentation drawn)."""
        self.draws.update(values)


@dataclass(frozen=True, slots=True)
class Stream:
    """A streaming pipeline to hand to :class:`ledger.DataLoader` instead of a dataset.

    Args:
        source: the rows.
        transform: ``f(record: dict, ctx: SampleContext) -> item`` applied to each row as
            it is read; with a packer the item must be a 1-D sequence of int token ids.
        shuffle_buffer: shuffle buffer size per logical worker (rows); 0: no buffer.
        packer: pack items into fixed-length token sequences, or ``None``.
    """

    source: ShardedSource
    transform: Callable[[dict[str, Any], SampleContext], Any] | None = None
    shuffle_buffer: int = 0
    packer: Packer | None = None

    def __post_init__(self) -> None:
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {self.shuffle_buffer}")

    def config(self) -> dict[str, Any]:
        """What must not change across a resume (stored in ``run.json``)."""
        return {
            "source": self.source.fingerprint(),
            "shuffle_buffer": self.shuffle_buffer,
            "packer": None
            if self.packer is None
            else {
                "seq_len": self.packer.seq_len,
                "eos_id": self.packer.eos_id,
                "pad_id": self.packer.pad_id,
            },
        }


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


Loaded = tuple[int, Any]  # (sample id, payload)

Tail = tuple[int, int, int]  # (sample id, tokens already packed, length in tokens)


class Feed:
    """One logical worker's shuffled stream of samples with their payloads.

    The ids come from :class:`~ledger.stream.shuffle.IdFeed` (the same computation the
    main process's replica runs); the rows are read in order as its cursor advances,
    transformed, and held by sample id until the buffer hands them on. Ids are taken a
    few at a time: as many as the caller says it needs, else 1, 2, 4, ... up to
    :data:`_AHEAD`, so a resumed worker reads no row its first batch does not need.

    Args:
        source: the rows.
        pieces: the worker's row ranges ``(shard, start, stop)`` in reading order.
        state: where the worker stands.
        buffer: sample ids in the buffer's slots, in slot order.
        payloads: payloads of those slots.
        size: buffer size (rows).
        key: 64-bit key of the buffer's counter-based generator.
        read: ``(shard, row, stop) -> iterator of payloads of that shard from that row``.
    """

    def __init__(
        self,
        source: ShardedSource,
        pieces: list[Piece],
        state: WorkerState,
        buffer: list[int],
        payloads: list[Any],
        size: int,
        key: int,
        read: Callable[[int, int, int], Iterator[Any]],
    ) -> None:
        self.ids = IdFeed(source, pieces, state, buffer, size, key)
        self._held = dict(zip(buffer, payloads, strict=True))
        self._pieces = pieces
        self._base = [int(source.offsets[f]) for f, _, _ in pieces]
        self._shard = state.shard
        self._row = state.row
        self._rows_read = state.rows_read
        self._read = read
        self._rows: Iterator[Any] | None = None
        self._queue: list[int] = []
        self._next = 0
        self._ahead = 1
        self._skip_empty()

    def _skip_empty(self) -> None:
        shard, self._row = skip_empty(self._pieces, self._shard, self._row)
        if shard != self._shard:
            self._shard, self._rows = shard, None

    def _read_until(self, rows_read: int) -> None:
        """Read (and transform) rows in order until ``rows_read`` rows were read."""
        held = self._held
        while self._rows_read < rows_read:
            file, _, stop = self._pieces[self._shard]
            if self._rows is None:
                self._rows = self._read(file, self._row, stop)
            n = min(stop - self._row, rows_read - self._rows_read)
            base = self._base[self._shard] + self._row
            for i, payload in enumerate(itertools.islice(self._rows, n)):
                held[base + i] = payload
            self._row += n
            self._rows_read += n
            self._skip_empty()

    def next(self, wanted: int = 0) -> Loaded | None:
        """The next sample of the shuffled stream, or ``None`` at the end of the epoch.

        Args:
            wanted: how many samples the caller will ask for at least (0: unknown).
        """
        if self._next == len(self._queue):
            count = min(max(wanted, self._ahead), _AHEAD)
            self._ahead = min(2 * self._ahead, _AHEAD)
            self._queue = self.ids.take(count).tolist()
            self._next = 0
            if not self._queue:
                return None
            self._read_until(self.ids.rows_read)
        sid = self._queue[self._next]
        self._next += 1
        return sid, self._held.pop(sid)


_AHEAD = 64
"""Sample ids a worker's :class:`Feed` takes from its id stream at once."""


def buffer_key(seed: int, epoch: int, rank: int, worker: int) -> int:
    """Key of the shuffle buffer of logical ``worker`` on ``rank`` in ``epoch``."""
    return derive_key(seed, epoch, rank, worker, 0xB0F)


@dataclass(slots=True)
class BatchMeta:
    """What a worker sends with each batch: enough for the main process to log it.

    Attributes:
        worker: logical worker id.
        epoch: epoch.
        sample_ids: ``int64 (rows,)``: one per sample (no packing) or per span.
        spans: ``int64 (rows, 3)``: ``token_start, token_end, length`` per span, or
            ``None`` without packing.
        draws: per row, the JSON of the draws recorded for the sample (or ``None``);
            ``None`` when no row recorded any.
        digest: content digest of the batch (32 bytes, :func:`ledger.digest.digest_bytes`),
            or ``None`` when the loader does not record digests.
    """

    worker: int
    epoch: int
    sample_ids: np.ndarray
    spans: np.ndarray | None
    draws: list[str | None] | None
    digest: bytes | None = None


class WorkerRun:
    """The real pipeline of one logical worker: reads, transforms, shuffles, packs, batches.

    Args:
        stream: the stream.
        plan: the epoch's plan.
        rank: the rank.
        worker: logical worker id.
        state: where the worker starts.
        buffer: sample ids in its buffer (from the log), in slot order.
        seed: the run's seed.
        batch_size: items per batch.
        collate_fn: collates the items of a batch (no packing).
        per_sample_rng: also seed torch, numpy and ``random`` per sample.
    """

    def __init__(
        self,
        stream: Stream,
        plan: EpochPlan,
        rank: int,
        worker: int,
        state: WorkerState,
        buffer: list[int],
        seed: int,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        per_sample_rng: bool,
    ) -> None:
        self.stream = stream
        self.epoch = plan.epoch
        self.worker = worker
        self.seed = seed
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.per_sample_rng = per_sample_rng
        source = stream.source
        payloads = [self._load(s, r) for s, r in zip(buffer, source.read(buffer), strict=True)]
        self.feed = Feed(
            source,
            plan.pieces(rank, worker),
            state,
            buffer,
            payloads,
            stream.shuffle_buffer,
            buffer_key(seed, plan.epoch, rank, worker),
            self._read,
        )
        self.doc: tuple[int, np.ndarray, int, str | None] | None = None
        if state.doc >= 0:
            self.doc = self._tail((state.doc, state.doc_offset, state.doc_length))
        self.tails = list(state.tails)

    def _tail(self, tail: Tail) -> tuple[int, np.ndarray, int, str | None]:
        """Re-read a partly packed sample, to go on from its offset."""
        sid, offset, length = tail
        item, _ = self._load(sid, self.stream.source.read([sid])[0])
        if len(item) != length:
            raise LedgerError(
                f"sample {sid} has {len(item)} tokens now, the log says {length}: the "
                "transform is not deterministic"
            )
        return sid, item, offset, None  # its draws were logged with its first span

    def _read(self, shard: int, row: int, stop: int) -> Iterator[tuple[Any, str | None]]:
        source = self.stream.source
        base = int(source.offsets[shard]) + row
        if stop - row == 1:  # a single row (e.g. a carried buffer slot): random access
            yield self._load(base, source.read([base])[0])
            return
        for i, record in enumerate(source.iter_shard(shard, row)):
            yield self._load(base + i, record)

    def _load(self, sid: int, record: dict[str, Any]) -> tuple[Any, str | None]:
        return load_sample(self.stream, self.seed, self.epoch, sid, record, self.per_sample_rng)

    def batches(self) -> Iterator[tuple[BatchMeta, Any]]:
        """``(meta, collated batch)`` until the worker's epoch ends (last batch may be short)."""
        while True:
            if self.stream.packer is None:
                meta, data = self._items()
            else:
                meta, data = self._sequences()
            if meta.sample_ids.size == 0 and not data:
                return
            yield meta, data if self.stream.packer is not None else self.collate_fn(data)

    def _items(self) -> tuple[BatchMeta, Any]:
        ids: list[int] = []
        items: list[Any] = []
        draws: list[str | None] = []
        while len(items) < self.batch_size:
            nxt = self.feed.next(self.batch_size - len(items))
            if nxt is None:
                break
            ids.append(nxt[0])
            items.append(nxt[1][0])
            draws.append(nxt[1][1])
        meta = BatchMeta(self.worker, self.epoch, np.array(ids, np.int64), None, _drawn(draws))
        return meta, items

    def _sequences(self) -> tuple[BatchMeta, Any]:
        packer = self.stream.packer
        assert packer is not None
        length = packer.seq_len
        tokens: list[np.ndarray] = []
        owners: list[np.ndarray] = []
        ids: list[int] = []
        spans: list[tuple[int, int, int]] = []
        draws: list[str | None] = []
        while len(tokens) < self.batch_size:
            seq = np.full(length, packer.pad_id, np.int64)
            owner = np.full(length, -1, np.int64)
            n = 0
            while n < length:
                if (self.doc is None or self.doc[2] == len(self.doc[1])) and self.tails:
                    self.doc = self._tail(self.tails.pop(0))
                if self.doc is None or self.doc[2] == len(self.doc[1]):
                    nxt = self.feed.next()
                    if nxt is None:
                        break
                    self.doc = (nxt[0], nxt[1][0], 0, nxt[1][1])
                sid, doc, off, dr = self.doc
                take = min(length - n, len(doc) - off)
                seq[n : n + take] = doc[off : off + take]
                owner[n : n + take] = sid
                ids.append(sid)
                spans.append((off, off + take, len(doc)))
                draws.append(dr if off == 0 else None)
                self.doc = (sid, doc, off + take, dr)
                n += take
            if n == 0:
                break
            tokens.append(seq)
            owners.append(owner)
        meta = BatchMeta(
            self.worker,
            self.epoch,
            np.array(ids, np.int64),
            np.array(spans, np.int64).reshape(-1, 3),
            _drawn(draws),
        )
        if not tokens:
            return meta, None
        data = {
            "tokens": torch.from_numpy(np.stack(tokens)),
            "sample_ids": torch.from_numpy(np.stack(owners)),
        }
        return meta, data


def _drawn(draws: list[str | None]) -> list[str | None] | None:
    """``None`` for a batch whose samples recorded no draws (the common case), so the
    main process need not look at each row."""
    return draws if any(d is not None for d in draws) else None


def load_sample(
    stream: Stream,
    seed: int,
    epoch: int,
    sid: int,
    record: dict[str, Any],
    per_sample_rng: bool,
) -> tuple[Any, str | None]:
    """Transform one record as a worker does: ``(item, JSON of its draws or None)``.

    The transform gets a :class:`SampleContext` seeded from ``f(seed, epoch, sid)``;
    with ``per_sample_rng`` torch, numpy and ``random`` are seeded from it too. A packed
    stream's item is its tokens (``int64 (length,)``) with the EOS token appended.
    """
    if per_sample_rng:
        s = sample_seed(seed, epoch, sid)
        seed_globals(s)
        ctx = SampleContext(sid, epoch, s)
    else:  # the seed is derived only if the transform asks for ctx.rng
        ctx = SampleContext(sid, epoch, None, run_seed=seed)
    item = stream.transform(record, ctx) if stream.transform else record
    if stream.packer is not None:
        tokens = np.asarray(item, dtype=np.int64).reshape(-1)
        item = np.append(tokens, np.int64(stream.packer.eos_id))
    draws = json.dumps(ctx.draws, sort_keys=True) if ctx.draws else None
    return item, draws


def rebuild_batch(
    stream: Stream,
    seed: int,
    epoch: int,
    events: Any,
    per_sample_rng: bool,
    collate_fn: Callable[[list[Any]], Any],
) -> Any:
    """Re-create a logged batch of ``stream`` from its events (see :func:`load_sample`).

    Args:
        stream: the run's stream.
        seed: the run's seed.
        epoch: the batch's epoch.
        events: the batch's ``sample``/``span`` events in batch order (an Arrow table
            with ``sample_id``, ``token_start``, ``token_end`` and ``length`` columns).
        per_sample_rng: whether the run seeded the global RNGs per sample.
        collate_fn: the run's collate function (unpacked streams).

    Returns:
        The batch: ``collate_fn(items)``, or for a packed stream the dict of ``tokens``
        and ``sample_ids`` (``int64 (sequences, seq_len)`` each) that the loader yields.

    Raises:
        LedgerError: if a sample's length or a span differs from the log (changed data
            or a transform that is not deterministic).
    """
    ids = [int(i) for i in events.column("sample_id").to_pylist()]
    unique = sorted(set(ids))
    records = dict(zip(unique, stream.source.read(unique), strict=True))
    with rngs_preserved(True):
        items = {
            sid: load_sample(stream, seed, epoch, sid, records[sid], per_sample_rng)[0]
            for sid in dict.fromkeys(ids)
        }
    packer = stream.packer
    if packer is None:
        return collate_fn([items[sid] for sid in ids])
    spans = zip(
        events.column("token_start").to_pylist(),
        events.column("token_end").to_pylist(),
        events.column("length").to_pylist(),
        strict=True,
    )
    tokens: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    n = packer.seq_len  # the sequence being filled is full: start a new one
    for sid, (start, end, length) in zip(ids, spans, strict=True):
        doc = items[sid]
        take = end - start
        if len(doc) != length or not 0 <= start < end <= length or take > packer.seq_len:
            raise LedgerError(
                f"sample {sid} has {len(doc)} tokens now; the log packed tokens "
                f"[{start}, {end}) of {length}: the data or the transform changed"
            )
        if n + take > packer.seq_len:
            if n < packer.seq_len:  # the packer fills a sequence before it begins the next
                raise LedgerError(
                    f"the log packs a span of {take} tokens of sample {sid} into a sequence "
                    f"with {packer.seq_len - n} tokens left: it is not this stream's packing"
                )
            tokens.append(np.full(packer.seq_len, packer.pad_id, np.int64))
            owners.append(np.full(packer.seq_len, -1, np.int64))
            n = 0
        tokens[-1][n : n + take] = doc[start:end]
        owners[-1][n : n + take] = sid
        n += take
    return {
        "tokens": torch.from_numpy(np.stack(tokens)),
        "sample_ids": torch.from_numpy(np.stack(owners)),
    }


class StreamDataset(torch.utils.data.IterableDataset):
    """What torch's DataLoader iterates: each (physical) worker runs one logical worker.

    Physical worker ``p`` plays logical worker ``(p + start.next_worker) % workers``, so
    after a resume the worker whose batch comes first is the one that was next in the
    uninterrupted run (torch serves workers round robin, skipping finished ones).
    The loader sets :attr:`start` and :attr:`buffers` before each iteration.
    """

    def __init__(
        self,
        stream: Stream,
        seed: int,
        shuffle: bool,
        rank: int,
        world_size: int,
        workers: int,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        per_sample_rng: bool,
        digest: bool = True,
    ) -> None:
        self.stream = stream
        self.seed = seed
        self.digest = digest
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.workers = workers
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.per_sample_rng = per_sample_rng
        self.start: Any = None  # PipelineState
        self.buffers: dict[int, list[int]] = {}
        self.epoch_plan: EpochPlan | None = None  # of start.epoch

    def plan(
        self,
        epoch: int,
        carry: dict[int, tuple[list[Piece], list[Tail]]] | None = None,
        world_size: int | None = None,
        workers: int | None = None,
    ) -> EpochPlan:
        return EpochPlan(
            self.stream.source,
            self.seed,
            epoch,
            self.shuffle,
            world_size or self.world_size,
            workers or self.workers,
            carry,
        )

    def __iter__(self) -> Iterator[tuple[BatchMeta, Any]]:
        info = torch.utils.data.get_worker_info()
        start = self.start
        worker = ((info.id if info is not None else 0) + start.next_worker) % self.workers
        # In the main process the global RNGs belong to the training loop: per-sample
        # seeding (while refilling a resumed buffer, and while producing each batch)
        # must not leak into it.
        guard = info is None and self.per_sample_rng
        assert self.epoch_plan is not None and self.epoch_plan.epoch == start.epoch
        with rngs_preserved(guard):
            run = WorkerRun(
                self.stream,
                self.epoch_plan,
                self.rank,
                worker,
                start.workers[worker],
                self.buffers.get(worker, []),
                self.seed,
                self.batch_size,
                self.collate_fn,
                self.per_sample_rng,
            )
        batches = run.batches()
        while True:
            with rngs_preserved(guard):
                item = next(batches, None)
            if item is None:
                return
            if self.digest:
                item[0].digest = digest_bytes(item[1])
            yield item


def identity(item: Any) -> Any:
    """Collate function for pre-batched items (module level: picklable for workers)."""
    return item


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
