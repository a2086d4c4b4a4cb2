"""The pipeline of a stream (:class:`ledger.pipeline.Pipeline`): shard plan -> workers ->
shuffle buffer -> packing, with an ids-only replica of each worker in the main process.

The main process never sees data it does not consume: it keeps an ids-only *replica* of
each logical worker (:mod:`ledger.stream.replica`, the same stream computed a chunk at a
time), folds every batch the training loop receives into it, checks that the batch is
what the replica predicts, logs it, and at each commit logs the replicas' buffer
contents as ``buffer`` events; their cursors go into the marker. A resume
(:func:`ledger.replay.replay_stream`) rebuilds each worker from its replica: it re-reads
the rows in its buffer and the document its packer was in the middle of, and nothing
else.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch.utils.data as tud

from ledger.commits import Commit, PipelineState, WorkerState, read_commit
from ledger.errors import ConfigMismatch, LedgerError, UnsupportedArgument
from ledger.journal import JournalOrder
from ledger.order import BatchPlan
from ledger.pipeline import LoaderSettings, in_process, phase_record
from ledger.replay import holds_buffers, newest_of, read_buffers, replay_stream
from ledger.schema import BUFFER, ERROR, ORDER_ALGORITHM, ROLLBACK, SAMPLE, SPAN, EventChunk
from ledger.store import Store
from ledger.stream.plan import (
    CARRY_ALGORITHM,
    CARRY_ALGORITHMS,
    CARRY_ROUND_ROBIN,
    Buffers,
    EpochPlan,
    carry_over,
)
from ledger.stream.replica import Replica, next_worker, replicas
from ledger.stream.spec import Stream
from ledger.stream.worker import BatchMeta, StreamDataset, identity


def _rolled_back(chunk: EventChunk, value: str) -> EventChunk:
    """A consumed batch's ``sample``/``span`` events as ``rollback`` events (no digest)."""
    if chunk.kind not in (SAMPLE, SPAN):
        return chunk
    return EventChunk(
        ROLLBACK, chunk.epoch, chunk.batch, chunk.worker, chunk.position, chunk.sample_ids,
        positions=chunk.positions, token_start=chunk.token_start, token_end=chunk.token_end,
        length=chunk.length, values=[value] * int(chunk.sample_ids.shape[0]),
        sources=chunk.sources, source_names=chunk.source_names,  # a mixture of streams'
        source_epochs=chunk.source_epochs,
    )  # fmt: skip


class StreamPipeline:
    """Runs a :class:`Stream` under torch's DataLoader and keeps its state exact.

    Each rank runs ``max(num_workers, 1)`` logical workers.

    Args:
        stream: the pipeline.
        settings: the loader's settings (``drop_last`` and ``persistent_workers`` must be
            off).

    With ``on_error="skip"`` a sample whose transform raises still passes through its
    worker's shuffle buffer (the id stream does not depend on the data), and is left out
    when the buffer hands it on; the batch takes the next sample instead. The worker
    names the failed samples with the batch (:class:`~ledger.stream.worker.BatchMeta`),
    the replica folds them as taken (so cursors and buffers stay exact), and they are
    logged as ``error`` events at their positions.

    Raises:
        ValueError: for ``drop_last=True`` or ``persistent_workers=True``, or a source
            with no row.
    """

    def __init__(self, stream: Stream, settings: LoaderSettings) -> None:
        if settings.drop_last or settings.persistent_workers:
            raise UnsupportedArgument(
                "a Stream serves every sample (drop_last=False) and needs fresh workers "
                "each epoch (persistent_workers=False)"
            )
        n = stream.source.num_rows
        plan = BatchPlan(n, settings.batch_size, False, settings.rank, settings.world_size)
        if plan.batches_per_epoch == 0:
            raise UnsupportedArgument(
                f"an epoch of the stream holds no batch: its source has {n} rows"
            )
        self.dataset = stream
        self.stream = stream
        self.settings = settings
        self.seed = settings.seed
        self.rank = settings.rank
        self.world_size = settings.world_size
        self.workers = max(settings.num_workers, 1)
        self.store = settings.store
        stream.source.record_digests(self.store)  # changed rows are caught where they are read
        self.torch_dataset = StreamDataset(
            stream,
            settings.seed,
            settings.shuffle,
            settings.rank,
            settings.world_size,
            self.workers,
            settings.batch_size,
            settings.collate_fn,
            settings.rng == "sample",
            settings.digest,
            settings.on_error == "skip",
        )
        self.torch_loader = tud.DataLoader(
            self.torch_dataset,
            batch_size=None,
            num_workers=settings.num_workers,
            collate_fn=identity,
            **settings.torch_kwargs,
        )
        self.buffers: dict[int, list[int]] = {}  # at the state the replicas started from
        self.replicas: list[Replica] = []
        self._states: list[WorkerState] = []
        self._plans: dict[tuple[int, str, int, int, bool], EpochPlan] = {}
        self._carries: dict[tuple[str, int, int, range | None], dict[int, Any] | None] = {}
        self.dealing = CARRY_ALGORITHM  # of a new run; a resume takes the log's
        self.newest: dict[str, list[Any]] = {}  # the newest segments of a head, by rank
        self._old: tuple[Commit, list[PipelineState]] | None = None  # see old_shape

    def initial_state(self) -> PipelineState:
        self.forget_shapes()
        self.reset({})
        return self.epoch_start(0, 0, "")

    def forget_shapes(self) -> None:
        """Drop the plans, carries and old heads computed for an earlier resume: commit ids
        name commits within one run, and the root may hold another run by now."""
        self._plans.clear()
        self._carries.clear()
        self._old = None
        self.newest = {}

    def config(self) -> dict[str, Any]:
        s = self.settings
        return {
            "dataset_len": self.stream.source.num_rows,
            "seed": s.seed,
            "shuffle": s.shuffle,
            "batch_size": s.batch_size,
            "drop_last": s.drop_last,
            "world_size": s.world_size,
            "order": ORDER_ALGORITHM,
            "rng": s.rng,
            **self.stream.config(),
            "workers": self.workers,
            "carry": CARRY_ALGORITHM,
        }

    def check_logged(self, logged: dict[str, Any]) -> None:
        """Check the source against the log's, and take the log's carry dealing (a run
        keeps the one it began with; logs written before ``carry`` was recorded deal
        round robin).

        Raises:
            ConfigMismatch: for a changed source, or a dealing this ledger does not know.
        """
        self.stream.source.check(logged.get("source", []))
        dealing = logged.get("carry", CARRY_ROUND_ROBIN)
        if dealing not in CARRY_ALGORITHMS:
            raise ConfigMismatch(
                "carry", dealing, CARRY_ALGORITHM,
                f"The log deals a change of shape by {dealing!r}, which this version of "
                f"ledger does not know (it knows {', '.join(CARRY_ALGORITHMS)}): resume "
                "it with the version that wrote it.",
            )  # fmt: skip
        self.dealing = dealing

    def batches_per_epoch(self) -> int:
        raise TypeError("a stream's batches per epoch are not known in advance")

    def plan(
        self, epoch: int, origin: str, world_size: int | None = None, workers: int | None = None
    ) -> EpochPlan:
        """The plan of ``epoch`` for a shape that began at ``origin`` (``""``: the run's
        start; else the commit it resumed from): this loader's, whose carried pieces it
        holds for this rank's workers only, or (``world_size`` and ``workers`` given) an
        earlier shape's, with every worker's."""
        own = world_size is None and workers is None
        world_size = world_size or self.world_size
        workers = workers or self.workers
        key = (epoch, origin, world_size, workers, own)
        plan = self._plans.get(key)
        if plan is None:
            wanted = range(self.rank * workers, (self.rank + 1) * workers) if own else None
            carry = self._carry(origin, epoch, world_size * workers, wanted) if origin else None
            plan = self.torch_dataset.plan(epoch, carry, world_size, workers)
            if len(self._plans) > 16:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _carry(
        self, origin: str, epoch: int, total: int, wanted: range | None
    ) -> dict[int, Any] | None:
        """What the shape before ``origin`` left of ``epoch``, dealt to ``total`` workers
        (:func:`~ledger.stream.plan.carry_over`), the shares of ``wanted`` (``None``: all)."""
        key = (origin, epoch, total, wanted)
        if key not in self._carries:
            head, states = self.old_shape(origin)
            old = self.plan(epoch, states[0].origin, head.world_size, len(states[0].workers))
            # An epoch is carried if an old rank was in it or had yet to reach it while the
            # old shape itself served it from a carry (two reshapes in one epoch).
            carried = epoch <= max(s.epoch for s in states) or old.carry is not None
            if epoch < min(s.epoch for s in states) or not carried:
                self._carries[key] = None
            else:
                self._carries[key] = carry_over(
                    old,
                    [(s.rank, s) for s in states],
                    lambda ranks: self._old_buffers(head, [states[r] for r in ranks]),
                    total,
                    self.dealing,
                    wanted,
                    self.stream.shuffle_buffer > 0,
                )
        return self._carries[key]

    def old_shape(
        self, origin: str, head: Commit | None = None
    ) -> tuple[Commit, list[PipelineState]]:
        """The commit ``origin`` (``head``, when the caller has read it) and its ranks'
        states by rank, read and decoded once (a change of shape needs every old rank's
        state, ~40 µs each to decode from the rank table)."""
        if self._old is None or self._old[0].id != origin:
            head = head if head is not None else read_commit(self.store, origin)
            self._old = (head, sorted(head.states, key=lambda s: s.rank))
        return self._old

    def _old_buffers(self, head: Commit, states: list[PipelineState]) -> Buffers:
        """Buffers of old ranks at ``head``: ``(rank, worker) -> ids`` in slot order (on an
        object store, the ranks' newest segments fetched a chunk at once)."""
        holding = [s for s in states if holds_buffers(s)]
        refs = newest_of(self, head) if holding else []
        buffers: Buffers = {}
        for chunk, fetched in self.store.read_ahead_chunks(
            holding, lambda s: ref.path if (ref := refs[s.rank]) else None
        ):
            for s in chunk:
                for w, ids in read_buffers(self, head, s, fetched).items():
                    buffers[s.rank, w] = ids
        return buffers

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

    def begin(self, state: PipelineState) -> Iterable[tuple[Any, Any]]:
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
        self.torch_dataset.start = state
        self.torch_dataset.buffers = self.buffers
        self.torch_dataset.epoch_plan = plan
        if self.torch_loader.num_workers == 0:  # torch's iterator, without its per-batch wrapper
            return in_process(self.torch_loader)
        return self.torch_loader

    def record(
        self, state: PipelineState, meta: BatchMeta
    ) -> tuple[PipelineState, list[EventChunk]]:
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
        worker = meta.worker
        replica = self.replicas[worker]
        placed = replica.fold(meta)
        spans = meta.spans
        # Positional arguments: keywords cost ~0.8 µs more per batch.
        if spans is None:
            chunk = EventChunk(
                SAMPLE, state.epoch, state.batch, worker, 0, meta.sample_ids,
                placed, None, None, None, meta.draws, meta.digest,
            )  # fmt: skip
        else:
            chunk = EventChunk(
                SPAN, state.epoch, state.batch, worker, 0, meta.sample_ids,
                placed, spans[:, 0], spans[:, 1], spans[:, 2], meta.draws, meta.digest,
            )  # fmt: skip
        events = [chunk]
        if meta.failures:
            failed = np.array([sid for sid, _, _ in meta.failures], np.int64)
            events.append(
                EventChunk(
                    ERROR, state.epoch, state.batch, worker, 0, failed,
                    positions=self.plan(state.epoch, state.origin).positions(failed),
                    values=[value for _, _, value in meta.failures],
                )
            )  # fmt: skip
        after = next_worker(self.replicas, worker)
        if after < 0:  # every logical worker of the rank finished: the epoch is over
            self.reset({})
            nxt = self.epoch_start(state.epoch + 1, state.batch + 1, state.origin)
        else:
            # Only the folded worker moved: the others' states are reused.
            self._states[worker] = replica.state()
            nxt = PipelineState(
                self.rank,
                state.epoch,
                state.epoch_batch + 1,
                state.batch + 1,
                tuple(self._states),
                after,
                0,
                state.origin,
            )
        return nxt, events

    def skip(
        self, state: PipelineState, batches: int, reason: str
    ) -> tuple[PipelineState, list[EventChunk]]:
        """Skip the next ``batches`` batches: produce them (a stream's next batches depend
        on its buffers and packing, known only by running them: no zero-I/O skip here)
        and log them as ``rollback`` events instead of consumed ones; the state folds
        them as if consumed, so buffers and cursors move past them."""
        value = json.dumps({"reason": reason})
        events: list[EventChunk] = []
        left = batches
        while left:
            start_epoch = state.epoch
            iterator = iter(self.begin(state))
            try:
                for meta, _ in iterator:
                    state, chunks = self.record(state, meta)
                    events.extend(_rolled_back(c, value) for c in chunks)
                    left -= 1
                    if left == 0:
                        break
                else:
                    self.finish(state, start_epoch)
            finally:
                shutdown = getattr(iterator, "_shutdown_workers", None)
                if shutdown is not None:  # its workers prefetched batches no one will take
                    shutdown()
        return state, events

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

    def journal_order(self) -> JournalOrder | None:
        return None  # a stream's ids come from its shuffle buffers: the journal records them

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

    def enter_phase(self, phase: dict[str, Any] | None) -> None:
        return None  # the batch size is in the settings; nothing else changes (new_phase)

    def new_phase(
        self, store: Store, head: Commit, current: dict[str, Any] | None, logged: dict[str, Any]
    ) -> dict[str, Any]:
        """A new phase with another batch size: each logical worker continues its own
        stream (cursor, shuffle buffer, packer) where it stood, and cuts it into batches
        of the new size. The batch size does not enter a worker's stream, so the state
        replays as in a resume without a phase.

        Raises:
            ConfigMismatch: if anything but the batch size changed.
        """
        return phase_record(self.config(), current, logged, ("batch_size",), 0)

    def confirm_replay(self) -> None:
        """Nothing is left running: :meth:`replay` checked everything it read."""

    def replay(self, store: Store, head: Commit) -> tuple[PipelineState, list[EventChunk]]:
        """See :func:`ledger.replay.replay_stream`."""
        return replay_stream(self, store, head), []
