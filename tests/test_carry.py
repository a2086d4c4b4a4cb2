"""A change of shape deals what the old workers left (``ledger.stream.plan.carry_over``):
contiguous runs of rows (``row-blocks-v1``), each new rank reading only the old buffers
dealt to it; logs begun before it keep dealing round robin."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ledger
from ledger.commits import PipelineState, WorkerState
from ledger.errors import ConfigMismatch, LogCorrupted
from ledger.stream import ShardedSource, Stream
from ledger.stream.plan import (
    CARRY_ALGORITHM,
    CARRY_ROUND_ROBIN,
    EpochPlan,
    carry_over,
)
from ledger.testing import take


class Rows:
    """A source's shape only (``EpochPlan`` and ``carry_over`` read no row)."""

    def __init__(self, sizes: list[int]) -> None:
        self.infos = [None] * len(sizes)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def shard_rows(self, shard: int) -> int:
        return int(self.offsets[shard + 1] - self.offsets[shard])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ShardedSource.locate(self, ids)  # type: ignore[arg-type]


def rows_of(pieces) -> list[tuple[int, int]]:
    return [(f, r) for f, a, b in pieces for r in range(a, b)]


@st.composite
def shapes(draw):
    """An old shape at a commit inside epoch 1: shards, old ranks and workers, each old
    worker's cursor and buffer (ids read before its cursor), the new worker count."""
    sizes = draw(st.lists(st.integers(0, 9), min_size=1, max_size=24))
    world = draw(st.integers(1, 6))
    workers = draw(st.integers(1, 3))
    plan = EpochPlan(Rows(sizes), 7, 1, True, world, workers)  # type: ignore[arg-type]
    states, buffers = [], {}
    for rank in range(world):
        epoch = draw(st.sampled_from([0, 1, 1, 1, 2]))
        ws = []
        for w in range(workers):
            mine = plan.pieces(rank, w)
            shard = draw(st.integers(0, len(mine)))
            row = mine[shard][1] + draw(st.integers(0, 9)) if shard < len(mine) else 0
            done = mine[:shard] + (
                [(mine[shard][0], mine[shard][1], min(row, mine[shard][2]))]
                if shard < len(mine)
                else []
            )
            read = [int(plan.source.offsets[f]) + r for f, a, b in done for r in range(a, b)]
            held = read[-draw(st.integers(0, len(read))) :] if read else []
            held = held if epoch == 1 else []
            buffers[rank, w] = held
            tail = ((1000 + rank * 10 + w, 3, 9),) if draw(st.booleans()) else ()
            ws.append(WorkerState(w, shard, row, 100 + len(held), 0, 100, tails=tail))
        states.append((rank, PipelineState(rank, epoch, 0, 5, tuple(ws))))
    return plan, states, buffers, draw(st.integers(1, 13))


@settings(max_examples=150, deadline=None)
@given(shapes())
def test_row_blocks_deal_the_same_rows_in_equal_runs_reading_only_what_they_deal(shape):
    plan, states, buffers, total = shape
    asked: list[list[int]] = []

    def read(ranks):
        asked.append(list(ranks))
        return {k: v for k, v in buffers.items() if k[0] in ranks}

    robin = carry_over(plan, states, read, total, CARRY_ROUND_ROBIN)
    blocks = carry_over(plan, states, read, total, CARRY_ALGORITHM)
    # The same rows and tails, each once, across the new workers.
    every = sorted(r for g in range(total) for r in rows_of(robin[g][0]))
    assert sorted(r for g in range(total) for r in rows_of(blocks[g][0])) == every
    assert len(set(every)) == len(every)
    assert sorted(t for g in range(total) for t in blocks[g][1]) == sorted(
        t for g in range(total) for t in robin[g][1]
    )
    # Equal runs, the longer ones first; the tails likewise.
    counts = [len(rows_of(blocks[g][0])) for g in range(total)]
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    tails = [len(blocks[g][1]) for g in range(total)]
    assert max(tails) - min(tails) <= 1 and tails == sorted(tails, reverse=True)
    # One new worker's share alone is the same, and reads only the buffers it holds.
    owner = {i: rank for (rank, _), ids in buffers.items() for i in ids}
    for g in range(total):
        asked.clear()
        alone = carry_over(plan, states, read, total, CARRY_ALGORITHM, range(g, g + 1))
        assert alone == {g: blocks[g]}
        ids = {int(plan.source.offsets[f]) + r for f, r in rows_of(blocks[g][0])}
        mine = sorted({owner[i] for i in ids & owner.keys()})
        assert asked == ([mine] if mine else [])


def test_a_buffer_that_disagrees_with_its_count_is_refused():
    plan = EpochPlan(Rows([4, 4]), 7, 0, False, 1, 1)  # type: ignore[arg-type]
    state = PipelineState(0, 0, 0, 1, (WorkerState(0, 0, 3, 3, 0, 1),))
    for dealing in (CARRY_ALGORITHM, CARRY_ROUND_ROBIN):
        with pytest.raises(LogCorrupted, match="buffer holds 2, but the log's snapshot holds 1"):
            carry_over(plan, [(0, state)], lambda ranks: {(0, 0): [1]}, 2, dealing)
        got = carry_over(plan, [(0, state)], lambda ranks: {(0, 0): [1, 2]}, 2, dealing)
        assert sorted(rows_of(got[0][0] + got[1][0])) == [(0, 1), (0, 2), (0, 3)] + [
            (1, r) for r in range(4)
        ]


def _loader(shards: str, root: str, workers: int) -> ledger.DataLoader:
    from conftest import packed_stream

    return ledger.DataLoader(
        packed_stream(shards, shuffle_buffer=3), batch_size=2, seed=5, log=root,
        num_workers=workers,
    )  # fmt: skip


def test_a_new_run_records_its_dealing_and_an_unknown_one_is_refused(tmp_path):
    from conftest import rewrite_run, text_shards

    shards = text_shards(tmp_path / "shards", 4, 3, "x", 2)
    root = str(tmp_path / "log")
    loader = _loader(shards, root, 0)
    list(take(loader, 2))
    token = loader.state_dict()
    loader.close()
    with open(os.path.join(root, "run.json")) as f:
        assert json.load(f)["config"]["carry"] == CARRY_ALGORITHM
    # A log begun by a later ledger, with a dealing this one does not know.
    rewrite_run(root, lambda run: run["config"].update(carry="spiral-v9"))
    resumed = _loader(shards, root, 2)
    with pytest.raises(ConfigMismatch, match="'spiral-v9', which this version of ledger"):
        resumed.load_state_dict(token)


def test_a_log_without_a_dealing_deals_round_robin(monkeypatch):
    """``run.json`` of a log begun before ``carry`` was recorded: its dealing is
    ``round-robin-v1`` whatever a new run's would be (the served order after a change of
    shape is the log's; ``test_compat`` resumes such a log written by that ledger)."""
    pipeline = SimpleNamespace(stream=SimpleNamespace(source=SimpleNamespace(check=lambda s: None)))
    from ledger.stream.pipeline import StreamPipeline

    StreamPipeline.check_logged(pipeline, {"source": []})  # type: ignore[arg-type]
    assert pipeline.dealing == CARRY_ROUND_ROBIN
    StreamPipeline.check_logged(pipeline, {"source": [], "carry": CARRY_ALGORITHM})  # type: ignore[arg-type]
    assert pipeline.dealing == CARRY_ALGORITHM


def _cut_resolved(pieces, total, gw):
    """A mixture lane's run as ledger dealt it before runs read their buffers on demand
    (every buffer resolved to one-row pieces first): the reference for ``equal_runs``."""
    rows = np.array([stop - start for _, start, stop in pieces], np.int64)
    ends = np.cumsum(rows)
    n = int(ends[-1]) if ends.size else 0
    lo, hi = gw * n // total, (gw + 1) * n // total
    out = []
    i = int(np.searchsorted(ends, lo, side="right"))
    while lo < hi and i < len(pieces):
        shard, start, _ = pieces[i]
        first = int(ends[i] - rows[i])
        stop = min(hi, int(ends[i]))
        if stop > lo:
            out.append((shard, start + lo - first, start + stop - first))
        lo = max(lo, stop)
        i += 1
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 5)).map(
                lambda p: ("piece", p[0], p[1], p[1] + p[2])
            ),
            st.tuples(st.integers(0, 4), st.integers(0, 2), st.integers(1, 4)).map(
                lambda h: ("held", *h)
            ),
        ),
        max_size=12,
    ),
    st.integers(1, 7),
)
def test_a_mixture_lane_run_is_the_same_pieces_reading_only_its_buffers(spec, total):
    """``lanes.equal_runs`` over pieces and held buffers gives each new lane exactly the
    pieces the dealing gave when every buffer was read first, and reads only the old
    ranks whose buffered rows its run takes."""
    from ledger.stream.lanes import equal_runs
    from ledger.stream.plan import Held

    source = Rows([50] * 4)
    items, resolved, buffers, owner, k = [], [], {}, {}, 0
    for kind, a, b, c in spec:
        if kind == "piece":
            items.append((a, b, c))
            resolved.append((a, b, c))
            continue
        key = (a, b, 0)
        if key in buffers:
            continue
        ids = [150 + k + i for i in range(c)]  # rows of shard 3 no piece reaches
        k += c
        buffers[key] = ids
        owner.update(dict.fromkeys(ids, a))
        items.append(Held(key, c))
        resolved += [(3, i - 150, i - 149) for i in ids]
    asked = []

    def read(ranks):
        asked.append(list(ranks))
        return {key: ids for key, ids in buffers.items() if key[0] in ranks}

    for g in range(total):
        asked.clear()
        got = equal_runs(source, items, total, read).pieces(g)
        assert got == _cut_resolved(resolved, total, g)
        mine = sorted({owner[150 + r] for f, a, b in got if f == 3 for r in range(a, b)})
        assert asked == ([mine] if mine else [])


def test_each_new_rank_reads_only_the_old_segments_dealt_to_it(tmp_path):
    """8 old ranks of 8 workers, buffers full mid-epoch (``tools/scale.py``'s stream
    builder) resumed on 4: new rank ``r`` reads the newest segments of old ranks ``2r`` and
    ``2r + 1`` only, and what the new ranks are dealt, with what the old ones consumed,
    is every row of the epoch once."""
    import torch.distributed as dist

    from ledger import segments
    from ledger.audit import connect

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import scale

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        buffer = 6
        rows = 2 * (buffer + scale.STREAM_COMMITS * scale.STREAM_BATCH)
        stream = Stream(
            scale.shards(str(tmp_path / "shards"), 8 * scale.WORKERS, rows), shuffle_buffer=buffer
        )
        root = str(tmp_path / "log")
        token, _ = scale.build_stream(root, stream, 8)
        con = connect(root)
        consumed = [
            r[0]
            for r in con.execute("SELECT sample_id FROM lineage WHERE kind = 'sample'").fetchall()
        ]
        con.close()
        read = segments.read
        dealt: list[int] = []
        for r in range(4):
            paths: set[str] = set()

            def spy(store, rel, paths=paths, **kw):
                paths.add(rel)
                return read(store, rel, **kw)

            loader = scale.stream_loader(root, stream, r, 4)
            segments.read = spy
            try:
                loader.load_state_dict(token)
            finally:
                segments.read = read
            assert sorted(paths) == [
                f"events/attempt=0/rank={old}/seg-{token['step']:012d}.parquet"
                for old in (2 * r, 2 * r + 1)
            ]
            plan = loader._pipeline.plan(0, token["commit"])
            offsets = stream.source.offsets
            dealt += [
                int(offsets[f]) + i
                for w in range(scale.WORKERS)
                for f, a, b in plan.pieces(r, w)
                for i in range(a, b)
            ]
            loader.close()
    finally:
        dist.destroy_process_group()
    assert sorted(dealt + consumed) == list(range(stream.source.num_rows))


def test_a_loader_resumes_a_recreated_root_with_that_runs_carry(tmp_path):
    """Commit ids name commits within one run: a loader that resumed a change of shape of
    one run, and then a token of another run on the same root (deleted and begun again:
    the same commit ids, another worker count before the change), deals the second run's
    leftovers, not the first's."""
    import shutil

    from conftest import packed_stream, text_shards

    from ledger.testing import batches_equal

    shards = text_shards(tmp_path / "shards", 4, 5, "y", 3)
    root = str(tmp_path / "log")

    def loader(workers):
        return ledger.DataLoader(
            packed_stream(shards, shuffle_buffer=3), batch_size=2, seed=0, log=root,
            num_workers=workers,
        )  # fmt: skip

    def run(workers):
        first = loader(workers)
        list(take(first, 3))
        token = first.state_dict()
        first.close()
        return token

    old = loader(3)
    before = run(2)
    old.load_state_dict(before)
    list(take(old, 2))
    shutil.rmtree(root)
    token = run(0)  # another run, one worker: its commit has the same id
    assert token["commit"] == before["commit"] and token["run_id"] != before["run_id"]
    fresh = loader(3)
    fresh.load_state_dict(token)
    want = list(take(fresh, 6))
    old.load_state_dict(token)
    assert all(batches_equal(a, b) for a, b in zip(take(old, 6), want, strict=True))
