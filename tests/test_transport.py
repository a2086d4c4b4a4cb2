"""Small tensors travel from ledger's workers by value (ledger.transport)."""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import reduce_tensor

import ledger
from ledger import transport
from ledger.errors import UnsupportedArgument

_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
    *(getattr(torch, name) for name in ("uint16", "uint32", "uint64", "float8_e4m3fn")
      if hasattr(torch, name)),
]  # fmt: skip


def _bits(t: torch.Tensor) -> bytes:
    """The tensor's bytes (NaN payloads and -0.0 included: compared bit for bit)."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(_DTYPES),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_small_tensor_is_rebuilt_bit_for_bit(dtype: torch.dtype, shape: Any, seed: int) -> None:
    size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    raw = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    # A tensor of its own (a view would share its base's storage: torch's way then).
    t = (
        torch.from_numpy(raw).view(dtype).reshape(shape).clone()
        if size
        else torch.empty(shape, dtype=dtype)
    )
    fn, args = transport.reduce(1 << 20, t)
    assert fn is transport.rebuild
    got = fn(*args)
    assert got.dtype == dtype and got.shape == t.shape and got.is_contiguous()
    assert _bits(got) == _bits(t)
    assert got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() or t.numel() == 0


def _torch_way(t: torch.Tensor, limit: int = 1 << 20) -> bool:
    fn, _ = transport.reduce(limit, t)
    return fn is not transport.rebuild and fn is reduce_tensor(t)[0]


def test_what_travels_torchs_way() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).clone()  # no base
    assert not _torch_way(x)
    assert _torch_way(x, limit=x.nbytes)  # not fewer bytes than the limit
    assert not _torch_way(x, limit=x.nbytes + 1)
    assert _torch_way(x.t())  # not C-contiguous
    assert _torch_way(torch.ones(3, requires_grad=True))
    assert _torch_way(torch.ones(3, dtype=torch.complex64).conj())  # a conjugate bit
    assert _torch_way(torch._neg_view(torch.ones(3, dtype=torch.complex64)))  # a negative bit
    assert _torch_way(torch.ones(3).to_sparse())
    assert _torch_way(x[1])  # a view: its storage is x's
    v = x.view(-1)  # x and v share one storage: both keep sharing it
    assert _torch_way(x) and _torch_way(v)
    del v
    assert not _torch_way(x)


def test_a_check_that_raises_falls_back_to_torchs_way(monkeypatch: pytest.MonkeyPatch) -> None:
    # The queue's feeder thread pickles the batch: an exception there would kill it
    # silently and leave the training loop waiting forever.
    def broken(_: Any) -> int:
        raise RuntimeError("no use count")

    monkeypatch.setattr(transport, "_use_count", broken)
    assert _torch_way(torch.ones(3))


def test_rebuild_refuses_bytes_of_another_size() -> None:
    with pytest.raises(ValueError, match=r"3 bytes for a torch\.float32 tensor of shape"):
        transport.rebuild(torch.float32, (2,), b"abc")
    assert transport.rebuild(torch.int64, (0, 3), b"").shape == (0, 3)


class _Pairs:
    """Samples of a small and a large tensor (a batch of 4: 64 B and 1.6 MB)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"small": torch.full((2,), float(i)), "big": torch.full((100_000,), float(i))}


def _aliased(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    x = tud.default_collate(samples)["small"]
    return {"x": x, "flat": x.view(-1)}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_send_small_tensors_by_value_and_large_ones_in_shared_memory(
    tmp_path: Any, context: str
) -> None:
    expected = [tud.default_collate([_Pairs()[i] for i in range(k, k + 4)]) for k in (0, 4, 8, 12)]
    loader = ledger.DataLoader(
        _Pairs(), batch_size=4, num_workers=2, log=tmp_path / "a", multiprocessing_context=context
    )
    with loader:
        got = list(loader)
    assert len(got) == 4
    for batch, want in zip(got, expected, strict=True):
        assert not batch["small"].is_shared() and batch["big"].is_shared()
        assert torch.equal(batch["small"], want["small"]) and torch.equal(batch["big"], want["big"])
    with ledger.DataLoader(_Pairs(), batch_size=4, num_workers=2, log=tmp_path / "b",
                           copy_below_bytes=0) as loader:  # fmt: skip
        assert all(b["small"].is_shared() and b["big"].is_shared() for b in loader)
    with ledger.DataLoader(_Pairs(), batch_size=4, num_workers=1, log=tmp_path / "c",
                           collate_fn=_aliased) as loader:  # fmt: skip
        for b in loader:  # views of one storage arrive sharing it, as with torch
            assert b["x"].is_shared() and b["flat"].is_shared()
            assert b["x"].untyped_storage().data_ptr() == b["flat"].untyped_storage().data_ptr()


@pytest.mark.parametrize("bad", [-1, 1.5, "64k", True])
def test_copy_below_bytes_must_be_a_count(tmp_path: Any, bad: Any) -> None:
    with pytest.raises(UnsupportedArgument, match="copy_below_bytes must be an int >= 0"):
        ledger.DataLoader(_Pairs(), batch_size=4, log=tmp_path, copy_below_bytes=bad)
