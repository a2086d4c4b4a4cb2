"""Fold a lineage's events into pipeline state, and verify that resuming continues it.

Replay of every pipeline lives here: map-style datasets (:func:`replay`, and
:func:`resume_elastic` for another world size) and streams (:func:`replay_stream`).

For a map-style dataset the order is a pure function of ``(seed, epoch)``, so the state
of a rank is where its last consumed batch sits in the plan. Replay reads it from the
events (the newest segment of the rank in the lineage), not from the configuration, then
checks two things before the loader may produce a batch:

1. the folded state equals the state the commit marker recorded (the log agrees with
   itself), and
2. the current order reproduces the sample ids of the last logged batch, so the next
   batch continues the log with no gap and no overlap (the loader's order is the log's).

A marker of rank-table layout 2 (:mod:`ledger.ranks`) records a fingerprint of each
rank's final batch (epoch, batch index, positions and sample ids), so the second check
needs no decoding: :func:`replay_by_marker` compares the fingerprint of the batch the
marker's state and the resuming loader's order imply with the recorded one, while the
segment's SHA-256 is checked on a background thread (the caller confirms it before any
batch reaches the training loop). A disagreement, or an older marker, falls back to
:func:`replay`, which decodes the segment's final batch and names what differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ledger import segments
from ledger.commits import (
    Commit,
    PipelineState,
    SegmentRef,
    WorkerState,
    newest_segment,
    newest_segments,
)
from ledger.errors import LogCorrupted, ResumeMismatch
from ledger.order import BatchPlan
from ledger.ranks import final_batch_fingerprint
from ledger.schema import BUFFER, ERROR, ROLLBACK, SAMPLE, SKIP, EventChunk
from ledger.store import Fetched, Store

if TYPE_CHECKING:
    from ledger.stream.pipeline import StreamPipeline
    from ledger.stream.shuffle import Piece


class Order(Protocol):
    """An epoch's order: :class:`ledger.order.EpochOrder`, or a mixture's."""

    def sample_ids(self, positions: np.ndarray | int) -> np.ndarray: ...
    def range(self, start: int, stop: int) -> np.ndarray: ...


def logged_sample_ids(rows: pa.Table) -> np.ndarray:
    """The ``sample_id`` column of logged events (``int64``): the ids a map-style order gives."""
    return _numpy(rows["sample_id"])


def _strings(column: pa.ChunkedArray) -> np.ndarray:
    """A (dictionary-encoded) string column as a numpy array of ``str`` objects."""
    if pa.types.is_dictionary(column.type):
        parts = [
            np.asarray(chunk.dictionary.to_pylist(), dtype=object)[
                chunk.indices.to_numpy(zero_copy_only=False)
            ]
            for chunk in column.chunks
        ]
        return np.concatenate(parts) if parts else np.empty(0, dtype=object)
    return np.asarray(column.to_pylist(), dtype=object)


def _last_batch(segment: segments.CheckedLater, ref: SegmentRef) -> pa.Table:
    """The positions the last batch of a segment took, reading only its tail: its
    ``sample`` events and its ``error`` events (samples left out, ``on_error="skip"``),
    or the ``rollback`` events of a batch skipped on purpose; by position.

    Batch indexes never decrease within a segment, so row groups are read from the end
    while they may hold the last batch: the ``batch`` column's statistics (in the footer)
    say which without decoding, and writers put the final batch in a row group of its
    own (:func:`ledger.segments.encode`), so a resume decodes a few hundred rows. Without
    statistics, groups are decoded from the end until one starts with an earlier batch.

    The segment's SHA-256 is being checked on a background thread: the caller must call
    ``segment.confirm()`` before trusting the rows, and also when this raises, so that an
    altered file is named as such, whatever reading it raised.
    """
    return _tail_rows(segment.file(), ref)


def _tail_rows(pf: pq.ParquetFile, ref: SegmentRef) -> pa.Table:
    columns = ["epoch", "batch", "position", "sample_id", "kind"]
    names = pf.metadata.schema.names  # Parquet's: the Arrow schema costs ~25 us to build
    batch_column = names.index("batch") if "batch" in names else -1
    if "source" in names:  # a mixture's events name their source
        columns.append("source")
    groups: list[pa.Table] = []
    last = None
    for i in reversed(range(pf.num_row_groups)):
        meta = pf.metadata.row_group(i)
        if meta.num_rows == 0:
            continue
        stats = meta.column(batch_column).statistics if batch_column >= 0 else None
        if last is not None and stats is not None and stats.has_min_max and stats.max < last:
            break  # the whole group precedes the last batch
        # One thread: a few hundred rows, and a thread pool's wake-ups cost more.
        group = pf.read_row_group(i, columns=columns, use_threads=False)
        groups.insert(0, group)
        batches = _numpy(group["batch"])
        last = int(batches[-1]) if last is None else last
        if batches[0] < last:
            break
    if last is None:
        raise LogCorrupted(f"segment {ref.path} holds no events")
    # numpy rather than Arrow compute kernels: a few hundred rows, where each kernel
    # call's dispatch costs more than the work; the table is cut once, by row numbers.
    table = pa.concat_tables(groups) if len(groups) > 1 else groups[0]
    first = int(np.searchsorted(_numpy(table["batch"]), last, side="left"))  # never decrease
    rows = first + np.flatnonzero(_kind_in(table["kind"], (SAMPLE, ERROR, ROLLBACK))[first:])
    if rows.size == 0:
        raise LogCorrupted(f"segment {ref.path} ends with batch {last} but holds no sample of it")
    positions = _numpy(table["position"])[rows]
    if rows.size > 1 and not (positions[1:] >= positions[:-1]).all():
        rows = rows[np.argsort(positions, kind="stable")]
    elif int(rows[-1]) - int(rows[0]) + 1 == rows.size:  # one run of rows: no copy
        return table.slice(int(rows[0]), rows.size)
    return table.take(pa.array(rows))


def _numpy(column: pa.ChunkedArray) -> np.ndarray:
    """A non-null numeric column as numpy (one chunk: its buffer, ~20 us less than the
    ChunkedArray's conversion)."""
    if column.num_chunks == 1:
        return column.chunk(0).to_numpy()
    return column.to_numpy()


def _kind_in(column: pa.ChunkedArray, kinds: tuple[str, ...]) -> np.ndarray:
    """Whether each row's kind is one of ``kinds``, as a ``bool`` array: on the
    dictionary's codes (an object array of strings costs ~10x more to compare)."""
    if not pa.types.is_dictionary(column.type):
        return np.isin(_strings(column), kinds)
    parts = []
    for chunk in column.chunks:  # a dictionary holds a few kinds: a list beats np.isin
        wanted = np.array([kind in kinds for kind in chunk.dictionary.to_pylist()], np.bool_)
        parts.append(wanted[chunk.indices.to_numpy()])
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, np.bool_)


def advance(state: PipelineState, plan: BatchPlan) -> PipelineState:
    """The state after one more batch; an epoch's last batch moves to the next epoch.

    Args:
        state: the state before the batch.
        plan: the rank's plan for ``state.epoch`` (``plan.start == state.epoch_start``).
    """
    nxt = state.epoch_batch + 1
    if nxt >= plan.batches_per_epoch:
        return PipelineState(state.rank, state.epoch + 1, 0, state.batch + 1)
    # The constructor, not dataclasses.replace: this runs once per batch (~3 µs less).
    return PipelineState(
        state.rank,
        state.epoch,
        nxt,
        state.batch + 1,
        state.workers,
        state.next_worker,
        state.epoch_start,
        state.origin,
    )


def replay_by_marker(
    store: Store,
    head: Commit,
    plan: BatchPlan,
    order: Order,
    last: np.ndarray,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[PipelineState, segments.CheckedLater] | None:
    """Rank ``plan.rank``'s state at ``head`` checked against the marker's fingerprint of
    its final batch, without decoding the segment (map-style, same world size).

    The marker's state puts the rank's last batch at ``last`` in its epoch; the state is
    accepted when it is what one more batch after that gives (:func:`advance`) and the
    fingerprint of ``(epoch, batch index, last, order's ids at last)``
    (:func:`ledger.ranks.final_batch_fingerprint`) equals the one the marker recorded
    from the segment's events at the commit.

    Args:
        store: the log root.
        head: the commit to resume from.
        plan: the rank's plan for the state's epoch (``start`` at its ``epoch_start``).
        order: the resuming loader's order of that epoch.
        last: ``int64 (rows,)``: the positions of the last batch the state implies.
        meanwhile: work to do while the segment is read and hashed in the background,
            before ``order`` is asked for ids (the map-style pipeline computes the ids of
            the first request after the state with them).

    Returns:
        The state and the segment, whose SHA-256 (and presence) is still being checked:
        the caller must call its :meth:`~ledger.segments.CheckedLater.check` before any
        batch reaches the training loop. ``None`` when the marker records no
        fingerprint, or when anything disagrees: then :func:`replay` decodes the segment
        and names what differs (and :func:`check_final_batch` refuses a marker whose
        fingerprint alone is wrong).
    """
    rank = plan.rank
    final = head.ranks.final_batch(rank) if head.ranks is not None else None
    if final is None:
        return None
    ref = head.ranks.newest(rank) if head.ranks is not None else None
    if ref is None:
        return None
    segment = segments.CheckedLater(store, ref.path, rows=ref.rows, checksum=ref.sha256, keep=False)
    if meanwhile is not None:
        meanwhile()
    recorded = head.state(rank)
    before = PipelineState(
        rank, recorded.epoch, recorded.epoch_batch - 1, recorded.batch - 1,
        epoch_start=recorded.epoch_start,
    )  # fmt: skip
    if recorded.epoch_batch < 1:
        return None
    state = _fingerprinted(head, plan, before, last, lambda: order.sample_ids(last), final)
    return None if state is None else (state, segment)


def _fingerprinted(
    head: Commit,
    plan: BatchPlan,
    before: PipelineState,
    last: np.ndarray,
    ids: Callable[[], np.ndarray],
    final: int,
) -> PipelineState | None:
    """The marker's state of rank ``plan.rank`` when one more batch after ``before``
    gives it (``plan``: the rank's plan for ``before.epoch``) and ``final``, the marker's
    fingerprint of that rank's final batch, is the one of that batch: ``last``, its
    positions, and ``ids()``, the order's ids there; else ``None``."""
    recorded = head.state(plan.rank)
    if advance(before, plan) != recorded:
        return None
    found = final_batch_fingerprint(before.epoch, before.batch, last, ids())
    return recorded if found == final else None


def _ids_at(
    order_for: Callable[[int], Order], wanted: dict[int, tuple[int, np.ndarray]]
) -> dict[int, np.ndarray]:
    """The order's ids at each of ``wanted`` (``key -> (epoch, positions)``), by one
    vectorised call per epoch (~0.6 ms a call whatever its size: per old rank, 10^4
    ranks would cost seconds)."""
    out: dict[int, np.ndarray] = {}
    for epoch in sorted({e for e, _ in wanted.values()}):
        keys = [k for k, (e, _) in wanted.items() if e == epoch]
        parts = [wanted[k][1] for k in keys]
        found = order_for(epoch).sample_ids(np.concatenate(parts))
        out.update(zip(keys, np.split(found, np.cumsum([len(p) for p in parts])[:-1]), strict=True))
    return out


_Before = tuple[BatchPlan, PipelineState, np.ndarray, bool]
"""The plan of the final batch's epoch, the state before that batch, its positions, and
whether that epoch's start is a guess (see :func:`_final_batch`)."""


def _final_batch(plan: BatchPlan, state: PipelineState) -> _Before | None:
    """Where the final batch that ``state`` implies lies: inside ``state.epoch`` (its
    ``epoch_batch - 1``), or for a state at an epoch's start, the last batch of the epoch
    before, guessed to have begun at position 0 (an elastic resume inside that epoch
    would have moved it: then the fingerprint disagrees and the segment is decoded).
    ``None`` for a state outside the plan or at the run's start: decoded."""
    if not 0 <= state.epoch_start <= plan.n:
        return None
    guess = state.epoch_batch == 0
    if guess:
        if state.epoch < 1 or state.batch < 1:
            return None
        plan = replace(plan, start=0)
        k = plan.batches_per_epoch - 1
        epoch = state.epoch - 1
        start = 0
    else:
        plan = replace(plan, start=state.epoch_start)
        k = state.epoch_batch - 1
        epoch = state.epoch
        start = state.epoch_start
        if state.epoch_batch >= plan.batches_per_epoch:
            return None
    if k < 0:
        return None
    lo, hi = plan.batch_bounds(k)
    if not 0 <= lo < hi <= plan.n:
        return None
    before = PipelineState(state.rank, epoch, k, state.batch - 1, epoch_start=start)
    return plan, before, np.arange(lo, hi, dtype=np.int64), guess


def check_final_batch(head: Commit, rank: int) -> None:
    """Refuse a marker whose final-batch fingerprint disagrees with its segment, called
    when :func:`replay_by_marker` declined and :func:`replay` then found the segment's
    final batch continuing the log exactly.

    Raises:
        LogCorrupted: if the marker records a fingerprint for ``rank``.
    """
    if head.ranks is not None and head.ranks.final_batch(rank) is not None:
        raise LogCorrupted(
            f"commit {head.id} records a fingerprint of rank {rank}'s final batch that "
            "its segment's events do not have: the marker and its segments disagree"
        )


def replay(
    store: Store,
    head: Commit,
    plan: BatchPlan,
    order_for: Callable[[int], Order],
    ref: SegmentRef | bool | None = True,
    ids_of: Callable[[pa.Table], np.ndarray] = logged_sample_ids,
    meanwhile: Callable[[], None] | None = None,
) -> PipelineState:
    """Rebuild rank ``plan.rank``'s pipeline state at ``head`` from the log's events.

    Reads the head marker (already in ``head``) and the tail of one segment: the rank's
    newest, which a version-2 marker names; a version-1 head's lineage is walked back
    to find it.

    Args:
        store: the log root.
        head: the commit to resume from.
        plan: the resuming loader's batch plan (dataset length, batch size, rank).
        order_for: ``epoch -> EpochOrder`` of the resuming loader.
        ref: the rank's newest segment if the caller looked it up already (``None``:
            the rank has none); ``True``: look it up here.
        ids_of: the ids the order gives, of logged events (default: their
            ``sample_id``; a mixture's join ``source`` and ``sample_id``).
        meanwhile: work to do while the segment is read and hashed on a background
            thread (the map-style pipeline computes the ids it expects there).

    Returns:
        The state of the rank after the last event of the lineage.

    Raises:
        LogCorrupted: if a segment is missing or altered, or the events disagree with
            the marker's recorded state.
        ResumeMismatch: if the resuming loader's order or plan would not reproduce the
            last logged batch (a changed seed, dataset, shuffle or batch size).
    """
    rank = plan.rank
    recorded = head.state(rank)
    if isinstance(ref, bool):
        ref = newest_segment(store, head, rank)
    if ref is None:
        folded = PipelineState(rank, 0, 0, 0)
        if folded != recorded:
            raise LogCorrupted(
                f"commit {head.id} records state {recorded} for rank {rank}, but its lineage "
                "holds no events of that rank"
            )
        return folded

    segment = segments.CheckedLater(store, ref.path, rows=ref.rows, checksum=ref.sha256)
    try:
        if meanwhile is not None:
            meanwhile()
        rows = _last_batch(segment, ref)
        folded = _fold_last_batch(head, plan, order_for, ids_of, rows)
    except Exception:
        segment.confirm()  # an altered segment is named as such, not as a mismatch
        raise
    segment.confirm()
    return folded


def _fold_last_batch(
    head: Commit,
    plan: BatchPlan,
    order_for: Callable[[int], Order],
    ids_of: Callable[[pa.Table], np.ndarray],
    rows: pa.Table,
) -> PipelineState:
    """The rank's state after the last batch ``rows`` of its newest segment, checked
    against the marker's record and the resuming loader's order and plan (see
    :func:`replay`)."""
    rank = plan.rank
    recorded = head.state(rank)
    epoch = int(_numpy(rows["epoch"])[0])
    positions = _numpy(rows["position"])
    ids = ids_of(rows)

    last = int(_numpy(rows["batch"])[0])
    if recorded.epoch == epoch:
        plan = replace(plan, start=recorded.epoch_start)
        k = (int(positions[0]) - plan.start) // plan.step_size
        bounds = plan.batch_bounds(k)
        if bounds != (int(positions[0]), int(positions[-1]) + 1) or not np.array_equal(
            positions, np.arange(bounds[0], bounds[1])
        ):
            raise ResumeMismatch(
                f"the log's last batch (batch {last}, epoch {epoch}) covers positions "
                f"[{int(positions[0])}, {int(positions[-1]) + 1}), but this loader's plan "
                f"puts batch {k} of the epoch at [{bounds[0]}, {bounds[1]}): batch size, "
                "world size or dataset length changed. Resume with the run's original "
                "configuration."
            )
        folded = advance(PipelineState(rank, epoch, k, last, epoch_start=plan.start), plan)
    else:  # the last batch closed its epoch
        folded = PipelineState(rank, epoch + 1, 0, last + 1)
    if folded != recorded:
        raise LogCorrupted(
            f"commit {head.id} records state {recorded} for rank {rank}, but its events "
            f"fold to {folded}: the marker and its segments disagree"
        )
    expected = order_for(epoch).sample_ids(positions)
    if not np.array_equal(expected, ids):
        first = int(np.flatnonzero(expected != ids)[0])
        raise ResumeMismatch(
            f"the log's last batch (batch {int(last)}, epoch {epoch}) has sample id "
            f"{int(ids[first])} at position {int(positions[first])}, but this loader's order "
            f"puts sample {int(expected[first])} there: the seed, shuffle or dataset differs "
            "from the run's. Resume with the run's original seed, shuffle and dataset."
        )
    return folded


def resume_elastic(
    store: Store,
    head: Commit,
    plan: BatchPlan,
    order_for: Callable[[int], Order],
    ids_of: Callable[[pa.Table], np.ndarray] = logged_sample_ids,
    before: BatchPlan | None = None,
) -> tuple[PipelineState, EventChunk | None]:
    """State of one rank of a new world size resuming ``head`` (map-style datasets).

    Each old rank's state is replayed and verified as for a same-shape resume: the head
    marker is read once, and the tail of old rank ``r``'s newest segment by the new rank
    ``r % W_new``, which decodes it, checks its SHA-256 and refuses the resume if it is
    missing or altered (every old rank's newest segment is checked by one new rank).
    The new rank takes every other old rank's state from the marker when the marker's
    fingerprint of that rank's final batch (rank-table layout 2) equals the one of the
    batch its state implies, by this loader's order (as :func:`replay_by_marker` does;
    for a state at an epoch's start, see :func:`_final_batch`); otherwise, and for a
    table of layout 1, it decodes that segment too. So a new rank
    reads about ``W_old / W_new`` segments (before: all ``W_old``, ``W_old * W_new`` reads
    for the job), and the cost is O(W_old) per new rank in CPU, independent of the
    history's length. With
    synchronous data parallelism the positions the old ranks consumed in the current
    epoch form a prefix ``[epoch_start, P)`` of its order; the new ranks continue the
    epoch from ``P`` with the new step size. Every sample of the epoch is thus consumed
    exactly once across the old and the new shape; the order after ``P`` is the plan of
    :class:`ledger.order.BatchPlan` for the new shape.

    Args:
        store: the log root.
        head: the commit to resume from (written with another world size).
        plan: the new rank's full-epoch plan (its ``rank`` and ``world_size``).
        order_for: ``epoch -> EpochOrder``.
        ids_of: as for :func:`replay`.
        before: the plan of the configuration that wrote ``head`` when it differs from
            ``plan``'s in batch size or ``drop_last`` (a new phase); its rank and world
            size are ignored. ``None``: ``plan``'s.

    Returns:
        The rank's state, and the ``skip`` events to log when ``drop_last`` leaves too
        few samples after ``P`` for one step of the new shape (rank 0 only), else ``None``.

    Raises:
        ResumeMismatch: if the old ranks' consumed positions are not a prefix (they
            stopped at different steps), which no world size other than the old one can
            continue exactly.
    """
    old = head.world_size
    before = before if before is not None else plan
    refs = newest_segments(store, head, old)  # the head marker, read once
    # Old rank r's segment is read and checked by new rank r % W_new; the others take its
    # state from the marker when its fingerprint agrees with the order.
    plans = [replace(before, rank=r, world_size=old, start=0) for r in range(old)]
    marked: dict[int, tuple[_Before, int]] = {}
    mixture = ids_of is not logged_sample_ids  # its ids hold their sources
    for r in range(old if not mixture else 0):
        final = head.ranks.final_batch(r) if head.ranks is not None else None
        at = _final_batch(plans[r], head.state(r))
        if r % plan.world_size != plan.rank and final is not None and at:
            marked[r] = (at, final)
    ids = _ids_at(order_for, {r: (m[0][1].epoch, m[0][2]) for r, m in marked.items()})
    folded = []
    for r in range(old):
        if r not in marked:
            folded.append(replay(store, head, plans[r], order_for, refs[r], ids_of))
            continue
        (at_plan, at_state, last, guess), final = marked[r]
        found = functools.partial(ids.__getitem__, r)
        state = _fingerprinted(head, at_plan, at_state, last, found, final)
        if state is None:  # decoded: names what differs, or the fingerprint is wrong
            state = replay(store, head, plans[r], order_for, refs[r], ids_of)
            if not guess:  # (a guessed epoch start may just be wrong)
                check_final_batch(head, r)
        folded.append(state)
    epoch = min(s.epoch for s in folded)
    start = next(s.epoch_start for s in folded if s.epoch == epoch)
    starts: list[np.ndarray] = []
    stops: list[np.ndarray] = []
    for r, s in enumerate(folded):
        old_plan = replace(before, rank=r, world_size=old, start=start)
        count = old_plan.batches_per_epoch if s.epoch > epoch else s.epoch_batch
        lo, hi = old_plan.bounds(0, count)
        starts.append(lo)
        stops.append(hi)
    lo = np.concatenate(starts)
    hi = np.concatenate(stops)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = start
    if lo.size:
        gaps = lo != np.concatenate([[start], hi[:-1]])
        if gaps.any():
            where = int(np.flatnonzero(gaps)[0])
            raise ResumeMismatch(
                f"at commit {head.id} the {old} ranks stopped at different steps of epoch "
                f"{epoch} ({', '.join(f'rank {r}: {s.epoch_batch}' for r, s in enumerate(folded))}"
                f" batches): position {int(hi[where - 1]) if where else start} was not "
                f"consumed while position {int(lo[where])} was, so another world size "
                f"cannot continue the epoch exactly. Resume with world_size={old}."
            )
        reach = int(hi[-1])
    batch = folded[0].batch
    new = replace(plan, start=reach)
    if new.batches_per_epoch:
        return PipelineState(plan.rank, epoch, 0, batch, epoch_start=reach), None
    # drop_last and fewer than one step of the new shape left: the tail is skipped.
    skip = None
    if plan.rank == 0 and reach < plan.n:
        tail = order_for(epoch).range(reach, plan.n)
        skip = EventChunk(SKIP, epoch, batch - 1, -1, reach, tail)
    return PipelineState(plan.rank, epoch + 1, 0, batch), skip


def replay_stream(pipeline: StreamPipeline, store: Store, head: Commit) -> PipelineState:
    """Rebuild the rank's state and buffers at ``head`` from the log, and check them.

    With the world size and worker count of ``head``, the rank continues exactly
    where it stood. With another shape, every rank starts over in the oldest epoch
    an old rank had not finished, serving what the old shape left
    (:func:`~ledger.stream.plan.carry_over`): every sample and every token of each
    epoch is then consumed exactly once across the shapes, in an order that is a
    function of the new shape.

    Raises:
        LogCorrupted: if the buffer snapshot is missing or disagrees with the cursors.
    """
    pipeline.store = store
    pipeline.forget_shapes()
    states = head.states
    if head.world_size != pipeline.world_size or len(states[0].workers) != pipeline.workers:
        pipeline.reset({})
        _, old = pipeline.old_shape(head.id, head)  # decoded once, for the carry too
        return pipeline.epoch_start(min(s.epoch for s in old), old[0].batch, head.id)
    state = head.state(pipeline.rank)
    buffers = read_buffers(pipeline, head, state)
    plan = pipeline.plan(state.epoch, state.origin)
    for w in state.workers:
        ids = buffers.get(w.worker, [])
        expected = w.rows_read - w.emitted if pipeline.stream.shuffle_buffer else 0
        if len(ids) != expected:
            raise LogCorrupted(
                f"commit {head.id}: worker {w.worker} read {w.rows_read} rows and handed on "
                f"{w.emitted}, so its buffer holds {expected}, but the log's snapshot "
                f"holds {len(ids)}"
            )
        _check_read(pipeline, plan.pieces(pipeline.rank, w.worker), w, ids, head.id)
    pipeline.reset(buffers)
    return state


def read_buffers(
    pipeline: StreamPipeline,
    head: Commit,
    state: PipelineState,
    fetched: Fetched | None = None,
) -> dict[int, list[int]]:
    """Buffer contents of ``state``'s rank at ``head``, by worker, in slot order: the
    ``buffer`` events of the rank's newest segment (one look-up of the newest segments
    per head, shared by its ranks through ``pipeline.newest``; the segment taken from
    ``fetched`` when it holds it, see :meth:`ledger.store.Store.read_ahead_chunks`)."""
    if not holds_buffers(state):
        return {}
    ref = newest_of(pipeline, head)[state.rank]
    if ref is None:
        raise LogCorrupted(f"commit {head.id} has buffered samples but no segment")
    table = segments.read(
        pipeline.store,
        ref.path,
        rows=ref.rows,
        checksum=ref.sha256,
        columns=["worker", "batch", "position", "sample_id", "kind"],
        fetched=fetched,
    )
    table = table.filter(pc.equal(table["kind"].cast(pa.string()), BUFFER))
    table = table.filter(pc.equal(table["batch"], state.batch))
    buffers = {}
    for w in state.workers:
        rows = table.filter(pc.equal(table["worker"], w.worker))
        order = np.argsort(rows["position"].to_numpy())
        buffers[w.worker] = rows["sample_id"].to_numpy()[order].tolist()
    return buffers


def holds_buffers(state: PipelineState) -> bool:
    """Whether a stream rank's state has rows in a shuffle buffer (read, not handed on)."""
    return any(w.rows_read > w.emitted for w in state.workers)


def newest_of(pipeline: StreamPipeline, head: Commit) -> list[SegmentRef | None]:
    """Each rank's newest segment at ``head``: the head marker read once per head."""
    if head.id not in pipeline.newest:
        pipeline.newest = {head.id: newest_segments(pipeline.store, head, len(head.states))}
    return pipeline.newest[head.id]


def _check_read(
    pipeline: StreamPipeline, pieces: list[Piece], w: WorkerState, ids: list[int], cid: str
) -> None:
    """Every buffered id must be a row the worker has already read."""
    if not ids:
        return
    files, rows = pipeline.stream.source.locate(np.array(ids, np.int64))
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
