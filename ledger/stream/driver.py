"""The main-process side of a stream: fold consumed batches, snapshot, replay.

:class:`ledger.DataLoader` delegates here when it is given a :class:`Stream`. The driver
keeps one ids-only :class:`~ledger.stream.pipeline.Replica` per logical worker, folds each
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
from ledger.commits import Commit, PipelineState, lineage
from ledger.errors import LedgerError, LogCorrupted
from ledger.schema import BUFFER, SAMPLE, SPAN, EventChunk
from ledger.store import Store
from ledger.stream.pipeline import (
    BatchMeta,
    EpochPlan,
    Replica,
    Stream,
    StreamDataset,
    fresh_workers,
    identity,
    next_worker,
    replicas,
)


class StreamDriver:
    """Runs a :class:`Stream` under torch's DataLoader and keeps its state exact.

    Args:
        stream: the pipeline.
        seed, shuffle, rank, world_size, batch_size, per_sample_rng: the loader's.
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
    ) -> None:
        self.stream = stream
        self.seed = seed
        self.rank = rank
        self.workers = max(num_workers, 1)
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
        )
        self.torch_loader = tud.DataLoader(
            self.dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=identity,
            **torch_kwargs,
        )
        self.buffers: dict[int, list[int]] = {}
        self.replicas: list[Replica] = []
        self._plans: dict[int, EpochPlan] = {}

    def initial_state(self) -> PipelineState:
        return PipelineState(self.rank, 0, 0, 0, fresh_workers(self.workers), 0)

    def config(self) -> dict[str, Any]:
        return {**self.stream.config(), "workers": self.workers}

    def plan(self, epoch: int) -> EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:
            plan = self.dataset.plan(epoch)
            self._plans = {epoch: plan}
        return plan

    def begin(self, state: PipelineState) -> None:
        """Prepare an iteration from ``state`` (workers are forked with this state)."""
        self.replicas = replicas(
            self.stream,
            self.plan(state.epoch),
            self.rank,
            self.seed,
            state.workers,
            self.buffers,
        )
        if all(r.exhausted() for r in self.replicas):
            raise LedgerError(
                f"rank {self.rank} gets no shard in epoch {state.epoch}: the stream has "
                f"{len(self.stream.source.files)} shards for "
                f"{self.dataset.world_size * self.workers} workers in all; use fewer workers "
                "or more shards"
            )
        self.dataset.start = state
        self.dataset.buffers = self.buffers

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
        positions = self.plan(state.epoch).positions(meta.sample_ids)
        values = meta.draws if any(d is not None for d in meta.draws) else None
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
        )
        after = next_worker(self.replicas, meta.worker)
        if after < 0:  # every logical worker of the rank finished: the epoch is over
            self.buffers = {}
            nxt = PipelineState(
                self.rank, state.epoch + 1, 0, state.batch + 1, fresh_workers(self.workers), 0
            )
        else:
            self.buffers = {r.worker: list(r.feed.ids) for r in self.replicas}
            nxt = PipelineState(
                self.rank,
                state.epoch,
                state.epoch_batch + 1,
                state.batch + 1,
                tuple(r.state() for r in self.replicas),
                after,
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
            for worker, ids in sorted(self.buffers.items())
            if ids
        ]

    def replay(self, store: Store, head: Commit) -> PipelineState:
        """Rebuild the rank's state and buffers at ``head`` from the log, and check them.

        Raises:
            LogCorrupted: if the buffer snapshot is missing or disagrees with the cursors.
        """
        state = head.state(self.rank)
        if len(state.workers) != self.workers:
            raise LogCorrupted(
                f"commit {head.id} records {len(state.workers)} workers for rank {self.rank}, "
                f"the run has {self.workers}"
            )
        buffers: dict[int, list[int]] = {}
        if any(w.rows_read > w.emitted for w in state.workers):
            table = self._snapshot_table(store, head)
            table = table.filter(pc.equal(table["batch"], state.batch))
            for worker in range(self.workers):
                rows = table.filter(pc.equal(table["worker"], worker))
                order = np.argsort(rows["position"].to_numpy())
                buffers[worker] = rows["sample_id"].to_numpy()[order].tolist()
        plan = self.plan(state.epoch)
        for w in state.workers:
            ids = buffers.get(w.worker, [])
            expected = w.rows_read - w.emitted if self.stream.shuffle_buffer else 0
            if len(ids) != expected:
                raise LogCorrupted(
                    f"commit {head.id}: worker {w.worker} read {w.rows_read} rows and handed on "
                    f"{w.emitted}, so its buffer holds {expected}, but the log's snapshot "
                    f"holds {len(ids)}"
                )
            self._check_read(plan, w.worker, w.shard, w.row, ids, head.id)
        self.buffers = buffers
        return state

    def _snapshot_table(self, store: Store, head: Commit) -> pa.Table:
        chain = lineage(store, head.id)
        ref = next(
            (s for c in reversed(chain) for s in c.segments if s.rank == self.rank and s.rows),
            None,
        )
        if ref is None:
            raise LogCorrupted(f"commit {head.id} has buffered samples but no segment")
        table = segments.read(
            store,
            ref.path,
            rows=ref.rows,
            checksum=ref.sha256,
            columns=["worker", "batch", "position", "sample_id", "kind"],
        )
        return table.filter(pc.equal(table["kind"].cast(pa.string()), BUFFER))

    def _check_read(
        self, plan: EpochPlan, worker: int, shard: int, row: int, ids: list[int], cid: str
    ) -> None:
        """Every buffered id must be a row the worker has already read."""
        if not ids:
            return
        shards = plan.shards(self.rank, worker)
        files, rows = self.stream.source.locate(np.array(ids, np.int64))
        index = {f: i for i, f in enumerate(shards)}
        for f, r, sid in zip(files.tolist(), rows.tolist(), ids, strict=True):
            k = index.get(f)
            if k is None or k > shard or (k == shard and r >= row):
                raise LogCorrupted(
                    f"commit {cid}: worker {worker}'s buffer holds sample {sid}, which its "
                    "plan has not read yet: the log and the source disagree"
                )
