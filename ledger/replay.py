"""Fold a lineage's events into pipeline state, and verify that resuming continues it.

For a map-style dataset the order is a pure function of ``(seed, epoch)``, so the state
of a rank is where its last consumed batch sits in the plan. Replay reads it from the
events (the newest segment of the rank in the lineage), not from the configuration, then
checks two things before the loader may produce a batch:

1. the folded state equals the state the commit marker recorded (the log agrees with
   itself), and
2. the current order reproduces the sample ids of the last logged batch, so the next
   batch continues the log with no gap and no overlap (the loader's order is the log's).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ledger import segments
from ledger.commits import Commit, PipelineState, SegmentRef, lineage
from ledger.errors import LogCorrupted, ResumeMismatch
from ledger.order import BatchPlan, EpochOrder
from ledger.schema import SAMPLE
from ledger.store import Store


def _last_batch(store: Store, ref: SegmentRef) -> pa.Table:
    """The ``sample`` events of the last batch of a segment, reading only its tail.

    Batch indexes never decrease within a segment, so row groups are read from the end
    until one starts with an earlier batch.
    """
    pf = segments.open_segment(store, ref.path, rows=ref.rows, checksum=ref.sha256)
    columns = ["epoch", "batch", "position", "sample_id", "kind"]
    groups: list[pa.Table] = []
    last = None
    for i in reversed(range(pf.num_row_groups)):
        group = pf.read_row_group(i, columns=columns)
        if group.num_rows == 0:
            continue
        groups.insert(0, group)
        last = group["batch"][-1].as_py() if last is None else last
        if group["batch"][0].as_py() < last:
            break
    if last is None:
        raise LogCorrupted(f"segment {ref.path} holds no events")
    table = pa.concat_tables(groups)
    table = table.filter(pc.equal(table["batch"], last))
    table = table.filter(pc.equal(table["kind"].cast(pa.string()), SAMPLE))
    if table.num_rows == 0:
        raise LogCorrupted(f"segment {ref.path} ends with batch {last} but holds no sample of it")
    return table


def advance(state: PipelineState, plan: BatchPlan) -> PipelineState:
    """The state after one more batch; an epoch's last batch moves to the next epoch."""
    nxt = state.epoch_batch + 1
    if nxt >= plan.batches_per_epoch:
        return PipelineState(state.rank, state.epoch + 1, 0, state.batch + 1)
    return PipelineState(state.rank, state.epoch, nxt, state.batch + 1)


def replay(
    store: Store,
    head: Commit,
    plan: BatchPlan,
    order_for: Callable[[int], EpochOrder],
) -> PipelineState:
    """Rebuild rank ``plan.rank``'s pipeline state at ``head`` from the log's events.

    Args:
        store: the log root.
        head: the commit to resume from.
        plan: the resuming loader's batch plan (dataset length, batch size, rank).
        order_for: ``epoch -> EpochOrder`` of the resuming loader.

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
    chain = lineage(store, head.id)
    ref = next(
        (s for c in reversed(chain) for s in c.segments if s.rank == rank and s.rows > 0),
        None,
    )
    if ref is None:
        folded = PipelineState(rank, 0, 0, 0)
        if folded != recorded:
            raise LogCorrupted(
                f"commit {head.id} records state {recorded} for rank {rank}, but its lineage "
                "holds no events of that rank"
            )
        return folded

    rows = _last_batch(store, ref)
    epoch = int(rows["epoch"][0].as_py())
    positions = rows["position"].to_numpy()
    ids = rows["sample_id"].to_numpy()

    last = int(rows["batch"][0].as_py())
    k = int(positions[0]) // plan.step_size
    bounds = plan.batch_bounds(k)
    if bounds != (int(positions[0]), int(positions[-1]) + 1) or not np.array_equal(
        positions, np.arange(bounds[0], bounds[1])
    ):
        raise ResumeMismatch(
            f"the log's last batch (batch {int(last)}, epoch {epoch}) covers positions "
            f"[{int(positions[0])}, {int(positions[-1]) + 1}), but this loader's plan puts "
            f"batch {k} of the epoch at [{bounds[0]}, {bounds[1]}): batch size, world size "
            "or dataset length changed. Resume with the run's original configuration."
        )
    folded = advance(PipelineState(rank, epoch, k, int(last)), plan)
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
