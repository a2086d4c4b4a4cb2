"""The pipeline of a map-style dataset: seeded order -> batch requests -> fetch.

How a batch flows:

1. ``_Requests`` (the batch sampler, main process) walks the rank's batch plan from the
   state the pipeline began from and yields ``(epoch, epoch_batch, batch, position,
   sample_ids, seed)`` requests (to workers, ``sample_ids`` as the bytes of its ``int64``
   array: they cross torch's index queue pickled); ids come from the seeded epoch order,
   computed a chunk of batches at a time.
2. ``_Fetch.__getitems__`` (in a worker, or the main process) fetches the batch with the
   run's RNG mode (:mod:`ledger.fetch`: seeded once per batch by default), through the
   dataset's ``__getitems__`` when it has one, collates it with the user's
   ``collate_fn`` under the same seeds, and tags it with its request, the worker id and
   its content digest: the compact per-batch delta the main process needs.
3. torch's ``collate_fn`` (``_collated``) passes the tagged batch through.
4. :meth:`MapPipeline.record` (main process, when the loader hands the batch to the
   training loop) checks the batch is the next request, returns its events and
   advances the state. Prefetched batches are not recorded; after a resume they are
   simply produced again.
"""

from __future__ import annotations

import json
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import torch.utils.data as tud

from ledger.commits import Commit, PipelineState
from ledger.digest import digest_bytes
from ledger.errors import ConfigMismatch, LedgerError, SampleError, UnsupportedArgument
from ledger.fetch import Failure, RngMode, batch_getter, load_batch, load_in_loop
from ledger.journal import JournalOrder
from ledger.order import BatchPlan, EpochOrder, batch_seeds
from ledger.pipeline import PHASE_BATCHING, LoaderSettings, in_process, phase_record
from ledger.replay import (
    advance,
    check_final_batch,
    logged_sample_ids,
    replay,
    replay_by_marker,
    resume_elastic,
)
from ledger.schema import ERROR, ORDER_ALGORITHM, ROLLBACK, SAMPLE, SKIP, EventChunk
from ledger.segments import CheckedLater
from ledger.store import Store

_CHUNK_POSITIONS = 1 << 14  # positions whose ids are computed in one vectorised call


class MapDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


@dataclass(slots=True, eq=False)  # not frozen: one per batch, ~1 µs less
class _Request:
    epoch: int
    epoch_batch: int
    batch: int
    position: int
    sample_ids: np.ndarray


class _Fetch(tud.Dataset[Any]):
    """Wraps the user's dataset: loads a batch request with the run's RNG mode (fetch,
    then the user's collate function, under the same seeds), leaving out
    (``on_error="skip"``) the samples whose loading raises, and tags the batch with its
    request, the worker and its content digest (computed in the worker, off the
    training loop). torch's ``collate_fn`` is then :func:`_collated`."""

    def __init__(
        self,
        dataset: MapDataset,
        seed: int,
        rng: RngMode,
        skip_errors: bool,
        collate_fn: Callable[[list[Any]], Any],
        digest: bool,
    ) -> None:
        self.dataset = dataset
        self.seed = seed
        self.rng = rng
        self.skip_errors = skip_errors
        self.collate_fn = collate_fn
        self.digest = digest
        # The common case on the training loop's thread (:meth:`in_loop`): a batch seed,
        # torch's fetch of one sample at a time, a sample that raises stops the batch.
        self._plain = rng == "batch" and batch_getter(dataset) is None and not skip_errors

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(
        self, request: tuple[int, int, int, int, np.ndarray | bytes, int | None]
    ) -> tuple[tuple, Any]:
        epoch, epoch_batch, batch, position, raw, seed = request
        # A worker's request holds the ids' bytes (see _Requests.__iter__).
        ids = np.frombuffer(raw, np.int64) if isinstance(raw, bytes) else raw
        info = tud.get_worker_info()
        samples, failures, data = load_batch(
            self.dataset,
            ids,
            seed=self.seed,
            epoch=epoch,
            position=position,
            rng=self.rng,
            main_process=info is None,
            skip_errors=self.skip_errors,
            collate=self.collate_fn,
            known_seed=seed,
        )
        if failures and not samples:
            first = failures[0]
            raise SampleError(
                f"every sample of batch {batch} (epoch {epoch}, samples {ids.tolist()[:8]}) "
                f"failed to load; the first raised {first.type}: {first.message}. Fix the "
                "dataset, or resume and skip the batch with loader.skip(1, reason=...)"
            )
        digest = digest_bytes(data) if self.digest else None
        worker = info.id if info is not None else -1
        return (epoch, epoch_batch, batch, tuple(failures), worker, digest), data

    def in_loop(
        self, request: tuple[int, int, int, int, np.ndarray, int | None]
    ) -> tuple[tuple, Any]:
        """:meth:`__getitems__` on the training loop's thread (``num_workers=0``,
        :func:`ledger.pipeline.in_process`): the same batch and tag; in the common case
        (``rng="batch"``, no ``__getitems__``, ``on_error="raise"``) through
        :func:`ledger.fetch.load_in_loop`, a few calls fewer per batch."""
        if not self._plain:
            return self.__getitems__(request)
        epoch, epoch_batch, batch, _, ids, seed = request
        assert seed is not None  # the batch sampler computes it when rng != "off"
        data = load_in_loop(self.dataset, ids, self.collate_fn, seed)
        digest = digest_bytes(data) if self.digest else None
        return (epoch, epoch_batch, batch, (), -1, digest), data


def _collated(fetched: tuple[tuple, Any]) -> tuple[tuple, Any]:
    """torch's ``collate_fn``: :meth:`_Fetch.__getitems__` already collated the batch."""
    return fetched


def _without_failures(
    req: _Request, worker: int, digest: bytes | None, failures: tuple[Failure, ...]
) -> list[EventChunk]:
    """A batch's events when some of its samples failed to load: ``sample`` events for
    the others (at their own positions) and one ``error`` event per failure."""
    bad = np.array([f.index for f in failures], np.int64)
    keep = np.ones(req.sample_ids.shape[0], np.bool_)
    keep[bad] = False
    positions = np.arange(req.position, req.position + keep.size, dtype=np.int64)
    return [
        EventChunk(
            SAMPLE, req.epoch, req.batch, worker, int(positions[keep][0]),
            req.sample_ids[keep], positions=positions[keep], digest=digest,
        ),
        EventChunk(
            ERROR, req.epoch, req.batch, worker, int(positions[bad][0]), req.sample_ids[bad],
            positions=positions[bad], values=[f.value() for f in failures],
        ),
    ]  # fmt: skip


class _Requests:
    """Batch sampler: the rest of the epoch of the state the pipeline began from.

    Holds the pipeline weakly: torch's DataLoader (held by the pipeline) holds this
    sampler, so a strong reference would be a cycle that keeps a dropped loader (and its
    persistent workers) alive until a garbage collection.
    """

    def __init__(self, pipeline: MapPipeline) -> None:
        self._pipeline = weakref.ref(pipeline)

    def _get(self) -> MapPipeline:
        pipeline = self._pipeline()
        if pipeline is None:
            raise LedgerError("the ledger.DataLoader of this sampler was garbage-collected")
        return pipeline

    def __len__(self) -> int:
        loader = self._get()
        state = loader.start
        return loader.plan_at(state).batches_per_epoch - state.epoch_batch

    def __iter__(self) -> Iterator[tuple[int, int, int, int, np.ndarray | bytes, int | None]]:
        loader = self._get()
        state = loader.start
        plan = loader.plan_at(state)
        epoch = state.epoch
        order = loader.order(epoch)
        inflight = loader.inflight
        settings = loader.settings
        seeded = settings.rng != "off"  # "sample" seeds a __getitems__ batch by batch too
        # A request for a worker travels pickled through torch's index queue: the ids'
        # bytes pickle and unpickle in ~6 µs, an int64 array in ~25 µs (numpy's reduce),
        # a list of ints (torch's own batch sampler) in ~20 µs.
        as_bytes = settings.num_workers > 0
        ahead = loader.take_ahead(state)
        del loader  # a suspended generator must not keep the loader alive
        end = plan.batches_per_epoch
        k, b = state.epoch_batch, state.batch
        while k < end:
            starts, offsets, lens, positions = _chunk(plan, k)
            if ahead is not None and ahead.shape == positions.shape:
                ids = ahead  # computed by the resume's check, with the same positions
            else:
                ids = order.sample_ids(positions)
            ahead = None
            seeds: list[int | None] = (
                batch_seeds(settings.seed, epoch, starts).tolist()
                if seeded
                else [None] * starts.size
            )
            for start, lo, hi, seed in zip(
                starts.tolist(), offsets.tolist(), (offsets + lens).tolist(), seeds, strict=True
            ):
                req = _Request(epoch, k, b, start, ids[lo:hi])
                inflight.append(req)
                yield (
                    epoch,
                    k,
                    b,
                    start,
                    req.sample_ids.tobytes() if as_bytes else req.sample_ids,
                    seed,
                )
                k += 1
                b += 1


def _chunk(plan: BatchPlan, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The batch sampler's chunk of batches from the epoch's batch ``k``: ``(starts,
    offsets, lens, positions)`` of up to ``_CHUNK_POSITIONS // batch_size`` batches;
    ``positions`` (``int64``) holds theirs end to end, the ``i``-th batch's at
    ``positions[offsets[i] : offsets[i] + lens[i]]``."""
    per_chunk = max(1, _CHUNK_POSITIONS // plan.batch_size)
    k1 = min(k + per_chunk, plan.batches_per_epoch)
    starts, stops = plan.bounds(k, k1)
    lens = stops - starts
    offsets = np.cumsum(lens) - lens
    positions = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - offsets, lens)
    return starts, offsets, lens, positions


class _CheckAhead:
    """The order of a resumed epoch, for the replay's check of the last logged batch
    (:func:`ledger.replay.replay`): while the segment is read and hashed on a background
    thread, :meth:`compute` computes in one vectorised call the ids of the last batch the
    marker's state implies and of the batch sampler's first chunk after it (one pass of
    the cipher's fixed cost instead of two, ~0.3 ms at N = 10**6); :attr:`ids` keeps the
    latter for the first request.

    Args:
        order: the epoch's order.
        last: the positions of the last logged batch, as the marker's state implies.
        ahead: the positions of the batch sampler's first chunk after it.
    """

    def __init__(self, order: EpochOrder, last: np.ndarray, ahead: np.ndarray) -> None:
        self.order = order
        self.last = last
        self.ahead = ahead
        self.ids: np.ndarray | None = None
        self._last_ids: np.ndarray | None = None

    def compute(self) -> None:
        both = self.order.sample_ids(np.concatenate([self.last, self.ahead]))
        self._last_ids = both[: self.last.size]
        self.ids = both[self.last.size :]

    def sample_ids(self, positions: np.ndarray | int) -> np.ndarray:
        asked = np.asarray(positions)
        if self._last_ids is not None and np.array_equal(asked, self.last):
            return self._last_ids
        return self.order.sample_ids(positions)  # the log disagrees with the marker

    def range(self, start: int, stop: int) -> np.ndarray:
        return self.order.range(start, stop)


def dataset_len(dataset: Any) -> int:
    """``len(dataset)``, or an :class:`UnsupportedArgument` saying what ``__len__`` gave
    or raised, chained to it (Python's own error for a negative or non-integer length
    names no dataset)."""
    try:
        return len(dataset)
    except Exception as e:  # TypeError: no __len__; ValueError: negative; or the dataset's
        raise UnsupportedArgument(
            f"len() of the dataset ({type(dataset).__name__}) failed: {e}; a map-style "
            "dataset's __len__ returns its number of samples, an int >= 0"
        ) from e


class MapPipeline:
    """A map-style dataset's pipeline (:class:`ledger.pipeline.Pipeline`).

    The order of an epoch is a seeded bijection of ``[0, len(dataset))``
    (:class:`ledger.order.EpochOrder`); ranks take batches in the fixed pattern of
    :class:`ledger.order.BatchPlan`. The state is where the rank's last consumed batch
    sits in the plan; nothing else needs logging.

    Args:
        dataset: ``__len__`` and ``__getitem__(int)`` (and optionally ``__getitems__``).
        settings: the loader's settings.

    Raises:
        ValueError: if an epoch would hold no batch.
    """

    workers = 0

    def __init__(self, dataset: MapDataset, settings: LoaderSettings) -> None:
        self.dataset = dataset
        self.settings = settings
        n = dataset_len(dataset)
        self.plan = BatchPlan(
            n, settings.batch_size, settings.drop_last, settings.rank, settings.world_size
        )
        if self.plan.batches_per_epoch == 0:
            raise UnsupportedArgument(
                f"an epoch of {n} samples holds no batch of {settings.batch_size} samples on "
                f"{settings.world_size} rank(s) with drop_last={settings.drop_last}"
            )
        self.start = self.initial_state()
        self._started: tuple[str, PipelineState, list[EventChunk]] | None = None  # new_phase
        self.inflight: deque[_Request] = deque()
        self._orders: dict[int, EpochOrder] = {}
        # The first chunk's ids after a resumed state, computed by the replay's check.
        self._ahead: tuple[PipelineState, np.ndarray] | None = None
        # The newest segment whose checksum a resume left running (confirm_replay).
        self._unconfirmed: CheckedLater | None = None
        self._fetch = _Fetch(
            dataset,
            settings.seed,
            settings.rng,
            settings.on_error == "skip",
            settings.collate_fn,
            settings.digest,
        )
        self.torch_loader = tud.DataLoader(
            self._fetch,
            batch_sampler=_Requests(self),  # type: ignore[arg-type]  # yields requests
            num_workers=settings.num_workers,
            collate_fn=_collated,  # type: ignore[arg-type]  # passes the tagged batch on
            persistent_workers=settings.persistent_workers,
            **settings.torch_kwargs,
        )

    def config(self) -> dict[str, Any]:
        s = self.settings
        return {
            "dataset_len": self.plan.n,
            "seed": s.seed,
            "shuffle": s.shuffle,
            "batch_size": s.batch_size,
            "drop_last": s.drop_last,
            "world_size": s.world_size,
            "order": ORDER_ALGORITHM,
            "rng": s.rng,
        }

    def check_logged(self, logged: dict[str, Any]) -> None:
        return None  # the generic configuration check names the field

    def batches_per_epoch(self) -> int:
        return self.plan.batches_per_epoch

    def initial_state(self) -> PipelineState:
        return PipelineState(self.plan.rank, 0, 0, 0)

    def journal_order(self) -> JournalOrder | None:
        return JournalOrder(self.plan.n, self.settings.seed, self.settings.shuffle)

    def plan_at(self, state: PipelineState) -> BatchPlan:
        """This rank's plan for ``state.epoch`` (which may start mid-epoch: elastic resume)."""
        if state.epoch_start == 0:
            return self.plan
        return replace(self.plan, start=state.epoch_start)

    def order(self, epoch: int) -> EpochOrder:
        """The order of ``epoch`` (the latest one is cached)."""
        order = self._orders.get(epoch)
        if order is None:
            order = EpochOrder(self.plan.n, self.settings.seed, epoch, self.settings.shuffle)
            self._orders = {epoch: order}
        return order

    def take_ahead(self, state: PipelineState) -> np.ndarray | None:
        """The ids of the batch sampler's first chunk from ``state`` if the resume's
        check computed them (:class:`_CheckAhead`), once; else ``None``."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != state:
            return None
        return ahead[1]

    def begin(self, state: PipelineState) -> Iterable[tuple[Any, Any]]:
        """Start serving from ``state``.

        Raises:
            ConfigMismatch: if ``len(dataset)`` is no longer the length the run started
                with (``dataset_len``): every epoch's order is a permutation of that
                length, so a dataset that grew or shrank would have samples never served
                or served twice (torch's samplers take ``len()`` anew each epoch).
        """
        n = dataset_len(self.dataset)
        if n != self.plan.n:
            raise ConfigMismatch(
                "dataset_len",
                self.plan.n,
                n,
                "The dataset's length changed during the run: every epoch is a permutation "
                "of the length the run started with. Restore the dataset, or start a new run "
                "under a new log root.",
            )
        self.start = state
        self.inflight.clear()
        if self.settings.num_workers == 0:
            return in_process(self.torch_loader, self._fetch.in_loop)
        return self.torch_loader

    def record(self, state: PipelineState, tag: Any) -> tuple[PipelineState, list[EventChunk]]:
        epoch, _, batch, failures, worker, digest = tag
        req = self.inflight.popleft()
        if req.batch != batch or req.epoch != epoch:
            raise LedgerError(
                f"batch {batch} arrived where batch {req.batch} was expected: "
                "batches must be delivered in order"
            )
        if failures:
            events = _without_failures(req, worker, digest, failures)
        else:
            events = [
                EventChunk(
                    SAMPLE, req.epoch, req.batch, worker, req.position, req.sample_ids,
                    digest=digest, from_order=True,
                )
            ]  # fmt: skip
        plan = self.plan if state.epoch_start == 0 else self.plan_at(state)
        state = advance(state, plan)
        if state.epoch != req.epoch and plan.rank == 0 and plan.consumed_per_epoch < plan.n:
            tail = self.order(req.epoch).range(plan.consumed_per_epoch, plan.n)
            events.append(EventChunk(SKIP, req.epoch, req.batch, -1, plan.consumed_per_epoch, tail))
        return state, events

    def skip(
        self, state: PipelineState, batches: int, reason: str
    ) -> tuple[PipelineState, list[EventChunk]]:
        # Zero I/O: the skipped batches' ids are the order's, nothing is fetched (so a
        # batch whose loading fails can be skipped too).
        value = json.dumps({"reason": reason})
        events: list[EventChunk] = []
        for _ in range(batches):
            plan = self.plan_at(state)
            lo, hi = plan.batch_bounds(state.epoch_batch)
            ids = self.order(state.epoch).range(lo, hi)
            events.append(
                EventChunk(
                    ROLLBACK, state.epoch, state.batch, -1, lo, ids, values=[value] * (hi - lo)
                )
            )
            after = advance(state, plan)
            if after.epoch != state.epoch and plan.rank == 0 and plan.consumed_per_epoch < plan.n:
                tail = self.order(state.epoch).range(plan.consumed_per_epoch, plan.n)
                events.append(
                    EventChunk(SKIP, state.epoch, state.batch, -1, plan.consumed_per_epoch, tail)
                )
            state = after
        return state, events

    def finish(self, state: PipelineState, start_epoch: int) -> None:
        """Check, when torch's iterator ends, that it served the epoch's plan to its end.

        Raises:
            LedgerError: if it ended early: a ``StopIteration`` raised by the dataset in a
                worker reaches the main process as the iterator's end (torch re-raises it
                there), which would end the epoch short without a word and leave every
                later ``iter(loader)`` empty.
        """
        if state.epoch == start_epoch:
            raise LedgerError(
                f"torch's iterator ended after batch {state.epoch_batch} of "
                f"{self.plan.batches_per_epoch} of epoch {state.epoch}: the dataset raised "
                "StopIteration (a worker's StopIteration ends torch's iteration); raise "
                "another exception (IndexError, ValueError) for a sample it cannot load"
            )

    def snapshot(self, state: PipelineState) -> list[EventChunk]:
        return []  # the order is a pure function of (seed, epoch): no buffer

    def enter_phase(self, phase: dict[str, Any] | None) -> None:
        return None  # the batch size is in the settings; the order is the same (new_phase)

    def new_phase(
        self, store: Store, head: Commit, current: dict[str, Any] | None, logged: dict[str, Any]
    ) -> dict[str, Any]:
        """A new phase with another batch size or ``drop_last``: the epoch's order stays;
        the positions the ranks consumed up to ``head`` form a prefix ``[0, P)`` of the
        current epoch, and the new batches cut the order from ``P`` on (as an elastic
        resume does, :func:`ledger.replay.resume_elastic`). Later epochs use the new plan
        from position 0. The phase's ``start`` is the global position ``epoch * len + P``.

        Raises:
            ConfigMismatch: if anything but the batch size or ``drop_last`` changed.
            ResumeMismatch: if the ranks at ``head`` stopped at different steps.
        """
        old = current["config"] if current is not None else logged
        config = self.config()
        phase_record(config, current, logged, PHASE_BATCHING, 0)  # refuses other changes
        state, events = self._phase_start(store, head, old)
        self._started = (head.id, state, events)
        return phase_record(
            config, current, logged, PHASE_BATCHING, state.epoch * self.plan.n + state.epoch_start
        )

    def _phase_start(
        self, store: Store, head: Commit, old: dict[str, Any]
    ) -> tuple[PipelineState, list[EventChunk]]:
        """The state where a new phase after ``head`` starts (``old``: the configuration
        that wrote ``head``)."""
        before = BatchPlan(self.plan.n, int(old["batch_size"]), bool(old["drop_last"]))
        state, skip = resume_elastic(store, head, self.plan, self.order, before=before)
        return state, [skip] if skip is not None else []

    def _phase_started(self, head: Commit) -> tuple[PipelineState, list[EventChunk]] | None:
        """The state :meth:`new_phase` computed, if the resume starts a phase at ``head``."""
        started = self._started
        if started is None or started[0] != head.id:
            return None
        return started[1], started[2]

    def replay(self, store: Store, head: Commit) -> tuple[PipelineState, list[EventChunk]]:
        started = self._phase_started(head)
        if started is not None:
            return started
        if head.world_size != self.plan.world_size:
            state, skip = resume_elastic(store, head, self.plan, self.order)
            return state, [skip] if skip is not None else []
        return self._replay_same_shape(store, head, logged_sample_ids), []

    def _replay_same_shape(
        self, store: Store, head: Commit, ids_of: Callable[[pa.Table], np.ndarray]
    ) -> PipelineState:
        """:func:`ledger.replay.replay` of this rank at ``head`` (same world size)."""
        # The marker's state for this rank is checked against the events by replay; the
        # batches after it are those the first request serves, so their ids are computed
        # with the check's (nothing is kept unless replay confirms that state).
        recorded = head.state(self.plan.rank)
        check = None
        if recorded.epoch_batch > 0 and 0 <= recorded.epoch_start <= self.plan.n:
            plan = self.plan_at(recorded)
            lo, hi = plan.batch_bounds(recorded.epoch_batch - 1)
            if recorded.epoch_batch < plan.batches_per_epoch and 0 <= lo < hi <= plan.n:
                last = np.arange(lo, hi, dtype=np.int64)
                ahead = _chunk(plan, recorded.epoch_batch)[3]
                check = _CheckAhead(self.order(recorded.epoch), last, ahead)

        def order_for(epoch: int) -> Any:
            return check if check is not None and epoch == recorded.epoch else self.order(epoch)

        self._ahead = None
        self._unconfirmed = None
        quick = None
        if check is not None and ids_of is logged_sample_ids:  # a mixture's ids hold sources
            quick = replay_by_marker(
                store, head, self.plan_at(recorded), check, check.last, check.compute
            )
        if quick is not None:
            state, self._unconfirmed = quick
        else:
            state = replay(
                store, head, self.plan, order_for, ids_of=ids_of,
                meanwhile=check.compute if check is not None and check.ids is None else None,
            )  # fmt: skip
            if check is not None and ids_of is logged_sample_ids:
                check_final_batch(head, self.plan.rank)
        if check is not None and check.ids is not None and state == recorded:
            self._ahead = (state, check.ids)
        return state

    def confirm_replay(self) -> None:
        """Wait for the check :func:`ledger.replay.replay_by_marker` left running: the
        newest segment's presence and SHA-256.

        Raises:
            LogCorrupted: if the segment is missing, unreadable or altered.
        """
        segment = self._unconfirmed
        if segment is not None:
            segment.check()
            self._unconfirmed = None
