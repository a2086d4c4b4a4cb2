"""A dataset's ``__getitems__`` as torch's DataLoader treats it: its result reaches
``collate_fn`` unchanged, whatever it is; what ledger cannot log exactly is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import ledger
from ledger.errors import UnsupportedArgument
from ledger.mixture import Mixture
from ledger.testing import take


class _Columns(tud.Dataset):
    """``__getitems__`` returns one of several batch shapes a user's dataset may give."""

    def __init__(self, n: int, shape: str) -> None:
        self.n = n
        self.shape = shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        raise AssertionError("a dataset with __getitems__ is fetched a batch at a time")

    def __getitems__(self, ids: list[int]) -> object:
        if self.shape == "dict":  # columns, as a tokenizer's batch encoding
            return {"input_ids": [[i, i + 1] for i in ids], "labels": list(ids)}
        if self.shape == "tensor":
            return torch.tensor(ids) * 10 + torch.rand(len(ids))  # draws: seeded per batch
        if self.shape == "ndarray":
            return np.asarray(ids) * 10
        if self.shape == "tuple":
            return tuple(ids)
        raise AssertionError(self.shape)


def _identity(batch: object) -> object:
    return batch


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("shape", ["dict", "tensor", "ndarray", "tuple"])
@pytest.mark.parametrize("workers", [0, 2])
def test_what_getitems_returns_reaches_collate_fn_as_under_torch(tmp_path, shape, workers):
    """torch hands ``__getitems__``'s result to ``collate_fn`` unchanged; so does ledger,
    with the same seeds at 0 and 2 workers and after a resume."""
    args = dict(batch_size=4, shuffle=False, collate_fn=_identity, num_workers=workers)
    torch.manual_seed(5)
    want = list(tud.DataLoader(_Columns(10, shape), **args))
    # torch's own draws differ (its seeds are not ledger's): compare the draw-free part.
    loader = ledger.DataLoader(_Columns(10, shape), seed=3, log=str(tmp_path / "a"), **args)
    got = list(take(loader, 2))
    token = loader.state_dict()
    rest = list(loader)
    if shape == "tensor":
        assert all(torch.equal(g.floor(), w.floor()) for g, w in zip(got + rest, want, strict=True))
    else:
        assert all(_same(g, w) for g, w in zip(got + rest, want, strict=True))
    # Another worker count and a resume give the very same batches (draws included).
    again = ledger.DataLoader(
        _Columns(10, shape), seed=3, log=str(tmp_path / "a"), **{**args, "num_workers": 2 - workers}
    )
    again.load_state_dict(token)
    assert all(_same(g, w) for g, w in zip(list(again), rest, strict=True))


class _FailingColumns(_Columns):
    def __getitems__(self, ids: list[int]) -> object:
        if 3 in ids and len(ids) > 1:
            raise ValueError("one bad id fails the call")
        return super().__getitems__(ids)


def test_skip_errors_needs_a_list_to_split_a_failed_batch(root):
    """``on_error="skip"`` retries a failed ``__getitems__`` one id at a time; a batch of
    columns cannot be split into the samples that loaded: a typed error, not a batch of
    keys."""
    loader = ledger.DataLoader(_FailingColumns(8, "dict"), batch_size=4, log=root, on_error="skip")
    with pytest.raises(UnsupportedArgument, match="list of one sample, got dict"):
        list(loader)


class _Rows(tud.Dataset):
    def __init__(self, n: int, base: int, columns: bool = False) -> None:
        self.n, self.base, self.columns = n, base, columns

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"id": torch.tensor(self.base + i)}

    def __getitems__(self, ids: list[int]) -> object:
        if self.columns:
            return {"id": [self.base + i for i in ids]}
        return [self[i] for i in ids]


def test_a_mixture_source_must_return_a_list_from_getitems(root):
    """A mixture interleaves its sources' samples, so each source's ``__getitems__`` must
    give one sample per id: a dict of columns (whose keys would pass for samples) is
    refused by name."""
    mix = Mixture(
        {"code": _Rows(13, 0), "web": _Rows(29, 1000, columns=True)},
        weights={"code": 0.4, "web": 0.6},
    )
    loader = ledger.DataLoader(mix, batch_size=5, shuffle=True, seed=8, log=root)
    with pytest.raises(UnsupportedArgument, match="mixture source 'web' returned dict"):
        list(take(loader, 3))
