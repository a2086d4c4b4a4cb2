"""One logical worker of a mixture of streams: :class:`MixedRun` in a torch worker
(mixes, packs, batches), :class:`MixedDataset` (what torch iterates) and
:class:`MixedReplica`, its ids-only mirror in the main process
(:mod:`ledger.stream.mixing` tells the whole design).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch
import torch.utils.data as tud

from ledger.commits import PipelineState, WorkerState
from ledger.digest import digest_bytes
from ledger.errors import LedgerError, SampleError, SourceMissing
from ledger.fetch import Failure
from ledger.order import rngs_preserved
from ledger.pipeline import LoaderSettings
from ledger.stream.indexed import IndexedSource
from ledger.stream.lanes import Lanes, Positions, lane_feed, lane_ids, source_seed
from ledger.stream.packing import PackState, Tail, assemble
from ledger.stream.sample import load_sample
from ledger.stream.shuffle import Piece
from ledger.stream.worker import BatchMeta, _drawn, carry_failures, in_worker

if TYPE_CHECKING:
    from ledger.mixture import Mixture
    from ledger.stream.mixing import MixedStreamPipeline


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


class MixedRun:
    """One logical worker of a stream mixture in a torch worker: mixes, packs, batches.

    Args:
        mixture: the mixture.
        plan: the worker's plan of the epoch.
        state: its mixer's state; ``lanes``: its lanes' states.
        epoch: the mixture epoch.
        seed, batch_size, collate_fn: as for a stream's worker.
        rng: the run's RNG mode (:mod:`ledger.fetch`): ``"sample"`` seeds the global RNGs
            before each stream sample, anything but ``"off"`` before each map-style one
            (:mod:`ledger.stream.indexed`).
    """

    def __init__(
        self,
        mixture: Mixture,
        lanes: Lanes,
        plan: WorkerPlan,
        mixer: WorkerState,
        lane_states: list[WorkerState],
        epoch: int,
        seed: int,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        rng: str,
        skip_errors: bool = False,
    ) -> None:
        self.mixture = mixture
        self.skip_errors = skip_errors
        self._failures: list[tuple[int, int, str]] = []  # (ext id, index pulled, JSON)
        self._pulled = 0  # positions taken for the batch being made
        self.worker = lanes.worker
        self.epoch = epoch
        self.seed = seed
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self._total = mixture.total  # Python ints: per sample, numpy scalars cost more
        self._offsets = [int(o) for o in mixture.offsets]
        self.positions = plan.positions
        self.k = mixer.emitted
        self.lanes = [
            lane_feed(lanes, s, e, pieces, st, buf, seed, rng, skip_errors)
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
        """The next mixed sample that loaded: ``(extended id, (item, draws))``, or ``None``
        at the end (with ``skip_errors``, the failed ones before it go to
        :attr:`_failures`: their positions are taken, their samples left out)."""
        while True:
            if not self._queue:
                self._sources(1)
                if not self._queue:
                    return None
            s = self._queue.pop(0)
            self.k += 1
            self._pulled += 1
            lane = self.lanes[s]
            row, loaded = lane.next()
            ext = lane.epoch * self._total + self._offsets[s] + row  # Mixture.ext_id
            if not self.skip_errors or not isinstance(loaded[0], Failure):
                return ext, loaded
            self._failures.append((ext, self._pulled - 1, loaded[0].value()))

    def _reopen(self, tail: Tail) -> np.ndarray:
        """The tokens of a sample begun before (a tail, or the sample in progress)."""
        ext, _, length = tail
        epoch, s, row = self.mixture.split_ext(ext)
        with rngs_preserved(True):
            item, _ = self.lanes[s].reopen(epoch, row)
        if len(item) != length:
            raise LedgerError(
                f"sample {row} of source {self.mixture.names[s]!r} has {len(item)} tokens "
                f"now, the log says {length}: the transform is not deterministic"
            )
        return np.asarray(item)

    def _batch(self) -> tuple[BatchMeta, Any] | None:
        self._failures = []
        self._pulled = 0
        meta, data = self._items() if self.packer is None else self._sequences()
        if meta.sample_ids.size == 0:
            return None
        if self.skip_errors:
            meta.failures, meta.pulled = self._failures or None, self._pulled
        return meta, data

    def batches(self) -> Iterator[tuple[BatchMeta, Any]]:
        """``(meta, batch)`` until the worker's part of the epoch ends.

        Raises:
            SampleError: (``skip_errors``) if every sample left to the worker in the
                mixture epoch failed to load, so no batch can carry the failures.
        """
        return carry_failures(
            self._batch,
            lambda: (self._failures, self._pulled) if self.skip_errors else None,
            lambda ext, value: SampleError(
                f"every sample left to worker {self.worker} in mixture epoch "
                f"{self.epoch} failed to load (the first, extended id {ext}: {value}): "
                "no batch can carry them. Fix the source, or filter these rows out"
            ),
        )

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
        self.rng = settings.rng
        # Map-style sources are seeded per sample unless rng="off" (ledger.stream.indexed).
        maps = any(isinstance(src, IndexedSource) for src in mixture.sources)
        self.seeds_globals = settings.rng == "sample" or (maps and settings.rng != "off")
        self.skip_errors = settings.on_error == "skip"
        self.digest = settings.digest
        self.start: PipelineState | None = None
        self.plans: list[WorkerPlan] = []

    def __iter__(self) -> Iterator[tuple[BatchMeta, Any]]:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            in_worker()
        start = self.start
        assert start is not None
        g = ((info.id if info is not None else 0) + start.next_worker) % self.workers
        guard = info is None and self.seeds_globals
        width = 1 + len(self.mixture.names)
        states = start.workers[g * width : (g + 1) * width]
        lanes = Lanes(self.mixture, self.seed, self.shuffle, self.rank, self.world, self.workers, g)
        with rngs_preserved(guard):
            run = MixedRun(
                self.mixture, lanes, self.plans[g], states[0], list(states[1:]), start.epoch,
                self.seed, self.batch_size, self.collate_fn, self.rng,
                self.skip_errors,
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
            lane_ids(lanes, s, e, pieces, st, buf)
            for s, ((e, pieces), st, buf) in enumerate(
                zip(plan.lanes, lane_states, plan.buffers, strict=True)
            )
        ]
        doc = (mixer.doc, mixer.doc_offset, mixer.doc_length) if mixer.doc >= 0 else None
        self.packing = PackState(doc, list(mixer.tails), f"worker {g}")
        self.doc_position = -1  # position of the sample in progress
        # The last batch folded: (extended ids, positions) of its failed samples.
        self.failed: tuple[np.ndarray, np.ndarray] | None = None
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
        return [lane.buffer() for lane in self.lanes]

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
        self.failed = None
        if meta.spans is None:
            if meta.failures:
                return self._fold_failures(meta, ids)
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

        if meta.failures:
            begun_ids: list[np.ndarray] = []
            self.packing.fold(ids, meta.spans, begun_ids.append)
            good = np.concatenate(begun_ids) if begun_ids else np.zeros(0, np.int64)
            pulled.append(self._fold_failures(meta, good))
        else:
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

    def _fold_failures(self, meta: BatchMeta, good: np.ndarray) -> np.ndarray:
        """Take the batch's positions, failed ones included (``on_error="skip"``), check
        them against the good samples begun and the failed ones, and return the good
        ones' positions; :attr:`failed` gets ``(extended ids, positions)`` of the others."""
        failures = meta.failures or []
        at = [k for _, k, _ in failures]
        if good.size + len(at) != meta.pulled or not all(0 <= k < meta.pulled for k in at):
            raise LedgerError(
                f"worker {self.worker} says it took {meta.pulled} positions for a batch, "
                f"but the batch begins {good.size} samples and {len(at)} failed"
            )
        failed = np.zeros(meta.pulled, np.bool_)
        failed[at] = True
        taken = np.empty(meta.pulled, np.int64)
        taken[failed] = [ext for ext, _, _ in failures]
        taken[~failed] = good
        want, ps = self._take(meta.pulled)
        self._check(want, taken)
        self.failed = (taken[failed], ps[failed])
        return ps[~failed]

    def _check(self, want: np.ndarray, ids: np.ndarray) -> None:
        if want.size == ids.size and np.array_equal(want, ids):
            return
        mixture = self.pipeline.mixture
        bad = next((i for i in range(ids.size) if i >= want.size or want[i] != ids[i]), ids.size)

        def name(ext: int) -> str:
            epoch, s, row = mixture.split_ext(ext)
            return f"row {row} of source {mixture.names[s]!r} (its epoch {epoch})"

        got = name(int(ids[bad])) if bad < ids.size else "nothing"
        said = name(int(want[bad])) if bad < want.size else "the end of its epoch"
        raise LedgerError(
            f"worker {self.worker} produced {got}, but the mixture's plan says {said}: the "
            "pipeline is not deterministic (changed data, or a transform that changes the order)"
        )


def rebuild_mixed_batch(
    mixture: Mixture,
    seed: int,
    events: Any,
    per_sample_rng: bool,
    collate_fn: Callable[[list[Any]], Any],
    *,
    seed_maps: bool = True,
) -> Any:
    """Re-create a logged batch of a mixture with streams from its events.

    Each sample is re-read from its source and transformed as its lane did
    (:func:`ledger.stream.sample.load_sample` with the source's seed and the logged
    ``source_epoch``; a map-style source's ``dataset[i]``,
    :meth:`ledger.stream.indexed.IndexedSource.load`); a packed mixture re-packs the
    logged spans into sequences.

    Args:
        mixture: the run's mixture (some source a :class:`ledger.stream.Stream`).
        seed: the run's seed.
        events: the batch's ``sample``/``span`` events in batch order (an Arrow table with
            ``source``, ``source_epoch``, ``sample_id`` and, packed, the span columns).
        per_sample_rng: whether the run seeded the global RNGs per sample.
        collate_fn: the run's collate function (unpacked mixtures).
        seed_maps: whether the run seeded map-style samples (its ``rng`` not ``"off"``).

    Returns:
        The batch as the loader yielded it: ``collate_fn(items)``, or for a packed mixture
        ``{"tokens", "sample_ids"}`` (``int64 (sequences, seq_len)``; ``sample_ids`` are
        flat ids, ``offsets[source] + row``).

    Raises:
        SourceMissing: if an event names a source the mixture does not have.
        LedgerError: if an event lacks its source epoch
            (a log written before ``source_epoch`` was recorded), or a sample's length
            differs from its span's.
    """
    names = events.column("source").cast(pa.string()).to_pylist()
    rows = events.column("sample_id").to_pylist()
    if "source_epoch" not in events.column_names:
        epochs: list[int | None] = [None] * len(rows)
    else:
        epochs = events.column("source_epoch").to_pylist()
    index = {n: i for i, n in enumerate(mixture.names)}
    keys: list[tuple[int, int, int]] = []  # (source, source epoch, row) of each event
    for name, epoch, row in zip(names, epochs, rows, strict=True):
        if name not in index:
            raise SourceMissing(
                "mixture source",
                name,
                None,
                f"The batch holds samples of source {name!r}, which this mixture "
                f"({', '.join(mixture.names)}) does not have: pass the mixture of the phase "
                "that served the batch.",
            )
        if epoch is None:
            raise LedgerError(
                "the log does not record the source epoch of this mixture's samples (written "
                "before the source_epoch column): its batches cannot be re-created"
            )
        keys.append((index[name], int(epoch), int(row)))
    items: dict[tuple[int, int, int], Any] = {}
    with rngs_preserved(True):
        for s in sorted({k[0] for k in keys}):
            stream = mixture.sources[s]
            wanted = sorted({k for k in keys if k[0] == s})
            sseed = source_seed(seed, mixture.names[s])
            if isinstance(stream, IndexedSource):
                for key in wanted:
                    items[key] = stream.load(sseed, key[1], key[2], seed_maps)[0]
                continue
            unique = sorted({row for _, _, row in wanted})
            records = dict(zip(unique, stream.source.read(unique), strict=True))
            for key in wanted:
                items[key] = load_sample(
                    stream, sseed, key[1], key[2], records[key[2]], per_sample_rng
                )[0]
    packer = mixture.sources[0].packer
    if packer is None:
        return collate_fn([items[k] for k in keys])
    spans = list(
        zip(
            events.column("token_start").to_pylist(),
            events.column("token_end").to_pylist(),
            events.column("length").to_pylist(),
            strict=True,
        )
    )
    flat = [int(mixture.offsets[s]) + row for s, _, row in keys]
    docs = iter([items[k] for k in keys])
    return assemble(packer, flat, spans, lambda _sid: next(docs))
