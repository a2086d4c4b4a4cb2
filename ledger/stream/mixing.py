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
   sample's transform is seeded from ``(source seed, source epoch, sample id)``. A
   source's epoch is per lane: the lanes of a source go through its epochs at the rate
   their workers draw it, equal on average (equal runs, and every worker takes every
   ``G``-th position), so a small source's lanes may drift a few source epochs apart
   over a long run; each sample is still served once per epoch of its lane. A map-style
   source beside streams has lanes of another kind (:mod:`ledger.stream.indexed`): run
   ``gw`` of its seeded order of each source epoch, read by ``dataset[i]``, no buffer.
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

5. **Phases** (``load_state_dict(token, new_phase=True)``) may change the weights or
   schedule, the sources and the batch size. A phase that changes the weights starts
   at one global position ``S = epoch * epoch_size + position``: the largest next
   position of any logical worker at the commit resumed (each worker's from its own
   state), which no worker has reached. Below ``S`` a position keeps the earlier phases'
   source (a lagging worker still serves some), from ``S`` on the new schedule's, its
   boundaries counted from ``S`` (:class:`ledger.mixture.Phase`, as for map-style
   mixtures); lanes and packers go on where they stood. The attempt record's phase holds
   ``mix`` (the phase's ``number``, ``start``, ``base``, ``names``) and ``earlier`` (every
   earlier phase's, with its schedule and source names), so later resumes and the audits
   (which classify positions by phase start) see the same sources. Sources are matched by
   name: a kept source's lanes go on where they stood, a new one's start at its epoch 0,
   a removed one's are dropped (with the rest of a sample of it a packer had begun), and
   a position below ``S`` of a removed source that a lagging worker has yet to serve
   takes the new phase's source extended backward from ``S``
   (:meth:`ledger.mixture.Phase.sources_before`; see :meth:`MixedStreamPipeline.new_phase`).

6. **Bad samples** (``on_error="skip"``): a sample whose transform raises takes its
   position and its lane's next id as any other (the ids never depend on the data), and
   is left out of its batch, which takes the next position; the worker names it in the
   batch's :class:`~ledger.stream.worker.BatchMeta` ``failures`` (extended id, index
   among the positions taken), the replica folds the positions taken, failed ones
   included, and it is logged as an ``error`` event at its position.

Costs: a resume reads the head marker and one segment per rank (the lanes' ``buffer``
events); a change of shape reads the newest segment of each old rank whose buffered
rows the new rank's lanes are dealt (a lane's run is contiguous: about ``W_old / W_new``
old ranks, not all of them; :class:`~ledger.stream.plan.RowDeal`), and again for each
earlier change of shape whose carried source epoch a lane is still in (as a stream does
for a carried epoch). Per batch, the main process computes
the batch's positions, their sources and each lane's next ids with array operations.

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

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch.utils.data as tud

from ledger import segments
from ledger.commits import Commit, PipelineState, WorkerState, newest_segments, read_commit
from ledger.errors import ConfigMismatch, LedgerError, LogCorrupted
from ledger.journal import JournalOrder
from ledger.pipeline import LoaderSettings, in_process, phase_record, refuse_phase
from ledger.schema import BUFFER, ERROR, ORDER_ALGORITHM, SAMPLE, SPAN, EventChunk
from ledger.store import Fetched, Store
from ledger.stream.lanes import EMPTY, Lanes, Positions, equal_runs, source_pieces, source_seed
from ledger.stream.mixer import MixedDataset, MixedReplica, WorkerPlan
from ledger.stream.packing import Tail
from ledger.stream.plan import Buffers, Held, RowDeal
from ledger.stream.replica import next_worker
from ledger.stream.shuffle import Piece
from ledger.stream.source import checked_fingerprint
from ledger.stream.spec import Stream
from ledger.stream.worker import BatchMeta, identity
from ledger.validate import require

if TYPE_CHECKING:
    from ledger.mixture import Mixture


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
        lanes: by source: ``(source epoch, the pieces left, in runs by new global
            worker)``: the new lanes serve the carried pieces as that source epoch, then
            fresh ones. A run's lane buffers are read when it is first asked for, so a
            new rank reads only the old ranks' segments whose buffered rows it is dealt.
    """

    epochs: dict[int, EpochLeft]
    lanes: list[tuple[int, RowDeal]]


class MixedStreamPipeline:
    """The pipeline of a :class:`ledger.Mixture` of streams (:class:`ledger.pipeline.Pipeline`).

    Args:
        mixture: the mixture (some source a :class:`ledger.stream.Stream`, the others
            map-style datasets wrapped as :class:`ledger.stream.indexed.IndexedSource`).
        settings: the loader's settings (``drop_last`` and ``persistent_workers`` off).

    Raises:
        ValueError: for ``drop_last=True`` or ``persistent_workers=True``, or an epoch
            with fewer positions, or a source with fewer rows, than logical workers.
    """

    def __init__(self, mixture: Mixture, settings: LoaderSettings) -> None:
        if settings.drop_last or settings.persistent_workers:
            raise ValueError(
                "a Mixture of streams serves every position (drop_last=False) and needs "
                "fresh workers each epoch (persistent_workers=False)"
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
            if isinstance(stream, Stream):  # a map-style source has no row groups
                # By name: a new phase may add or remove sources, which moves the others.
                folder = f"data/rowgroups/source={_folder(name)}"
                stream.source.record_digests(self.store, folder)
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
        self._old: tuple[Commit, list[PipelineState]] | None = None  # see _old_shape
        self._mixers: list[WorkerState] = []
        self._lane_states: list[list[WorkerState]] = []
        # Commit id -> (source names, rows) at it, for a new phase with other sources.
        self._was: dict[str, tuple[tuple[str, ...], list[int]]] = {}

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
        """Check each stream source against the fingerprint the log recorded for it.

        Raises:
            ConfigMismatch: for a changed source.
            LogCorrupted: if ``run.json``'s mixture or a source's fingerprint is mangled.
        """
        where = "run.json, config, mixture"
        mix = require(logged, "mixture", dict, "run.json, config")
        sources = require(mix, "sources", list, where)
        entries = {}
        for i, e in enumerate(sources):
            entries[require(e, "name", str, f"{where}, sources[{i}]")] = e
        for name, stream in zip(self.mixture.names, self.mixture.sources, strict=True):
            entry = entries.get(name)  # a source a later phase added is not in run.json
            if entry is not None and isinstance(stream, Stream):
                at = f"{where}, source {name!r}"
                recorded = require(entry, "stream", dict, at, default={})
                stream.source.check(
                    checked_fingerprint(require(recorded, "source", list, at, default=[]), at)
                )

    def batches_per_epoch(self) -> int:
        raise TypeError("a stream mixture's batches per epoch are not known in advance")

    # ------------------------------------------------------------------ plans

    def lanes(
        self, g: int, world: int | None = None, workers: int | None = None, rank: int | None = None
    ) -> Lanes:
        return Lanes(
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
                return by_worker.pieces(rank * workers + g)
        stream = self.mixture.sources[s]
        seed = source_seed(self.seed, self.mixture.names[s])
        return source_pieces(
            stream, seed, epoch, self.settings.shuffle, world * workers, rank * workers + g
        )

    def _positions(
        self, epoch: int, origin: str, world: int, workers: int, gw: int
    ) -> tuple[Positions, list[Tail], list[int]]:
        """A global worker's positions and tails (with theirs) in a mixture epoch."""
        n = self.mixture.epoch_size
        stride = world * workers
        left = self._reshape(origin, world, workers).epochs.get(epoch) if origin else None
        if left is None:
            return Positions(EMPTY, gw, stride, n), [], []
        return (
            Positions(left.gap.get(gw, EMPTY), left.start + gw, stride, n),
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

    def _reshape(
        self, origin: str, world: int, workers: int, head: Commit | None = None
    ) -> Reshape:
        """What the shape before ``origin`` left to the shape ``(world, workers)`` after it
        (``head``: the commit ``origin``, when the caller has read it)."""
        key = (origin, world, workers)
        found = self._reshapes.get(key)
        if found is None:
            head = head if head is not None else read_commit(self.store, origin)
            found = self._carry(head, world, workers)
            if len(self._reshapes) > 8:
                self._reshapes.clear()
            self._reshapes[key] = found
        return found

    def _old_shape(self, head: Commit) -> tuple[Commit, list[PipelineState]]:
        """``head`` and its ranks' states by rank, decoded once (a change of shape needs
        every old rank's state, ~40 µs each to decode from the rank table)."""
        if self._old is None or self._old[0].id != head.id:
            self._old = (head, sorted(head.states, key=lambda st: st.rank))
        return self._old

    def _carry(self, head: Commit, world: int, workers: int) -> Reshape:
        """See :class:`Reshape` and the module docstring (4.)."""
        n = self.mixture.epoch_size
        total = world * workers
        _, states = self._old_shape(head)
        old_world = head.world_size
        old_k = len(states[0].workers) // self.width
        old_origin = states[0].origin
        read_ranks: dict[int, Buffers] = {}

        def read(ranks: list[int]) -> Buffers:
            """The lanes' buffers of old ``ranks`` (each rank's segment read once)."""
            missing = [r for r in ranks if r not in read_ranks]
            if missing:
                got = self._old_buffers(head, [states[r] for r in missing])
                for r in missing:
                    read_ranks[r] = {k: v for k, v in got.items() if k[0] == r}
            return {k: v for r in ranks for k, v in read_ranks[r].items()}

        epochs: dict[int, EpochLeft] = {}
        for e in range(min(st.epoch for st in states), max(st.epoch for st in states) + 1):
            gaps: list[np.ndarray] = []
            nexts: list[tuple[int, int]] = []
            tails: list[Tail] = []
            tail_positions: list[int] = []
            # Whether some old worker served its last position of epoch e: then the first
            # position no old worker reached is the epoch's end, and every position still
            # unserved lies in the gap (the new stride from a lower start would serve again
            # positions of the worker that finished).
            reached_end = False
            for st in states:
                if st.epoch > e:
                    reached_end = True  # the rank served all of epoch e
                    continue
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
                    else:
                        reached_end = True
            start = n if reached_end else min(n, max((x for x, _ in nexts), default=n))
            left = np.sort(
                np.concatenate(
                    [*gaps, *(np.arange(x, start, stride, dtype=np.int64) for x, stride in nexts)]
                    or [EMPTY]
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
            pieces: list[Piece | Held] = []
            for rank, g, lane in old:
                for e in range(lane.worker, last + 1):
                    mine = self._lane_pieces(s, e, old_origin, old_world, old_k, rank, g)
                    if e > lane.worker:
                        pieces += mine
                        continue
                    if stream.shuffle_buffer and lane.rows_read > lane.emitted:
                        pieces.append(Held((rank, g, s), lane.rows_read - lane.emitted))
                    if lane.shard < len(mine):
                        f, lo, hi = mine[lane.shard]
                        if max(lane.row, lo) < hi:
                            pieces.append((f, max(lane.row, lo), hi))
                        pieces += mine[lane.shard + 1 :]
            rows = stream.source if isinstance(stream, Stream) else None  # no buffer if None
            lanes.append((last, equal_runs(rows, pieces, total, read)))
        return Reshape(epochs, lanes)

    def _old_buffers(self, head: Commit, states: list[PipelineState]) -> Buffers:
        """Lane buffers at ``head``: ``(rank, worker, source) -> ids`` in slot order (on an
        object store, the old ranks' segments fetched a chunk at once)."""
        holding = [
            st
            for st in states
            if any(w.rows_read > w.emitted for i, w in enumerate(st.workers) if i % self.width)
        ]
        if not holding:
            return {}
        refs = newest_segments(self.store, head, len(head.states))
        out: Buffers = {}
        for chunk, fetched in self.store.read_ahead_chunks(
            holding, lambda st: ref.path if (ref := refs[st.rank]) else None
        ):
            for st in chunk:
                ref = refs[st.rank]
                if ref is None:
                    raise LogCorrupted(f"commit {head.id} has buffered samples but no segment")
                for (g, s), ids in self._read_buffers(ref, st.batch, fetched=fetched).items():
                    out[(st.rank, g, s)] = ids
        return out

    def _read_buffers(
        self,
        ref: Any,
        batch: int,
        names: tuple[str, ...] | None = None,
        fetched: Fetched | None = None,
    ) -> dict[tuple[int, int], list[int]]:
        """Lane buffers in a segment at ``batch``: ``(worker, source) -> ids`` in slot
        order, sources by their place in ``names`` (default: the mixture's); the segment
        from ``fetched`` when it holds it."""
        table = segments.read(
            self.store,
            ref.path,
            rows=ref.rows,
            checksum=ref.sha256,
            columns=["worker", "batch", "position", "sample_id", "kind", "source"],
            fetched=fetched,
        )
        table = table.filter(pc.equal(table["kind"].cast(pa.string()), BUFFER))
        table = table.filter(pc.equal(table["batch"], batch))
        index = {name: i for i, name in enumerate(names or self.mixture.names)}
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
        if self.torch_loader.num_workers == 0:  # torch's iterator, without its per-batch wrapper
            return in_process(self.torch_loader)
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
        source_epochs, codes, ids = self.mixture.split_ext(meta.sample_ids)
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
            source_epochs=source_epochs,
        )
        events = [chunk]
        if replica.failed is not None:  # on_error="skip": positions taken, samples left out
            failed, failed_positions = replica.failed
            failed_epochs, failed_codes, failed_ids = self.mixture.split_ext(failed)
            events.append(
                EventChunk(
                    ERROR, state.epoch, state.batch, meta.worker, 0, failed_ids,
                    positions=failed_positions, values=[v for _, _, v in meta.failures or []],
                    sources=failed_codes.astype(np.int16), source_names=self.mixture.names,
                    source_epochs=failed_epochs,
                )
            )  # fmt: skip
        g = meta.worker
        self._mixers[g] = replica.mixer()
        self._lane_states[g] = [lane.state() for lane in replica.lanes]
        after = next_worker(self.replicas, g)  # type: ignore[arg-type]
        if after < 0:  # the rank's part of the mixture epoch is over; lanes go on
            self.buffers = self.current_buffers()
            lanes = self._lane_states
            self.replicas = []
            return self.epoch_start(state.epoch + 1, state.batch + 1, state.origin, lanes), events
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
        return nxt, events

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

    def journal_order(self) -> JournalOrder | None:
        return None  # a stream's ids come from its shuffle buffers: the journal records them

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
        """Take each position's source from the phases of an attempt record (its own
        schedule from its ``start``, the earlier phases' below it); ``None``: the
        mixture's own schedule from position 0."""
        from ledger.mixture import Phase, _phase_of

        names = self.mixture.names
        if phase is None or "mix" not in phase:  # no phase, or a batch size's
            zero = np.zeros(len(names), np.int64)
            own = Phase(0, zero, self.mixture.counts, self.mixture.schedule.starts)
            self.mixture.enter_phase([own])
            return

        def named(record: dict[str, Any], schedule: list[list[Any]]) -> Phase:
            own = tuple(record.get("names", names))  # recorded since sources can change
            ph = _phase_of(record, schedule, own)
            if own != names:
                index = {name: i for i, name in enumerate(names)}
                ph.remap = np.array([index.get(name, -1) for name in own], np.int64)
            return ph

        phases = [named(ph, ph["schedule"]) for ph in phase["earlier"]]
        phases.append(named(phase["mix"], phase["config"]["mixture"]["schedule"]))
        self.mixture.enter_phase(phases)

    def new_phase(
        self, store: Store, head: Commit, current: dict[str, Any] | None, logged: dict[str, Any]
    ) -> dict[str, Any]:
        """A new phase with other weights (or schedule), sources and batch size.

        **Where it starts.** Logical workers stand at different positions (each takes
        every ``G``-th one, and a batch of one worker may be consumed before another's),
        so the phase starts at one global position ``S`` (``epoch * epoch_size +
        position``) that every worker respects: the largest next position of any logical
        worker of any rank at ``head`` (each worker's from its own state). No worker
        has served ``S`` or beyond, and every position below ``S`` that a lagging worker
        has yet to serve keeps the earlier phase's source. The source of a position is
        the earlier phases' below ``S`` and the new schedule's from ``S`` on (its
        boundaries count from ``S``), as for map-style mixtures; each lane goes on with
        its source's stream where it stood, and the packers where they stood. A run that
        is given the same phases from its start serves the same batches, so a later
        resume is exact, and the audits classify positions by phase the same way.

        **New and removed sources** (by name; a source kept keeps its stream, rows and
        place in nothing but its name): a kept source's lanes go on where they stood
        (source epoch, cursor, shuffle buffer); an added source's lanes start at its
        epoch 0, row 0, with empty buffers; a removed source's lanes are dropped (their
        buffered rows were never consumed; its consumed samples stay on the record),
        and so is the rest of a sample of it that a packer had begun. A position below
        ``S`` that the earlier phases gave a removed source, which a lagging worker has
        yet to serve, takes the source of the new phase's first piece extended backward
        from ``S`` (:meth:`ledger.mixture.Phase.sources_before`); the mixture audit counts
        it in the new phase.

        A new batch size only cuts each worker's mixed stream into other batches.

        Raises:
            ConfigMismatch: if a kept source's rows or stream, the epoch size, or
                anything but the weights, schedule, sources and batch size changed; or
                if the sources change together with the world size or ``num_workers``,
                or while a worker still serves what an earlier change of shape left.
        """
        from ledger.mixture import _phase_of

        base = current["config"] if current is not None else logged
        mine = self.config()
        old_mix = base.get("mixture") or {}
        new_mix = mine["mixture"]
        was_names = _kept_sources(old_mix, new_mix)
        names = self.mixture.names
        changed = was_names != names
        mixed = current is not None and "mix" in current  # the current phase mixes anew
        if not changed and old_mix.get("schedule") == new_mix.get("schedule"):
            record = phase_record(mine, current, logged, ("batch_size",), 0)
            if mixed:  # the current phase's mixing goes on
                assert current is not None
                for key in ("start", "base", "mix", "earlier"):
                    record[key] = current[key]
            return record
        refuse_phase(mine, base, ("batch_size", "mixture"))
        if changed:
            self._check_source_change(store, head, was_names)
            lengths = [int(src["len"]) for src in old_mix["sources"]]
            self._was[head.id] = (was_names, lengths)
        if mixed:
            assert current is not None
            was_record = current["mix"]
            earlier = list(current["earlier"])
        else:
            was_record = {"number": 0, "start": 0, "base": [0] * len(was_names)}
            earlier = []
        was = _phase_of(was_record, old_mix["schedule"], was_names)
        start = self._phase_start(head, 1 + len(was_names), changed)
        number = (int(current["number"]) if current is not None else 0) + 1
        counts = dict(zip(was_names, was.counts_before(self.seed, start).tolist(), strict=True))
        mix = {
            "number": number,
            "start": start,
            "base": [counts.get(name, 0) for name in names],
            "names": list(names),
        }
        return {
            "number": number,
            "config": mine,
            "start": start,
            "base": mix["base"],
            "mix": mix,
            "earlier": [
                *earlier,
                {**was_record, "schedule": old_mix["schedule"], "names": list(was_names)},
            ],
        }

    def _check_source_change(self, store: Store, head: Commit, was_names: tuple[str, ...]) -> None:
        """Refuse to add or remove sources at ``head`` where the lanes cannot be kept by
        name: with another shape, or while an earlier change of shape's leftovers are
        still being served (their plan reads the old sources' lanes by place).

        Raises:
            ConfigMismatch: naming what stands in the way and what to do.
        """
        width = 1 + len(was_names)
        old_k = len(head.states[0].workers) // width
        if (head.world_size, old_k) != (self.world_size, self.k):
            # TODO(mixture-streams-phases): the carry-over of a change of shape reads the
            # old lanes by place; a change of sources at the same resume would need it
            # to read them by name.
            raise ConfigMismatch(
                "world_size and num_workers",
                [head.world_size, old_k],
                [self.world_size, self.k],
                "A new phase that adds or removes sources of a Mixture of streams keeps "
                "the world size and num_workers: resume with the old shape and "
                "new_phase=True, commit, then resume with the new shape.",
            )
        for origin in sorted({st.origin for st in head.states if st.origin}):
            left = read_commit(store, origin)
            epoch = max(st.epoch for st in left.states)
            busy = [st.rank for st in head.states if st.epoch <= epoch]
            kept = [i for i, name in enumerate(was_names) if name in self.mixture.names]
            for i in kept:
                carried = max(st.workers[g * width + 1 + i].worker
                              for st in left.states
                              for g in range(len(st.workers) // width))  # fmt: skip
                if any(
                    st.workers[g * width + 1 + i].worker <= carried
                    for st in head.states
                    for g in range(self.k)
                ):
                    busy.append(-1 - i)
            if busy:
                # TODO(mixture-streams-phases): the leftovers of a change of shape are
                # planned from the old lanes by place; refused until they are by name.
                raise ConfigMismatch(
                    "mixture sources",
                    list(was_names),
                    list(self.mixture.names),
                    f"Commit {head.id} still serves what the change of shape at commit "
                    f"{origin} left (mixture epoch {epoch} or a source epoch its lanes were "
                    "in): add or remove sources at a later commit, once every worker has "
                    "gone past them (resume without new_phase and train on).",
                )

    def _phase_start(self, head: Commit, width: int, fresh: bool = False) -> int:
        """The largest next global position of any logical worker at ``head``, whose
        states hold ``width`` worker states per logical worker (``fresh``: no epoch of
        ``head`` is served from an earlier change of shape)."""
        n = self.mixture.epoch_size
        states = head.states
        old_k = len(states[0].workers) // width
        out = 0
        for st in states:
            for g in range(old_k):
                mixer = st.workers[g * width]
                pos, _, _ = self._positions(
                    st.epoch, "" if fresh else st.origin, head.world_size, old_k,
                    st.rank * old_k + g,
                )  # fmt: skip
                nxt = pos.at(mixer.emitted, 1)
                out = max(out, st.epoch * n + (int(nxt[0]) if nxt.size else n))
        return out

    def confirm_replay(self) -> None:
        """Nothing is left running: :meth:`replay` checked everything it read."""

    def replay(self, store: Store, head: Commit) -> tuple[PipelineState, list[EventChunk]]:
        """Rebuild the rank's state and lane buffers at ``head`` (another shape: see the
        module docstring, 4.).

        Raises:
            LogCorrupted: if a buffer snapshot disagrees with its lane's cursor.
        """
        self.store = store
        self.replicas = []
        self._reshapes = {}  # commit ids name commits within one run: computed afresh
        self._old = None
        was = self._was.pop(head.id, None)  # made for this replay only
        if was is not None and was[0] != self.mixture.names:
            return self._replay_new_sources(store, head, *was), []
        states = head.states
        if head.world_size != self.world_size or len(states[0].workers) != self.workers:
            self.buffers = {}
            _, old = self._old_shape(head)  # decoded once, for the carry too
            epoch = min(st.epoch for st in old)
            reshape = self._reshape(head.id, self.world_size, self.k, head)
            mine = range(self.rank * self.k, (self.rank + 1) * self.k)
            for _, deal in reshape.lanes:  # this rank's runs' buffers, a read per source
                deal.fetch(mine)
            lanes = [[WorkerState(carried) for carried, _ in reshape.lanes] for _ in range(self.k)]
            return self.epoch_start(epoch, old[0].batch, head.id, lanes), []
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

    def _replay_new_sources(
        self, store: Store, head: Commit, was_names: tuple[str, ...], was_rows: list[int]
    ) -> PipelineState:
        """The rank's state at ``head`` (whose sources were ``was_names``, of ``was_rows``
        rows) for this mixture's sources, by name (:meth:`new_phase`): kept lanes as they
        stood, with their buffers; new ones fresh; removed ones and a removed source's
        sample in progress in a packer dropped.

        Raises:
            LogCorrupted: if a buffer snapshot disagrees with its lane's cursor.
        """
        names = self.mixture.names
        width = 1 + len(was_names)
        state = head.state(self.rank)
        old = state.workers
        old_buffers: dict[tuple[int, int], list[int]] = {}
        if any(w.rows_read > w.emitted for i, w in enumerate(old) if i % width):
            ref = newest_segments(store, head, len(head.states))[self.rank]
            if ref is None:
                raise LogCorrupted(f"commit {head.id} has buffered samples but no segment")
            old_buffers = self._read_buffers(ref, state.batch, was_names)
        offsets = np.concatenate([[0], np.cumsum(was_rows)]).astype(np.int64)
        total = int(offsets[-1])
        workers: list[WorkerState] = []
        self.buffers = {}
        for g in range(self.k):
            mixer = old[g * width]
            doc = (-1, 0, 0)
            if mixer.doc >= 0:
                epoch, flat = divmod(mixer.doc, total)
                i = int(np.searchsorted(offsets, flat, side="right")) - 1
                if was_names[i] in names:  # else its rest is dropped with its source
                    row = flat - int(offsets[i])
                    ext = self.mixture.ext_id(epoch, names.index(was_names[i]), row)
                    doc = (ext, mixer.doc_offset, mixer.doc_length)
            workers.append(replace(mixer, doc=doc[0], doc_offset=doc[1], doc_length=doc[2]))
            for s, name in enumerate(names):
                if name not in was_names:
                    workers.append(WorkerState(0))  # a new source: its epoch 0, row 0
                    continue
                i = was_names.index(name)
                lane = old[g * width + 1 + i]
                held = old_buffers.get((g, i), [])
                buffered = self.mixture.sources[s].shuffle_buffer
                want = lane.rows_read - lane.emitted if buffered else 0
                if len(held) != want:
                    raise LogCorrupted(
                        f"commit {head.id}: worker {g}'s lane of {name!r} read "
                        f"{lane.rows_read} rows and handed on {lane.emitted}, so its buffer "
                        f"holds {want}, but the log's snapshot holds {len(held)}"
                    )
                workers.append(lane)
                if held:
                    self.buffers[(g, s)] = held
        # No epoch of ``head`` is served from an earlier change of shape any more
        # (:meth:`_check_source_change`): the plan starts afresh from the positions.
        return replace(state, workers=tuple(workers), origin="")


def _kept_sources(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, ...]:
    """The source names of a stream mixture's configuration ``old`` (a phase's
    ``mixture``), after checking that ``new`` keeps what a new phase must keep: the
    epoch size and construction, and each kept source's rows and stream.

    Raises:
        ConfigMismatch: naming the first key or source that differs.
    """
    for key in sorted((set(old) | set(new)) - {"schedule", "targets", "sources"}):
        if old.get(key) != new.get(key):
            raise ConfigMismatch(
                f"mixture {key}",
                old.get(key),
                new.get(key),
                "A new phase of a Mixture of streams can change its weights, schedule, "
                "sources and batch size, not its epoch size.",
            )
    was = {src["name"]: src for src in old.get("sources", [])}
    for src in new["sources"]:
        kept = was.get(src["name"])
        if kept is not None and kept != src:
            raise ConfigMismatch(
                f"mixture source {src['name']!r}",
                kept,
                src,
                "A source kept in a new phase continues its stream where it stood, so its "
                "rows and stream stay the same: add a changed stream under a new name.",
            )
    return tuple(str(src["name"]) for src in old.get("sources", []))


def _folder(name: str) -> str:
    """A source's name as a folder name: itself if it is a plain word, else a digest."""
    if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) and name not in (".", ".."):
        return name
    return f"crc32-{zlib.crc32(name.encode()):08x}"


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
