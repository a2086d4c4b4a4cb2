"""Property tests of the seeded epoch order, the batch plan and the per-sample seeds."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.order import BatchPlan, EpochOrder, sample_seeds

seeds = st.integers(min_value=-(2**70), max_value=2**70)
epochs = st.integers(min_value=0, max_value=10**6)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=0, max_value=3000), seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_order_is_a_bijection_with_inverse(n, seed, epoch, shuffle):
    order = EpochOrder(n, seed, epoch, shuffle)
    ids = order.range(0, n)
    assert ids.dtype == np.int64
    assert np.array_equal(np.sort(ids), np.arange(n))
    assert np.array_equal(order.positions(ids), np.arange(n))
    if not shuffle:
        assert np.array_equal(ids, np.arange(n))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=2, max_value=2**62 - 1), seed=seeds, epoch=epochs, data=st.data())
def test_order_inverse_for_huge_n(n, seed, epoch, data):
    positions = np.array(
        data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=50)), dtype=np.int64
    )
    order = EpochOrder(n, seed, epoch)
    ids = order.sample_ids(positions)
    assert ((ids >= 0) & (ids < n)).all()
    assert np.array_equal(order.positions(ids), positions)


def test_order_for_ten_billion_samples_without_materialising():
    n = 10**10
    order = EpochOrder(n, seed=1, epoch=2)
    positions = np.arange(0, n, 9_999_991, dtype=np.int64)
    ids = order.sample_ids(positions)
    assert len(np.unique(ids)) == len(ids)
    assert np.array_equal(order.positions(ids), positions)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(min_value=1, max_value=500), seed=seeds, epoch=epochs)
def test_order_is_deterministic_and_depends_on_seed_and_epoch(n, seed, epoch):
    a = EpochOrder(n, seed, epoch).range(0, n)
    assert np.array_equal(a, EpochOrder(n, seed, epoch).range(0, n))
    assert np.array_equal(a[n // 3 : n // 2], EpochOrder(n, seed, epoch).range(n // 3, n // 2))


@settings(max_examples=20, deadline=None)
@given(bits=st.integers(min_value=2, max_value=24), seed=seeds, epoch=epochs, data=st.data())
def test_tabulated_rounds_give_the_finalisers_values(bits, seed, epoch, data):
    # A call over at least a table's worth of positions tabulates the round functions;
    # a one-position call computes them: both ways give the same order and inverse.
    n = data.draw(st.integers(min_value=max(2, 1 << (bits - 1)), max_value=1 << bits))
    tabulated, direct = EpochOrder(n, seed, epoch), EpochOrder(n, seed, epoch)
    positions = np.arange(min(n, 4096), dtype=np.int64)[::-1]
    ids = tabulated.sample_ids(positions)
    assert tabulated._tables  # halves of up to 12 bits here
    step = max(1, positions.size // 30)
    assert [int(direct.sample_ids(int(p))) for p in positions[::step]] == ids[::step].tolist()
    assert not direct._tables
    assert np.array_equal(tabulated.positions(ids), positions)


def test_orders_of_earlier_versions_are_kept():
    # Pinned: logs written by earlier versions resume with the same order.
    assert EpochOrder(10**6, 3, 7).range(0, 8).tolist() == [
        910871, 818118, 164294, 58226, 932703, 766076, 334663, 259410
    ]  # fmt: skip
    order = EpochOrder(2**31 + 5, 1, 2)
    order.sample_ids(np.arange(70_000))  # tabulated
    assert order.range(0, 4).tolist() == [1842372219, 1153962968, 1414235096, 2106327272]


def test_orders_differ_across_epochs_and_seeds():
    base = EpochOrder(1000, 0, 0).range(0, 1000)
    assert not np.array_equal(base, EpochOrder(1000, 0, 1).range(0, 1000))
    assert not np.array_equal(base, EpochOrder(1000, 1, 0).range(0, 1000))


def test_order_is_well_mixed():
    # Positions of each sample over many epochs are close to uniform (chi-square).
    n, epochs_ = 16, 4000
    counts = np.zeros((n, n))
    for e in range(epochs_):
        counts[np.arange(n), EpochOrder(n, 5, e).range(0, n)] += 1
    expected = epochs_ / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    # 225 degrees of freedom: the 99.9% quantile is about 301.
    assert chi2 < 301, chi2


def test_order_rejects_out_of_range():
    order = EpochOrder(10, 0, 0)
    for bad in (-1, 10):
        try:
            order.sample_ids(np.array([bad]))
        except IndexError as e:
            assert str(bad) in str(e)
        else:
            raise AssertionError("no IndexError")


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), b=st.integers(1, 40), w=st.integers(1, 5), drop_last=st.booleans())
def test_batch_plan_partitions_the_epoch(n, b, w, drop_last):
    taken = []
    for r in range(w):
        plan = BatchPlan(n, b, drop_last, r, w)
        for k in range(plan.batches_per_epoch):
            lo, hi = plan.batch_bounds(k)
            assert 0 < hi - lo <= b
            taken.extend(range(lo, hi))
    plan0 = BatchPlan(n, b, drop_last, 0, w)
    assert sorted(taken) == list(range(plan0.consumed_per_epoch))


def test_sample_seeds_depend_on_sample_not_batch():
    ids = np.array([5, 9, 2], dtype=np.int64)
    s = sample_seeds(0, 3, ids)
    assert s.dtype == np.uint64
    assert np.array_equal(sample_seeds(0, 3, ids[::-1]), s[::-1])
    assert not np.array_equal(sample_seeds(0, 4, ids), s)
    assert not np.array_equal(sample_seeds(1, 3, ids), s)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 400),
    b=st.integers(1, 40),
    w=st.integers(1, 5),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_batch_plan_from_a_start_partitions_the_rest_of_the_epoch(n, b, w, drop_last, data):
    start = data.draw(st.integers(0, n))
    taken = []
    for r in range(w):
        plan = BatchPlan(n, b, drop_last, r, w, start=start)
        lo, hi = plan.bounds(0, plan.batches_per_epoch)
        assert [plan.batch_bounds(k) for k in range(plan.batches_per_epoch)] == list(
            zip(lo.tolist(), hi.tolist(), strict=True)
        )
        for a, z in zip(lo.tolist(), hi.tolist(), strict=True):
            assert 0 < z - a <= b
            taken.extend(range(a, z))
    plan0 = BatchPlan(n, b, drop_last, 0, w, start=start)
    assert sorted(taken) == list(range(start, plan0.consumed_per_epoch))
    if drop_last:
        assert (plan0.consumed_per_epoch - start) % (b * w) == 0
