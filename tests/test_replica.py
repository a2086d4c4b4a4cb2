"""The vectorised replica (IdFeed) hands on exactly what a worker's DocFeed does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ledger.stream.replica as replica_module
from ledger.commits import WorkerState
from ledger.errors import LedgerError
from ledger.stream.pipeline import BatchMeta, DocFeed
from ledger.stream.replica import IdFeed, Replica


def _source(rows: list[int]) -> SimpleNamespace:
    return SimpleNamespace(offsets=np.concatenate([[0], np.cumsum(rows)]).astype(np.int64))


@st.composite
def feeds(draw: st.DrawFn) -> tuple:
    rows = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    pieces = []
    for f, n in enumerate(rows):
        if draw(st.booleans()):
            lo = draw(st.integers(0, n))
            pieces.append((f, lo, draw(st.integers(lo, n))))
    pieces = draw(st.permutations(pieces))
    size = draw(st.sampled_from([0, 1, 2, 3, 7, 16, 50]))
    key = draw(st.integers(0, 2**64 - 1))
    skip = draw(st.integers(0, 60))  # samples handed on before the replica starts
    chunks = draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    return rows, pieces, size, key, skip, chunks


@settings(max_examples=300, deadline=None)
@given(feeds(), st.sampled_from([1, 3, 17, 4096]))
def test_idfeed_equals_docfeed_from_any_state(case: tuple, chunk: int) -> None:
    """Step for step, whatever the chunk of steps computed at once."""
    rows, pieces, size, key, skip, chunks = case
    replica_module._CHUNK = chunk
    try:
        source = _source(rows)
        worker = DocFeed(source, list(pieces), WorkerState(0), [], None, size, key)  # type: ignore[arg-type]
        for _ in range(skip):
            if worker.next() is None:
                break
        state = worker.state(0, None, [])
        replica = IdFeed(source, list(pieces), state, list(worker.ids), size, key)  # type: ignore[arg-type]
        for k in chunks:
            want = []
            for _ in range(k):
                nxt = worker.next()
                if nxt is None:
                    break
                want.append(nxt[0])
            got = replica.take(k)
            assert got.tolist() == want
            assert replica.buffer() == worker.ids
            assert replica.exhausted() == worker.exhausted()
            assert (
                replica.shard,
                replica.row,
                replica.rows_read,
                replica.draws,
                replica.emitted,
            ) == (
                worker.shard,
                worker.row,
                worker.rows_read,
                worker.draws,
                worker.emitted,
            )
    finally:
        replica_module._CHUNK = 4096


def _meta(ids: list[int], spans: list[tuple[int, int, int]] | None) -> BatchMeta:
    arr = None if spans is None else np.array(spans, np.int64).reshape(-1, 3)
    return BatchMeta(0, 0, np.array(ids, np.int64), arr, None)


def _replica(size: int = 0) -> Replica:
    source = _source([10])
    return Replica(IdFeed(source, [(0, 0, 10)], WorkerState(0), [], size, 7), 0, None, [])  # type: ignore[arg-type]


def test_fold_checks_ids_and_packing() -> None:
    r = _replica()
    r.fold(_meta([0, 1], None))
    with pytest.raises(LedgerError, match="produced sample 3, but the plan says 2"):
        r.fold(_meta([3], None))
    r = _replica()
    # Sample 0 (5 tokens) split over two sequences, then sample 1 begins.
    r.fold(_meta([0], [(0, 3, 5)]))
    assert r.doc == (0, 3, 5)
    r.fold(_meta([0, 1], [(3, 5, 5), (0, 1, 4)]))
    assert r.doc == (1, 1, 4)
    assert r.state().emitted == 2
    with pytest.raises(LedgerError, match=r"packed tokens \[2, 4\) of sample 1"):
        r.fold(_meta([1], [(2, 4, 4)]))  # skips token 1
    r = _replica()
    with pytest.raises(LedgerError, match="produced sample 1, but the plan says 0"):
        r.fold(_meta([1], [(0, 2, 2)]))
