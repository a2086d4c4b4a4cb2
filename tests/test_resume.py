"""Exact resume of map-style loaders, checked from every checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import Augmented, count_decodes

import ledger
from ledger.testing import assert_resume_exact, take


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_exact_from_every_batch(root, num_workers, shuffle, drop_last):
    # 23 samples, batch 4: 6 batches per epoch (5 with drop_last): 14 batches span 3 epochs.
    def make():
        return ledger.DataLoader(
            Augmented(23),
            batch_size=4,
            shuffle=shuffle,
            seed=7,
            log=root,
            num_workers=num_workers,
            drop_last=drop_last,
        )

    checked = assert_resume_exact(make, batches=14)
    assert checked == 14


def test_stream_does_not_depend_on_num_workers(tmp_path):
    streams = []
    for nw in (0, 1, 3):
        loader = ledger.DataLoader(
            Augmented(50),
            batch_size=8,
            shuffle=True,
            seed=3,
            log=str(tmp_path / f"w{nw}"),
            num_workers=nw,
        )
        streams.append([b for b in take(loader, 10)])
    for other in streams[1:]:
        for a, b in zip(streams[0], other, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_other_num_workers(root):
    def make(nw):
        return ledger.DataLoader(
            Augmented(30), batch_size=4, shuffle=True, seed=1, log=root, num_workers=nw
        )

    first = make(2)
    reference = list(take(first, 12))
    first2 = make(2)
    list(take(first2, 5))
    token = first2.state_dict()
    resumed = make(0)
    resumed.load_state_dict(token)
    rest = list(take(resumed, 7))
    for got, want in zip(rest, reference[5:], strict=True):
        assert torch.equal(got["id"], want["id"]) and torch.equal(got["x"], want["x"])


def test_epochs_advance_and_cover_every_sample_once(root):
    loader = ledger.DataLoader(Augmented(10), batch_size=3, shuffle=True, seed=0, log=root)
    for epoch in range(3):
        assert loader.epoch == epoch
        ids = torch.cat([b["id"] for b in loader]).tolist()
        assert sorted(ids) == list(range(10))  # short last batch, no padding, no duplicate
    assert loader.epoch == 3


def test_drop_last_false_last_batch_is_short_and_real(root):
    loader = ledger.DataLoader(Augmented(10), batch_size=4, shuffle=False, log=root)
    sizes = [len(b["id"]) for b in loader]
    assert sizes == [4, 4, 2]


def test_batches_match_torch_dataloader(root):
    ds = Augmented(17)
    ours = ledger.DataLoader(ds, batch_size=5, shuffle=False, log=root, rng="off")
    theirs = torch.utils.data.DataLoader(ds, batch_size=5, shuffle=False)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a["id"], b["id"])


def test_loader_leaves_training_rng_alone(root):
    loader = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, log=root)
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    for _ in loader:
        pass
    assert torch.equal(torch.rand(5), expected)


def test_persistent_workers_give_the_same_stream(tmp_path):
    def stream(nw, persistent, sub):
        loader = ledger.DataLoader(
            Augmented(21),
            batch_size=4,
            shuffle=True,
            seed=5,
            log=str(tmp_path / sub),
            num_workers=nw,
            persistent_workers=persistent,
        )
        return [b for _ in range(3) for b in loader]

    plain = stream(0, False, "plain")
    persistent = stream(2, True, "persistent")
    assert len(plain) == len(persistent) == 18
    for a, b in zip(plain, persistent, strict=True):
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["x"], b["x"])


def test_resume_exact_with_persistent_workers(root):
    def make():
        return ledger.DataLoader(
            Augmented(13),
            batch_size=3,
            shuffle=True,
            seed=2,
            log=root,
            num_workers=2,
            persistent_workers=True,
        )

    assert assert_resume_exact(make, batches=12, every=2) == 6


def test_hugging_face_dataset(root):
    import datasets  # a dev dependency: CI never skips this

    ds = datasets.Dataset.from_dict(
        {"text": [f"doc {i}" for i in range(11)], "label": [i % 3 for i in range(11)]}
    )

    def make():
        return ledger.DataLoader(ds, batch_size=4, shuffle=True, seed=0, log=root)

    assert assert_resume_exact(make, batches=7) == 7
    texts = [t for b in ledger.DataLoader(ds, batch_size=4, log=root + "2") for t in b["text"]]
    assert texts == [f"doc {i}" for i in range(11)]


def test_resume_decodes_no_row_group(root, monkeypatch):
    """The final batch of a segment is a row group of its own (what a resume of a log
    without fingerprints decodes, tests/test_compat.py), and a resume of a marker that
    records the final batch's fingerprint decodes none, whatever the segment's size."""
    import glob

    import pyarrow.parquet as pq

    loader = ledger.DataLoader(Augmented(5000), batch_size=8, shuffle=True, seed=1, log=root)
    list(take(loader, 300))
    token = loader.state_dict()
    (path,) = glob.glob(f"{root}/events/**/*.parquet", recursive=True)
    meta = pq.ParquetFile(path).metadata
    assert meta.num_rows == 300 * 9  # 8 samples and a digest row per batch
    assert meta.row_group(meta.num_row_groups - 1).num_rows == 9
    decoded = count_decodes(monkeypatch)
    resumed = ledger.DataLoader(Augmented(5000), batch_size=8, shuffle=True, seed=1, log=root)
    resumed.load_state_dict(token)
    assert decoded == []
    expected = ledger.DataLoader(
        Augmented(5000), batch_size=8, shuffle=True, seed=1, log=root + "2"
    )
    list(take(expected, 300))
    from ledger.digest import batch_digest

    assert batch_digest(next(iter(resumed))) == batch_digest(next(iter(expected)))


def test_the_first_request_after_a_resume_takes_the_ids_the_check_computed(root, monkeypatch):
    """Replay checks the last logged batch against the order, and computes in the same
    call the ids of the first chunk of batches after it: the first batch after a resume
    costs no second pass of the order, and is the uninterrupted run's."""
    from ledger.digest import batch_digest
    from ledger.order import EpochOrder

    def make(where: str) -> ledger.DataLoader:
        return ledger.DataLoader(Augmented(200), batch_size=4, shuffle=True, seed=2, log=where)

    loader = make(root)
    list(take(loader, 10))
    token = loader.state_dict()
    calls: list[int] = []
    sample_ids = EpochOrder.sample_ids

    def counting(self, positions):
        calls.append(len(positions))
        return sample_ids(self, positions)

    monkeypatch.setattr(EpochOrder, "sample_ids", counting)
    resumed = make(root)
    resumed.load_state_dict(token)
    first = next(iter(resumed))
    assert calls == [4 + 40 * 4]  # the last batch and the rest of the epoch (its chunk)
    monkeypatch.setattr(EpochOrder, "sample_ids", sample_ids)
    expected = make(root + "2")
    assert batch_digest(first) == batch_digest(list(take(expected, 11))[-1])
