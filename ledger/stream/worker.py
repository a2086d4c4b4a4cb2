"""A logical worker of a stream: reads rows, transforms, shuffles, packs and batches.

Each rank runs ``max(num_workers, 1)`` *logical workers*. Per epoch, a seeded plan
(:mod:`ledger.stream.plan`) deals the shards to the ``world_size * workers`` logical
workers round robin; each logical worker reads its shards in order, row by row, through
its own shuffle buffer, whose draws come from a counter-based generator keyed by
``(seed, epoch, rank, worker)``. Every step is deterministic, so the stream of a logical
worker is a pure function of its state (:class:`ledger.commits.WorkerState`) and its
buffer's contents.

Shuffle buffer algorithm: the reservoir-style buffer of ``tf.data.Dataset.shuffle``
(fill to ``size``; then each output is a uniformly drawn slot, refilled with the next
row; at the end of the stream the remaining slots are drawn without replacement).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ledger.commits import WorkerState
from ledger.digest import digest_bytes
from ledger.errors import LedgerError, SampleError
from ledger.fetch import Failure, failure_of
from ledger.order import rngs_preserved
from ledger.stream.packing import PackState, Tail, assemble
from ledger.stream.plan import EpochPlan, buffer_key
from ledger.stream.sample import sample_loader
from ledger.stream.shuffle import IdFeed, Piece, skip_empty
from ledger.stream.source import ShardedSource
from ledger.stream.spec import Stream

Loaded = tuple[int, Any]  # (sample id, payload)


class Feed:
    """One logical worker's shuffled stream of samples with their payloads.

    The ids come from :class:`~ledger.stream.shuffle.IdFeed` (the same computation the
    main process's replica runs); the rows are read in order, a block at a time, as its
    cursor advances, transformed one by one as the cursor reaches them, and held by
    sample id until the buffer hands them on. Ids are taken a few at a time: as many as
    the caller says it needs, else 1, 2, 4, ... up to :data:`_AHEAD`, so a resumed
    worker transforms no row its first batch does not need.

    Args:
        source: the rows.
        pieces: the worker's row ranges ``(shard, start, stop)`` in reading order.
        state: where the worker stands.
        buffer: sample ids in the buffer's slots, in slot order.
        payloads: payloads of those slots.
        size: buffer size (rows).
        key: 64-bit key of the buffer's counter-based generator.
        read: ``(shard, row, stop) -> iterator of blocks`` (non-empty lists) of that
            shard's records from that row on.
        load: ``(sample id, record) -> payload``; default: the record is the payload.
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
        read: Callable[[int, int, int], Iterator[list[Any]]],
        load: Callable[[int, Any], Any] | None = None,
    ) -> None:
        self.ids = IdFeed(source, pieces, state, buffer, size, key)
        self._held = dict(zip(buffer, payloads, strict=True))
        self._pieces = pieces
        self._base = [int(source.offsets[f]) for f, _, _ in pieces]
        self._shard = state.shard
        self._row = state.row
        self._rows_read = state.rows_read
        self._read = read
        self._load = load
        self._rows: Iterator[list[Any]] | None = None
        self._block: list[Any] = []  # records read and not yet transformed: _block[_at:]
        self._at = 0
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
        load = self._load
        while self._rows_read < rows_read:
            file, _, stop = self._pieces[self._shard]
            if self._rows is None:
                self._rows = self._read(file, self._row, stop)
                self._block, self._at = [], 0
            if self._at == len(self._block):
                # Drop the read block before the next one is decoded (see
                # ShardedSource.iter_blocks: fewer rows reach the collector's old generation).
                self._block = []
                self._block, self._at = next(self._rows), 0
            at = self._at
            n = min(stop - self._row, rows_read - self._rows_read, len(self._block) - at)
            base = self._base[self._shard] + self._row
            records = self._block[at : at + n]
            sids = range(base, base + n)
            payloads = records if load is None else map(load, sids, records)
            if type(held) is dict:  # no Python loop per row
                held.update(zip(sids, payloads, strict=True))
            else:  # a mixture lane's holder keeps repeats in its __setitem__
                for sid, payload in zip(sids, payloads, strict=True):
                    held[sid] = payload
            self._at = at + n
            self._row += n
            self._rows_read += n
            self._skip_empty()

    def _refill(self, wanted: int) -> bool:
        """Take the next ids from the id stream (reading their rows); ``False`` at the
        end of the epoch."""
        count = min(max(wanted, self._ahead), _AHEAD)
        self._ahead = min(2 * self._ahead, _AHEAD)
        self._queue = self.ids.take(count).tolist()
        self._next = 0
        if not self._queue:
            return False
        self._read_until(self.ids.rows_read)
        return True

    def next(self, wanted: int = 0) -> Loaded | None:
        """The next sample of the shuffled stream, or ``None`` at the end of the epoch.

        Args:
            wanted: how many samples the caller will ask for at least (0: unknown).
        """
        if self._next == len(self._queue) and not self._refill(wanted):
            return None
        sid = self._queue[self._next]
        self._next += 1
        return sid, self._held.pop(sid)

    def take(self, n: int) -> tuple[list[int], list[Any]]:
        """The next ``n`` samples' ids and payloads (fewer only at the end of the
        epoch): :meth:`next` ``n`` times, a run of ids at a time."""
        ids: list[int] = []
        payloads: list[Any] = []
        pop = self._held.pop
        while len(ids) < n:
            if self._next == len(self._queue) and not self._refill(n - len(ids)):
                break
            run = self._queue[self._next : self._next + n - len(ids)]
            self._next += len(run)
            ids += run
            payloads += map(pop, run)
        return ids, payloads


_AHEAD = 64
"""Sample ids a worker's :class:`Feed` takes from its id stream at once."""


@dataclass(slots=True)
class BatchMeta:
    """What a worker sends with each batch: enough for the main process to log it.

    Attributes:
        worker: logical worker id.
        epoch: epoch.
        sample_ids: ``int64 (rows,)``: one per sample (no packing) or per span.
        spans: ``int64 (rows, 3)``: ``token_start, token_end, length`` per span
            (column-major: each column is contiguous, logged without a copy), or ``None``
            without packing.
        draws: per row, the JSON of the draws recorded for the sample (or ``None``);
            ``None`` when no row recorded any.
        digest: content digest of the batch (32 bytes, :func:`ledger.digest.digest_bytes`),
            or ``None`` when the loader does not record digests.
        failures: samples whose loading raised (``on_error="skip"``), left out of the
            batch: ``(sample id, index among the ids the worker took from its shuffled
            stream for this batch, JSON {"type", "message"})``; ``None`` if none.
        pulled: ids the worker took from its shuffled stream for this batch, failed ones
            included (set with ``on_error="skip"`` only).
    """

    worker: int
    epoch: int
    sample_ids: np.ndarray
    spans: np.ndarray | None
    draws: list[str | None] | None
    digest: bytes | None = None
    failures: list[tuple[int, int, str]] | None = None
    pulled: int = 0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A worker's meta crosses torch's result queue pickled with every batch; numpy's
        # own reduce of the two arrays costs ~15 µs in the worker and ~7 µs in the main
        # process more than their bytes (a packed batch of ~190 spans). A bytearray
        # unpickles writable, as the arrays were.
        spans = self.spans
        return _meta_of, (
            self.worker,
            self.epoch,
            bytearray(np.ascontiguousarray(self.sample_ids, np.int64)),
            None if spans is None else bytearray(np.ascontiguousarray(spans.T, np.int64)),
            self.draws,
            self.digest,
            self.failures,
            self.pulled,
        )


def _meta_of(
    worker: int,
    epoch: int,
    ids: bytearray,
    spans: bytearray | None,
    draws: list[str | None] | None,
    digest: bytes | None,
    failures: list[tuple[int, int, str]] | None,
    pulled: int,
) -> BatchMeta:
    """The :class:`BatchMeta` :meth:`BatchMeta.__reduce__` took apart; its spans
    column-major, as a worker makes them."""
    return BatchMeta(
        worker,
        epoch,
        np.frombuffer(ids, np.int64),
        None if spans is None else np.frombuffer(spans, np.int64).reshape(3, -1).T,
        draws,
        digest,
        failures,
        pulled,
    )


def carry_failures(
    make: Callable[[], tuple[BatchMeta, Any] | None],
    leftover: Callable[[], tuple[list[tuple[int, int, str]], int] | None],
    all_failed: Callable[[int, str], SampleError],
) -> Iterator[tuple[BatchMeta, Any]]:
    """The batches ``make`` returns until it returns ``None``; with ``on_error="skip"``
    (``leftover`` gives the failures and pulled count of the batch being made, not
    ``None``), held one batch back, so that samples failing after the worker's last good
    one ride with its last batch (:class:`WorkerRun` and the mixtures' ``MixedRun``).

    Raises:
        SampleError: ``all_failed(first id, its failure)`` when samples failed and no
            batch is left to carry them.
    """
    if leftover() is None:
        while (made := make()) is not None:
            yield made
        return
    pending = None
    while (made := make()) is not None:
        if pending is not None:
            yield pending
        pending = made
    failures, pulled = leftover() or ([], 0)
    if failures:
        if pending is None:
            first, _, value = failures[0]
            raise all_failed(first, value)
        meta = pending[0]
        shift = meta.pulled
        meta.failures = (meta.failures or []) + [
            (sid, shift + k, value) for sid, k, value in failures
        ]
        meta.pulled = shift + pulled
    if pending is not None:
        yield pending


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
        skip_errors: leave out a sample whose loading raises (``on_error="skip"``).
            It still flows through the shuffle buffer (the id stream is the same with
            or without failures, so the main process's replica needs no data); it is
            dropped when the buffer hands it on, and the batch takes the next sample
            instead. Failures after a worker's last good sample of the epoch ride with
            its last batch (so each batch is produced one ahead).
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
        skip_errors: bool = False,
    ) -> None:
        self.stream = stream
        self.skip_errors = skip_errors
        self._failures: list[tuple[int, int, str]] = []  # of the batch being made
        self._pulled = 0
        self.epoch = plan.epoch
        self.worker = worker
        self.seed = seed
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.per_sample_rng = per_sample_rng
        source = stream.source
        self._load_sample = sample_loader(stream, seed, plan.epoch, per_sample_rng)
        records = source.read(buffer, strict=False)
        payloads = [self._load(s, r) for s, r in zip(buffer, records, strict=True)]
        self.feed = Feed(
            source,
            plan.pieces(rank, worker),
            state,
            buffer,
            payloads,
            stream.shuffle_buffer,
            buffer_key(seed, plan.epoch, rank, worker),
            source.worker_blocks,
            self._load_sample if not skip_errors else self._load,
        )
        self.packing = PackState(
            (state.doc, state.doc_offset, state.doc_length) if state.doc >= 0 else None,
            list(state.tails),
            f"worker {worker}",
        )
        # Tokens (and draws) of the samples being packed, by sample id.
        self._docs: dict[int, tuple[np.ndarray, str | None]] = {}
        self._drew = False  # a sample pulled for the batch being made recorded draws
        if self.packing.doc is not None:
            self._open_tail(self.packing.doc)

    def _open_tail(self, tail: Tail) -> None:
        """Re-read a partly packed sample, to go on from its offset."""
        sid, _, length = tail
        item, _ = self._load(sid, self.stream.source.read([sid])[0])
        if len(item) != length:
            raise LedgerError(
                f"sample {sid} has {len(item)} tokens now, the log says {length}: the "
                "transform is not deterministic"
            )
        self._docs[sid] = (item, None)  # its draws were logged with its first span

    def _next(self, wanted: int = 0) -> Loaded | None:
        """The next sample that loaded (noting the failed ones before it in
        :attr:`_failures`), or ``None`` at the end of the epoch."""
        if not self.skip_errors:
            return self.feed.next(wanted)
        while True:
            nxt = self.feed.next(wanted)
            if nxt is None:
                return None
            self._pulled += 1
            item = nxt[1][0]
            if not isinstance(item, Failure):
                return nxt
            self._failures.append((nxt[0], self._pulled - 1, item.value()))

    def _pull(self) -> tuple[int, int] | None:
        # Once per packed sample: the feed directly when no failure is looked for.
        nxt = self._next() if self.skip_errors else self.feed.next()
        if nxt is None:
            return None
        sid, loaded = nxt
        self._docs[sid] = loaded
        if loaded[1] is not None:
            self._drew = True
        return sid, len(loaded[0])

    def _load(self, sid: int, record: dict[str, Any]) -> tuple[Any, str | None]:
        """``(item, draws)``; with ``skip_errors``, ``(Failure, None)`` if it raised."""
        try:
            return self._load_sample(sid, record)
        except Exception as e:
            if not self.skip_errors:
                raise
            return failure_of(0, e), None

    def _batch(self) -> tuple[BatchMeta, Any] | None:
        """The next batch, collated, or ``None`` at the end of the epoch (its failures, if
        any, stay in :attr:`_failures`)."""
        self._failures = []
        self._pulled = 0
        if self.stream.packer is None:
            meta, data = self._items()
        else:
            meta, data = self._sequences()
        if meta.sample_ids.size == 0 and not data:
            return None
        if self.skip_errors:
            meta.failures, meta.pulled = self._failures or None, self._pulled
        return meta, data if self.stream.packer is not None else self.collate_fn(data)

    def batches(self) -> Iterator[tuple[BatchMeta, Any]]:
        """``(meta, collated batch)`` until the worker's epoch ends (last batch may be short).

        Raises:
            SampleError: (``skip_errors``) if every sample left to the worker in the
                epoch failed to load, so no batch can carry the failures.
        """
        return carry_failures(
            self._batch,
            lambda: (self._failures, self._pulled) if self.skip_errors else None,
            lambda sid, value: SampleError(
                f"every sample left to worker {self.worker} in epoch {self.epoch} failed "
                f"to load (the first, sample {sid}: {value}): no batch can carry them. "
                "Fix the source, or filter these rows out"
            ),
        )

    def _items(self) -> tuple[BatchMeta, Any]:
        if not self.skip_errors:  # no failure to look for: a batch's samples at once
            ids, loaded = self.feed.take(self.batch_size)
            items = [item for item, _ in loaded]
            drawn = _drawn([d for _, d in loaded])
            return BatchMeta(self.worker, self.epoch, np.array(ids, np.int64), None, drawn), items
        ids = []
        items = []
        draws: list[str | None] = []
        while len(items) < self.batch_size:
            nxt = self._next(self.batch_size - len(items))
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
        self._drew = False
        chosen = self.packing.pack(packer.seq_len, self.batch_size, self._pull, self._open_tail)
        docs = self._docs
        table = np.array(chosen, np.int64).reshape(-1, 4)  # sample id, start, end, length
        ids = table[:, 0].tolist()
        # A sample's draws ride with its first span; samples begun here were pulled here.
        draws = (
            _drawn([docs[sid][1] if start == 0 else None for sid, start, _, _ in chosen])
            if self._drew
            else None
        )
        spans = np.asfortranarray(table[:, 1:])  # column-major: each column contiguous
        meta = BatchMeta(self.worker, self.epoch, table[:, 0].copy(), spans, draws)
        if not chosen:
            return meta, None
        data = assemble(packer, ids, spans, lambda sid: docs[sid][0])
        doc = self.packing.doc
        kept = docs.get(doc[0]) if doc is not None else None
        docs.clear()  # only the sample in progress is still needed
        if doc is not None and kept is not None:
            docs[doc[0]] = kept
        return meta, data


def _drawn(draws: list[str | None]) -> list[str | None] | None:
    """``None`` for a batch whose samples recorded no draws (the common case), so the
    main process need not look at each row."""
    return draws if any(d is not None for d in draws) else None


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
        skip_errors: bool = False,
    ) -> None:
        self.stream = stream
        self.seed = seed
        self.digest = digest
        self.skip_errors = skip_errors
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
        if info is not None:
            in_worker()
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
                self.skip_errors,
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


def in_worker() -> None:
    """Called as a stream's DataLoader worker starts its epoch: moves the objects the
    worker inherited from the main process (torch, the training loop's) to the garbage
    collector's permanent generation (:func:`gc.freeze`), so the worker's full
    collections traverse only its own objects: ~0.1 s less per full collection, and no
    copy-on-write of the inherited pages those collections would write to. A stream's
    workers live one epoch (``persistent_workers=False``), so nothing they inherited
    needs collecting there.
    """
    gc.freeze()


def identity(item: Any) -> Any:
    """Collate function for pre-batched items (module level: picklable for workers)."""
    return item
