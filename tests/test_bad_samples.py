"""on_error="skip": bad samples left out of their batch, logged, deterministic, exact."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ledger
from ledger.audit import connect
from ledger.audit.queries import materialize
from ledger.errors import SampleError, UnsupportedArgument
from ledger.order import EpochOrder
from ledger.testing import assert_resume_exact, batches_equal, take

BAD = {3, 10, 11, 17}
N, B = 23, 4


class Flaky:
    """Map-style dataset whose samples in ``bad`` raise; the others draw from torch's RNG
    (so a failure that shifted the draws of its batch-mates would show)."""

    def __init__(self, n: int = N, bad: set[int] = BAD) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.rand(2)
        if i in self.bad:
            raise ValueError(f"corrupt record {i}")
        return {"id": torch.tensor(i), "x": x}


class FlakyBatched(Flaky):
    """The same with a batched ``__getitems__`` (as HF datasets): one bad id fails it all."""

    def __getitems__(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in ids]


def _loader(root, dataset=None, **kw):
    kw = {"batch_size": B, "shuffle": True, "seed": 7, "log": root, "on_error": "skip", **kw}
    return ledger.DataLoader(dataset if dataset is not None else Flaky(), **kw)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dataset", [Flaky, FlakyBatched])
def test_bad_samples_are_left_out_and_logged(root, workers, dataset):
    loader = _loader(root, dataset(), num_workers=workers)
    batches = list(take(loader, 12))  # two epochs of 6 batches
    loader.state_dict()
    for epoch in range(2):
        order = EpochOrder(N, 7, epoch, True).sample_ids(np.arange(N))
        for k in range(6):
            want = [i for i in order[k * B : (k + 1) * B].tolist() if i not in BAD]
            assert batches[epoch * 6 + k]["id"].tolist() == want
    con = connect(root)
    rows = con.sql(
        "select epoch, batch, position, sample_id, value from lineage where kind = 'error' "
        "order by batch, position"
    ).fetchall()
    assert sorted((e, s) for e, _, _, s, _ in rows) == [
        (e, s) for e in range(2) for s in sorted(BAD)
    ]
    for epoch, batch, position, sid, value in rows:
        assert EpochOrder(N, 7, epoch, True).sample_ids(np.array([position]))[0] == sid
        assert batch == epoch * 6 + position // B
        assert json.loads(value) == {"type": "ValueError", "message": f"corrupt record {sid}"}


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_with_bad_samples(tmp_path, workers):
    root = str(tmp_path / "log")
    checked = assert_resume_exact(
        # verify_data: each resume re-creates its last batch, bad samples and all
        lambda: _loader(root, FlakyBatched(), num_workers=workers, verify_data=True),
        batches=14,
        every=3,
    )
    assert checked == 4


def test_same_draws_on_every_run(tmp_path):
    a = list(take(_loader(str(tmp_path / "a")), 6))
    b = list(take(_loader(str(tmp_path / "b"), num_workers=2), 6))
    assert all(batches_equal(x, y) for x, y in zip(a, b, strict=True))


def test_raise_is_the_default(root):
    loader = ledger.DataLoader(Flaky(), batch_size=B, shuffle=False, seed=7, log=root)
    with pytest.raises(ValueError, match="corrupt record 3"):
        list(loader)


def test_a_batch_of_bad_samples_raises_sample_error(root):
    loader = _loader(root, Flaky(bad={4, 5, 6, 7}), shuffle=False)
    with pytest.raises(
        SampleError, match=r"every sample of batch 1 .*ValueError: corrupt record 4"
    ):
        list(loader)


@pytest.mark.parametrize("dataset", [Flaky, FlakyBatched])
def test_materialize_recreates_a_batch_with_a_bad_sample(root, dataset):
    loader = _loader(root, dataset())
    batches = list(take(loader, 6))
    loader.state_dict()
    con = connect(root)
    errors = con.sql("select distinct batch from lineage where kind = 'error'").fetchall()
    assert len(errors) == 3  # 10 and 11 share a batch
    for (batch,) in errors:  # bad samples first, last and in the middle of their batch
        made = materialize(root, batch, dataset(), rank=0)
        assert made.matches
        assert torch.equal(made.data["x"], batches[batch]["x"])


def test_streams_refuse_skip(root, tmp_path):
    from conftest import packed_stream

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.jsonl").write_text('{"text": "abc"}\n' * 8)
    with pytest.raises(UnsupportedArgument, match="not supported for a Stream"):
        ledger.DataLoader(
            packed_stream(str(shards), 2), batch_size=2, seed=1, log=root, on_error="skip"
        )


def test_on_error_is_validated(root):
    with pytest.raises(ValueError, match="on_error must be"):
        ledger.DataLoader(Flaky(), batch_size=B, seed=1, log=root, on_error="ignore")


def test_a_mixture_leaves_out_bad_samples_of_a_source(tmp_path):
    from ledger.mixture import Mixture

    def make():
        mix = Mixture({"good": Flaky(11, set()), "bad": FlakyBatched(13, {2, 7})},
                      weights={"good": 0.5, "bad": 0.5})  # fmt: skip
        return _loader(str(tmp_path / "log"), mix, num_workers=2, verify_data=True)

    assert assert_resume_exact(make, batches=10, every=3) == 3
    con = connect(str(tmp_path / "log"))
    rows = con.sql(
        "select source, sample_id, value from lineage where kind = 'error' order by batch"
    ).fetchall()
    assert {(s, i) for s, i, _ in rows} == {("bad", 2), ("bad", 7)}
    assert all(json.loads(v)["message"] == f"corrupt record {i}" for _, i, v in rows)
