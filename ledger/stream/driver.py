"""The main-process side of a stream: fold consumed batches, snapshot, replay.

:class:`ledger.DataLoader` delegates here when it is given a :class:`Stream`. The driver
keeps one ids-only :class:`~ledger.stream.replica.Replica` per logical worker, folds each
batch the training loop receives into it, logs the batch, and at each commit logs the
replicas' buffer contents as ``buffer`` events; their cursors go into the marker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch.utils.data as tud

from ledger import segments
from ledger.commits import Commit, PipelineState, WorkerState, newest_segments, read_commit
from ledger.errors import LedgerError, LogCorrupted
from ledger.schema import BUFFER, SAMPLE, SPAN, EventChunk
from ledger.store import Store
from ledger.stream.pipeline import (
    BatchMeta,
    EpochPlan,
    Piece,
    Stream,
    StreamDataset,
    carry_over,
    identity,
)
from ledger.stream.replica import Replica, next_worker, replicas


class StreamDriver:
    """Runs a :class:`Stream` under torch's DataLoader and keeps its state exact.

    Args:
        stream: the pipeline.
        seed, shuffle, rank, world_size, batch_size, per_sample_rng, digest: the loader's.
        num_workers: DataLoader workers; ``max(num_workers, 1)`` logical workers.
        collate_fn: collates items (no packing).
        torch_kwargs: the other ``torch.utils.data.DataLoader`` arguments.
    """

    def __init__(
        self,
        stream: Stream,
        *,
        seed: int,
        shuffle: bool,
        rank: int,
        world_size: int,
        num_workers: int,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        per_sample_rng: bool,
        torch_kwargs: dict[str, Any],
        store: Store,
        digest: bool = True,
    ) -> None:
        self.stream = stream
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.workers = max(num_workers, 1)
        self.store = store
        stream.source.record_digests(store)  # changed rows are caught where they are read
        self.dataset = StreamDataset(
            stream,
            seed,
            shuffle,
            rank,
            world_size,
            self.workers,
            batch_size,
            collate_fn,
            per_sample_rng,
            digest,
        )
        self.torch_loader = tud.DataLoader(
            self.dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=identity,
            **torch_kwargs,
        )
        self.buffers: dict[int, list[int]] = {}  # at the state the replicas started from
        self.replicas: list[Replica] = []
        self._states: list[WorkerState] = []
        self._plans: dict[tuple[int, str, int, int], EpochPlan] = {}
        self._carries: dict[tuple[str, int, int], dict[int, Any] | None] = {}
        self._newest: dict[str, list[Any]] = {}

    def initial_state(self) -> PipelineState:
        return self.epoch_start(0, 0, "")

    def config(self) -> dict[str, Any]:
        return {**self.stream.config(), "workers": self.workers}

    def plan(
        self, epoch: int, origin: str, world_size: int | None = None, workers: int | None = None
    ) -> EpochPlan:
        """The plan of ``epoch`` for a shape (default: this loader's) that began at
        ``origin`` (``""``: the run's start; else the commit it resumed from)."""
        world_size = world_size or self.world_size
        workers = workers or self.workers
        key = (epoch, origin, world_size, workers)
        plan = self._plans.get(key)
        if plan is None:
            carry = self._carry(origin, epoch, world_size * workers) if origin else None
            plan = self.dataset.plan(epoch, carry, world_size, workers)
            if len(self._plans) > 16:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _carry(self, origin: str, epoch: int, total: int) -> dict[int, Any] | None:
        """What the shape before ``origin`` left of ``epoch``, dealt to ``total`` workers."""
        key = (origin, epoch, total)
        if key not in self._carries:
            head = read_commit(self.store, origin)
            states = sorted(head.states, key=lambda s: s.rank)
            old = self.plan(epoch, states[0].origin, head.world_size, len(states[0].workers))
            # An epoch is carried if an old rank was in it or had yet to reach it while the
            # old shape itself served it from a carry (two reshapes in one epoch).
            carried = epoch <= max(s.epoch for s in states) or old.carry is not None
            if epoch < min(s.epoch for s in states) or not carried:
                self._carries[key] = None
            else:
                buffers = {
                    (s.rank, w): ids
                    for s in states
                    if s.epoch == epoch
                    for w, ids in self._snapshot(head, s).items()
                }
                self._carries[key] = carry_over(old, [(s.rank, s) for s in states], buffers, total)
        return self._carries[key]

    def epoch_start(self, epoch: int, batch: int, origin: str) -> PipelineState:
        """The state at the start of ``epoch`` (or, in epochs an earlier shape left
        unfinished, of the first one that gives this rank anything to serve)."""
        while True:
            plan = self.plan(epoch, origin)
            workers = tuple(
                WorkerState(w, tails=tuple(plan.tails(self.rank, w))) for w in range(self.workers)
            )
            if plan.carry is None or any(
                plan.pieces(self.rank, w) or plan.tails(self.rank, w) for w in range(self.workers)
            ):
                return PipelineState(self.rank, epoch, 0, batch, workers, 0, origin=origin)
            epoch += 1

    def current_buffers(self) -> dict[int, list[int]]:
        """Each logical worker's buffer contents now, by worker, in slot order."""
        if self.replicas:
            return {r.worker: r.feed.buffer() for r in self.replicas}
        return self.buffers

    def reset(self, buffers: dict[int, list[int]]) -> None:
        """Forget the replicas: the next :meth:`begin` starts from ``buffers``."""
        self.buffers = buffers
        self.replicas = []

    def begin(self, state: PipelineState) -> None:
        """Prepare an iteration from ``state`` (workers are forked with this state)."""
        plan = self.plan(state.epoch, state.origin)
        self.buffers = self.current_buffers()
        self.replicas = replicas(
            self.stream, plan, self.rank, self.seed, state.workers, self.buffers
        )
        self._states = [r.state() for r in self.replicas]
        if all(r.exhausted() for r in self.replicas):
            raise LedgerError(
                f"rank {self.rank} gets no shard in epoch {state.epoch}: the stream has "
                f"{len(self.stream.source.files)} shards for "
                f"{self.world_size * self.workers} workers in all; use fewer workers "
                "or more shards"
            )
        self.dataset.start = state
        self.dataset.buffers = self.buffers
        self.dataset.epoch_plan = plan

    def record(self, state: PipelineState, meta: BatchMeta) -> tuple[EventChunk, PipelineState]:
        """Fold one consumed batch: the events to log and the state after it.

        Raises:
            LedgerError: if the batch is not the one the plan predicts (another worker's
                turn, or other samples).
        """
        if meta.worker != state.next_worker or meta.epoch != state.epoch:
            raise LedgerError(
                f"a batch of worker {meta.worker} (epoch {meta.epoch}) arrived where worker "
                f"{state.next_worker} (epoch {state.epoch}) was next"
            )
        replica = self.replicas[meta.worker]
        replica.fold(meta)
        positions = self.plan(state.epoch, state.origin).positions(meta.sample_ids)
        values = meta.draws
        spans = meta.spans
        chunk = EventChunk(
            SPAN if spans is not None else SAMPLE,
            state.epoch,
            state.batch,
            meta.worker,
            0,
            meta.sample_ids,
            positions=positions,
            token_start=spans[:, 0] if spans is not None else None,
            token_end=spans[:, 1] if spans is not None else None,
            length=spans[:, 2] if spans is not None else None,
            values=values,
            digest=meta.digest,
        )
        after = next_worker(self.replicas, meta.worker)
        if after < 0:  # every logical worker of the rank finished: the epoch is over
            self.reset({})
            nxt = self.epoch_start(state.epoch + 1, state.batch + 1, state.origin)
        else:
            # Only the folded worker moved: the others' states are reused.
            self._states[meta.worker] = replica.state()
            nxt = PipelineState(
                self.rank,
                state.epoch,
                state.epoch_batch + 1,
                state.batch + 1,
                tuple(self._states),
                after,
                origin=state.origin,
            )
        return chunk, nxt

    def finish(self, state: PipelineState, start_epoch: int) -> None:
        """Check, when torch's iterator ends, that the replicas agree the epoch is over.

        Raises:
            LedgerError: if torch ended the epoch while a worker still had samples.
        """
        if state.epoch == start_epoch:
            raise LedgerError(
                f"the workers stopped in epoch {state.epoch} while the plan still holds "
                f"samples for worker {state.next_worker}"
            )

    def snapshot(self, state: PipelineState) -> list[EventChunk]:
        """``buffer`` events: each logical worker's buffer contents, in slot order."""
        return [
            EventChunk(
                BUFFER,
                state.epoch,
                state.batch,
                worker,
                0,
                np.array(ids, np.int64),
                positions=np.arange(len(ids), dtype=np.int64),
            )
            for worker, ids in sorted(self.current_buffers().items())
            if ids
        ]

    def replay(self, store: Store, head: Commit) -> PipelineState:
        """Rebuild the rank's state and buffers at ``head`` from the log, and check them.

        With the world size and worker count of ``head``, the rank continues exactly
        where it stood. With another shape, every rank starts over in the oldest epoch
        an old rank had not finished, serving what the old shape left
        (:func:`~ledger.stream.pipeline.carry_over`): every sample and every token of each
        epoch is then consumed exactly once across the shapes, in an order that is a
        function of the new shape.

        Raises:
            LogCorrupted: if the buffer snapshot is missing or disagrees with the cursors.
        """
        self.store = store
        states = head.states
        if head.world_size != self.world_size or len(states[0].workers) != self.workers:
            self.reset({})
            ahead = states[0]
            return self.epoch_start(min(s.epoch for s in states), ahead.batch, head.id)
        state = head.state(self.rank)
        buffers = self._snapshot(head, state)
        plan = self.plan(state.epoch, state.origin)
        for w in state.workers:
            ids = buffers.get(w.worker, [])
            expected = w.rows_read - w.emitted if self.stream.shuffle_buffer else 0
            if len(ids) != expected:
                raise LogCorrupted(
                    f"commit {head.id}: worker {w.worker} read {w.rows_read} rows and handed on "
                    f"{w.emitted}, so its buffer holds {expected}, but the log's snapshot "
                    f"holds {len(ids)}"
                )
            self._check_read(plan.pieces(self.rank, w.worker), w, ids, head.id)
        self.reset(buffers)
        return state

    def _snapshot(self, head: Commit, state: PipelineState) -> dict[int, list[int]]:
        """Buffer contents of ``state``'s rank at ``head``, by worker, in slot order."""
        if not any(w.rows_read > w.emitted for w in state.workers):
            return {}
        if head.id not in self._newest:  # one look-up per head for all its ranks
            self._newest = {head.id: newest_segments(self.store, head, len(head.states))}
        ref = self._newest[head.id][state.rank]
        if ref is None:
            raise LogCorrupted(f"commit {head.id} has buffered samples but no segment")
        table = segments.read(
            self.store,
            ref.path,
            rows=ref.rows,
            checksum=ref.sha256,
            columns=["worker", "batch", "position", "sample_id", "kind"],
        )
        table = table.filter(pc.equal(table["kind"].cast(pa.string()), BUFFER))
        table = table.filter(pc.equal(table["batch"], state.batch))
        buffers = {}
        for w in state.workers:
            rows = table.filter(pc.equal(table["worker"], w.worker))
            order = np.argsort(rows["position"].to_numpy())
            buffers[w.worker] = rows["sample_id"].to_numpy()[order].tolist()
        return buffers

    def _check_read(self, pieces: list[Piece], w: WorkerState, ids: list[int], cid: str) -> None:
        """Every buffered id must be a row the worker has already read."""
        if not ids:
            return
        files, rows = self.stream.source.locate(np.array(ids, np.int64))
        for f, r, sid in zip(files.tolist(), rows.tolist(), ids, strict=True):
            done = any(
                pf == f and start <= r < stop and (k < w.shard or (k == w.shard and r < w.row))
                for k, (pf, start, stop) in enumerate(pieces)
            )
            if not done:
                raise LogCorrupted(
                    f"commit {cid}: worker {w.worker}'s buffer holds sample {sid}, which its "
                    "plan has not read yet: the log and the source disagree"
                )
