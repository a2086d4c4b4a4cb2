"""RNG modes: what stays identical under which change, the seed range, batched fetch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from conftest import Augmented, Draws, loop_generators_with_cached_variates
from hypothesis import given, settings
from hypothesis import strategies as st

import ledger
from ledger.audit.queries import materialize
from ledger.order import batch_seed, sample_seed, sample_seeds
from ledger.testing import assert_resume_exact, take


class InitialSeed:
    """Returns the seed torch was seeded with (a pattern from torch's own tests)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return torch.initial_seed()


class Batched:
    """A dataset with ``__getitems__``, like HF ``datasets.Dataset``; counts the calls."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        raise AssertionError("a dataset with __getitems__ must be fetched a batch at a time")

    def __getitems__(self, ids: list[int]) -> list[torch.Tensor]:
        self.calls.append(len(ids))
        noise = torch.rand(len(ids))  # one draw for the whole batch
        return [torch.stack([torch.tensor(float(i)), noise[k]]) for k, i in enumerate(ids)]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**64 - 1), st.integers(0, 10**6), st.lists(st.integers(0, 2**62), max_size=20)
)
def test_seeds_are_below_2_63_and_agree(seed: int, epoch: int, ids: list[int]) -> None:
    seeds = sample_seeds(seed, epoch, np.array(ids, np.int64))
    assert all(int(s) < 2**63 for s in seeds.tolist())
    assert seeds.tolist() == [sample_seed(seed, epoch, i) for i in ids]
    assert 0 <= batch_seed(seed, epoch, ids[0] if ids else 0) < 2**63


@pytest.mark.parametrize("rng", ["batch", "sample"])
def test_a_dataset_returning_the_initial_seed_collates(root, rng):
    loader = ledger.DataLoader(InitialSeed(), batch_size=8, shuffle=True, log=root, rng=rng)
    seeds = torch.cat(list(loader))
    assert seeds.dtype == torch.int64 and int(seeds.min()) >= 0
    if rng == "batch":  # one seed per batch, a new one for each batch
        assert all(len(set(b.tolist())) == 1 for b in seeds.view(8, 8))
        assert len(set(seeds.tolist())) == 8
    else:
        assert len(set(seeds.tolist())) == 64


def _epoch(root: str, num_workers: int, rng: str) -> list[dict[str, torch.Tensor]]:
    loader = ledger.DataLoader(
        Augmented(40),
        batch_size=4,
        shuffle=True,
        seed=5,
        log=root,
        rng=rng,
        num_workers=num_workers,
    )
    return list(loader)


@pytest.mark.parametrize("rng", ["batch", "sample"])
def test_augmentation_does_not_depend_on_num_workers(tmp_path, rng):
    runs = [_epoch(str(tmp_path / f"w{nw}"), nw, rng) for nw in (0, 1, 2)]
    for other in runs[1:]:
        assert len(other) == len(runs[0]) == 10
        for a, b in zip(runs[0], other, strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), key
    # The draws are real: samples of one batch differ.
    assert len({float(x) for x in runs[0][0]["x"][:, 0]}) == 4


def test_batch_and_sample_modes_differ_and_off_leaves_the_rngs_alone(tmp_path):
    batch = _epoch(str(tmp_path / "b"), 0, "batch")
    sample = _epoch(str(tmp_path / "s"), 0, "sample")
    assert [b["id"].tolist() for b in batch] == [s["id"].tolist() for s in sample]
    assert not torch.equal(batch[0]["x"], sample[0]["x"])
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    first = _epoch(str(tmp_path / "o"), 0, "off")[0]["x"][0]
    assert torch.equal(first, expected)  # not seeded: the loop's own generator drew it


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_mode_resumes_exactly_from_every_batch(root, num_workers):
    def make():
        return ledger.DataLoader(
            Augmented(22), batch_size=4, shuffle=True, seed=2, log=root, num_workers=num_workers
        )

    assert assert_resume_exact(make, batches=13) == 13


def test_batch_mode_keeps_the_training_loops_rngs(root):
    loader = ledger.DataLoader(Augmented(16), batch_size=4, log=root)
    torch.manual_seed(3)
    np.random.seed(3)
    expected = (torch.rand(2), np.random.rand(2))
    torch.manual_seed(3)
    np.random.seed(3)
    list(take(loader, 2))
    assert torch.equal(torch.rand(2), expected[0])
    assert np.array_equal(np.random.rand(2), expected[1])


@pytest.mark.parametrize("rng", ["batch", "sample", "off"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_getitems_is_always_batched(root, rng, num_workers):
    ds = Batched(20)
    loader = ledger.DataLoader(
        ds, batch_size=6, shuffle=True, log=root, rng=rng, num_workers=num_workers
    )
    got = torch.cat(list(loader))
    assert sorted(got[:, 0].tolist()) == list(range(20))
    if num_workers == 0:
        assert ds.calls == [6, 6, 6, 2]


def test_torch_subset_is_fetched_in_batches(root):
    ds = tud.Subset(Batched(30), list(range(0, 30, 2)))
    loader = ledger.DataLoader(ds, batch_size=5, log=root)
    assert torch.cat(list(loader))[:, 0].tolist() == [float(i) for i in range(0, 30, 2)]
    assert ds.dataset.calls == [5, 5, 5]


@pytest.mark.parametrize("rng", ["batch", "sample"])
def test_materialize_reproduces_the_recorded_digest(root, rng):
    loader = ledger.DataLoader(Augmented(30), batch_size=4, shuffle=True, seed=4, log=root, rng=rng)
    received = list(take(loader, 5))
    loader.state_dict()
    for b in (0, 3, 4):
        made = materialize(root, b, Augmented(30))
        assert made.matches, b
        for key in received[b]:
            assert torch.equal(made.data[key], received[b][key])


def test_rng_must_be_a_known_mode(root):
    with pytest.raises(ValueError, match="rng must be one of 'batch', 'sample', 'off'"):
        ledger.DataLoader(Augmented(4), batch_size=2, log=root, rng="worker")


def test_per_sample_rng_is_the_older_spelling_and_old_logs_resume(root):
    def make(**kw):
        return ledger.DataLoader(Augmented(12), batch_size=3, shuffle=True, log=root, **kw)

    assert make(per_sample_rng=False).rng == "off"
    loader = make(per_sample_rng=True)
    assert loader.rng == "sample"
    expected = list(take(loader, 4))
    loader = make(rng="sample")
    list(take(loader, 2))
    token = loader.state_dict()
    # A log written before the RNG modes records per_sample_rng in run.json.
    from conftest import rewrite_run

    def older(run: dict) -> None:
        del run["config"]["rng"]
        run["config"]["per_sample_rng"] = True

    rewrite_run(root, older, begun_before=True)
    resumed = make(rng="sample")
    resumed.load_state_dict(token)
    for a, b in zip(list(take(resumed, 2)), expected[2:], strict=True):
        assert torch.equal(a["x"], b["x"])
    with pytest.raises(ledger.errors.ConfigMismatch, match="rng"):
        make(rng="batch").load_state_dict(token)


@pytest.mark.parametrize("raw", [True, False])
def test_rngs_preserved_restores_random_exactly(monkeypatch, raw):
    """``random``'s state comes back bit for bit, its cached gauss included, through the
    raw-bytes copy and through the getstate/setstate fallback."""
    import random

    from ledger import order

    if not raw:
        monkeypatch.setattr(order._RandomState, "matches", lambda self: False)
        monkeypatch.setattr(order, "_random_checked", None)
    assert (order.random_state() is not None) == raw
    random.seed(11)
    random.gauss(0, 1)  # leaves gauss_next cached
    before = random.getstate()
    expected = [random.random(), random.gauss(0, 1)]
    random.setstate(before)
    with order.rngs_preserved(True):
        random.seed(99)
        random.random()
        random.gauss(0, 1)
    assert random.getstate() == before
    assert [random.random(), random.gauss(0, 1)] == expected
    monkeypatch.setattr(order, "_random_checked", None)  # re-check for later tests


def _random_collate(samples: list[dict[str, object]]) -> dict[str, torch.Tensor]:
    """A collate function that draws from ``random`` (as whole-word masking does)."""
    import random

    out = tud.default_collate(samples)
    out["mask"] = torch.tensor([random.random() for _ in samples])
    return out


def _seeded_reference(dataset, seed, batches, batch_size, collate):
    """Batch k of epoch 0 as the seeded definition makes it: torch, numpy and random
    seeded with the batch seed, then the dataset and the collate function."""
    from ledger.order import EpochOrder, rngs_preserved, seed_globals

    order = EpochOrder(len(dataset), seed, 0)
    out = []
    with rngs_preserved(True):
        for k in range(batches):
            seed_globals(batch_seed(seed, 0, k * batch_size))
            ids = order.range(k * batch_size, (k + 1) * batch_size).tolist()
            out.append(collate([dataset[i] for i in ids]))
    return out


@pytest.mark.parametrize(
    "which,drawing,collate",
    [
        ("none", None, tud.default_collate),
        ("numpy", None, tud.default_collate),
        ("numpy-normal", None, tud.default_collate),
        ("random-gauss", None, tud.default_collate),
        ("numpy", range(20, 24), tud.default_collate),  # only some samples draw
        ("numpy-normal", "first", tud.default_collate),  # one normal, the cached one's place
        ("random-gauss", "first", tud.default_collate),
        ("none", None, _random_collate),
    ],
)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lazy_seeding_gives_the_seeded_batches(
    tmp_path, monkeypatch, which, drawing, collate, num_workers
):
    """numpy and random are seeded only once a batch drew from them; the batches are
    nevertheless those of seeding all three before every batch, whatever draws, even
    with the training loop's cached normal variates pending (numpy's and random's)."""
    import random

    from ledger import fetch
    from ledger.order import EpochOrder

    monkeypatch.setattr(fetch, "_globals_drawn", False)
    if drawing == "first":  # only the epoch's first sample draws
        drawing = [int(EpochOrder(32, 5, 0).range(0, 1)[0])]
    dataset = Draws(32, which, drawing)
    expected = _seeded_reference(dataset, 5, 8, 4, collate)
    loop_next = loop_generators_with_cached_variates()
    loader = ledger.DataLoader(
        dataset, batch_size=4, shuffle=True, seed=5, log=str(tmp_path / "log"),
        num_workers=num_workers, collate_fn=collate,
    )  # fmt: skip
    got = list(loader)
    assert len(got) == len(expected) == 8
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    if which != "none":
        assert len({float(x) for b in got for x in b["draw"]}) > 1  # the draws are real
    # The training loop's generators, cached variates included, are untouched.
    assert (np.random.normal(), random.gauss(0, 1), float(torch.rand(()))) == loop_next
    drew = which != "none" or collate is _random_collate
    if num_workers == 0:
        assert fetch._globals_drawn == drew


def test_numpy_state_round_trips_its_cached_normal():
    """Where numpy's layout is known (it is on the pinned numpy), the saved state
    includes the cached normal variate: a restore gives back the very next normal."""
    from ledger import order

    state = order.numpy_state()
    assert state._gauss is not None, "numpy's aug_bitgen_t layout was not found"
    np.random.seed(3)
    np.random.normal()
    saved = state.save()
    expected = [np.random.normal(), np.random.rand()]
    np.random.seed(99)
    np.random.normal()
    state.restore(saved)
    assert [np.random.normal(), np.random.rand()] == expected
    assert np.random.get_state()[3] == 0  # the cached one was consumed again


def test_torch_state_round_trips_its_cached_normal():
    """Where torch's generator layout is known (it is on the pinned torch), the raw bytes
    saved include the cached normal variate: a restore gives back the very next draws
    and the state ``get_state`` reports."""
    from ledger import order

    saver = order.torch_state()
    assert saver is not None, "torch's CPUGeneratorImpl layout was not found"
    generator = torch.default_generator
    torch.manual_seed(3)
    torch.randn(1, dtype=torch.float64)  # leaves the pair's second variate cached
    state = generator.get_state()
    saved = saver.save()
    expected = [torch.randn(1, dtype=torch.float64), torch.rand(4)]
    torch.manual_seed(99)
    torch.rand(700)  # past a twist of the Mersenne Twister
    saver.restore(saved)
    assert torch.equal(generator.get_state(), state)
    assert all(
        torch.equal(a, b)
        for a, b in zip([torch.randn(1, dtype=torch.float64), torch.rand(4)], expected, strict=True)
    )


@pytest.mark.parametrize("which", ["none", "numpy-normal", "random-gauss"])
def test_lazy_seeding_where_no_layout_is_known(tmp_path, monkeypatch, which):
    """Without the raw layouts (another torch, numpy or interpreter), the loop's thread
    seeds through get_state/set_state and mark_globals: the same seeded batches, and the
    training loop's generators, cached variates included, untouched."""
    import random

    from ledger import fetch, order

    monkeypatch.setattr(fetch, "_globals_drawn", False)
    monkeypatch.setattr(order, "_find_torch_state", lambda generator: None)
    monkeypatch.setattr(order, "_torch_state", None)
    monkeypatch.setattr(order, "_loop_states", None)
    assert order.loop_states() is None and order.save_torch().numel() == 5056
    dataset = Draws(16, which)
    expected = _seeded_reference(dataset, 5, 4, 4, tud.default_collate)
    loop_next = loop_generators_with_cached_variates()
    loader = ledger.DataLoader(dataset, batch_size=4, shuffle=True, seed=5, log=str(tmp_path))
    got = list(loader)
    assert len(got) == 4
    for a, b in zip(got, expected, strict=True):
        assert all(torch.equal(a[key], b[key]) for key in a)
    assert (np.random.normal(), random.gauss(0, 1), float(torch.rand(()))) == loop_next
    monkeypatch.undo()
    order._torch_state = order._loop_states = None  # found again for later tests


def test_torch_layout_is_probed_without_reading_unmapped_memory():
    """The generator's memory is first read through a pipe, so a torch laid out otherwise
    (a pointer that is not the generator's) is refused, not a crash."""
    import ctypes

    from ledger import order

    assert order._read_memory(0, 16) is None  # unmapped: EFAULT, not SIGSEGV
    data = ctypes.create_string_buffer(b"ledger", 6)
    assert order._read_memory(ctypes.addressof(data), 6) == b"ledger"
    other = torch.Generator()
    other.manual_seed(5)
    before = other.get_state()
    assert order._find_torch_state(other) is not None  # any CPU generator has the layout
    assert torch.equal(other.get_state(), before)  # and is left as it was


@pytest.mark.parametrize("which", ["none", "numpy"])
def test_zero_workers_give_back_numpys_state_exactly(tmp_path, monkeypatch, which):
    """numpy's state as ``get_state`` reports it comes back bit for bit after each batch
    at 0 workers, also a cached variate set without ``has_gauss`` (``set_state`` keeps
    it), whether the dataset draws from numpy (its first batch loaded twice) or not."""
    from ledger import fetch

    monkeypatch.setattr(fetch, "_globals_drawn", False)
    np.random.seed(2)
    name, key, pos, _, _ = np.random.get_state()
    np.random.set_state((name, key, pos, 0, 1.5))
    loader = ledger.DataLoader(Draws(12, which), batch_size=4, log=str(tmp_path))
    for _ in loader:
        now = np.random.get_state()
        assert np.array_equal(now[1], key) and now[2:] == (pos, 0, 1.5)
    assert fetch._globals_drawn == (which == "numpy")
