"""The batch content digest: a pinned encoding, independent of layout and key order."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import torch

import ledger
import ledger.audit
from ledger.digest import batch_digest


def _batch():
    return {
        "x": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "id": torch.tensor([3, 1]),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "s": torch.tensor(7),
        "t": ["a", "é"],
        "n": (None, True, 2, 0.1, b"\x00"),
        "a": np.arange(3, dtype=np.int16),
    }


def test_digest_of_a_fixed_batch_never_changes():
    # Pinned: logs written by earlier versions must still verify with `show --materialize`.
    assert batch_digest(_batch()) == (
        "cf9a115db0b9332b9c87e315c30c88fe5e871147b85285e477258673b9e8c30a"
    )


def test_digest_of_a_tensor_is_sha256_of_its_header_and_bytes():
    t = torch.tensor([1, 2, 3], dtype=torch.int64)
    expected = hashlib.sha256(b"Ttorch.int64(3,)" + np.array([1, 2, 3], "<i8").tobytes())
    assert batch_digest(t) == expected.hexdigest()


def test_layout_and_key_order_do_not_matter_content_does():
    m = torch.arange(12).reshape(3, 4)
    assert not m.t().is_contiguous()
    assert batch_digest(m.t()) == batch_digest(m.t().contiguous())
    assert batch_digest({"a": m, "b": 1}) == batch_digest({"b": 1, "a": m})
    assert batch_digest(m) != batch_digest(m.reshape(4, 3))  # shape is part of it
    assert batch_digest(m) != batch_digest(m.to(torch.int32))  # so is the dtype
    assert batch_digest(m) != batch_digest(m.numpy())  # a tensor is not an array
    assert batch_digest([1, 2]) != batch_digest((1, 2))
    changed = _batch()
    changed["b"][1] = -2.5
    assert batch_digest(changed) != batch_digest(_batch())


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    label: int


def test_a_dataclass_batch_is_its_fields_in_order():
    t = torch.tensor([1, 2], dtype=torch.int64)
    h = hashlib.sha256(b"D2" + b"S1:x" + b"Ttorch.int64(2,)" + np.array([1, 2], "<i8").tobytes())
    h.update(b"S5:label" + b"I7;")
    assert batch_digest(_Batch(t, 7)) == h.hexdigest()
    assert batch_digest(_Batch(t, 8)) != batch_digest(_Batch(t, 7))
    assert batch_digest([_Batch(t, 7)]) != batch_digest([{"x": t, "label": 7}])


def test_a_dataclass_batch_is_served_digested_and_resumed(tmp_path):
    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return i

    def collate(ids):
        return _Batch(torch.tensor(ids), len(ids))

    def loader():
        return ledger.DataLoader(
            Samples(), batch_size=4, shuffle=True, seed=3, log=str(tmp_path), collate_fn=collate
        )

    first = loader()
    it = iter(first)
    seen = next(it)
    token = first.state_dict()
    rest = [b.x.tolist() for b in it]
    resumed = loader()
    resumed.load_state_dict(token)
    assert [b.x.tolist() for b in resumed] == rest
    assert isinstance(seen, _Batch)
    con = ledger.audit.connect(str(tmp_path))
    logged = con.sql("SELECT digest FROM events WHERE kind = 'batch' AND batch = 0").fetchall()
    assert [bytes(d) for (d,) in logged] == [bytes.fromhex(batch_digest(seen))]


def test_an_undigestable_batch_is_a_type_error():
    class Custom:
        pass

    with pytest.raises(TypeError, match="digest=False"):
        batch_digest({"x": Custom()})
    with pytest.raises(TypeError, match=r"object.*digest=False"):
        batch_digest(np.array([object()]))
    with pytest.raises(TypeError, match=r"meta device.*digest=False"):
        batch_digest({"x": torch.empty(3, device="meta")})
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(TypeError, match=r"holds itself.*digest=False"):
        batch_digest(loop)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_batch_is_digested_by_its_indices_and_values():
    """A sparse tensor is its layout, dtype, shape, index tensors and values: the same
    content gives the same digest however it was built (a COO tensor coalesced or not),
    another value, index, shape or layout another one (before: torch's RuntimeError
    about ``nbytes`` out of the loader)."""
    dense = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 4.0]])
    coo = dense.to_sparse()
    built = torch.sparse_coo_tensor([[1, 0, 1, 1], [2, 1, 0, 2]], [1.0, 2.0, 3.0, 3.0], (2, 3))
    assert not built.is_coalesced()
    assert batch_digest(built) == batch_digest(coo)  # 1 + 3 at (1, 2): the same content
    assert batch_digest([coo]) == batch_digest([coo.coalesce()])
    assert batch_digest(coo) != batch_digest(dense)
    assert batch_digest(coo) != batch_digest((dense * 2).to_sparse())
    assert batch_digest(coo) != batch_digest(dense.t().contiguous().to_sparse())
    assert batch_digest(coo) != batch_digest(torch.cat([dense, dense * 0]).to_sparse())
    layouts = {
        batch_digest(dense.to_sparse_csr()),
        batch_digest(dense.to_sparse_csc()),
        batch_digest(coo),
        batch_digest(dense.to_sparse_bsr((1, 1))),
    }
    assert len(layouts) == 4
    assert batch_digest(dense.to_sparse_csr()) == batch_digest(dense.clone().to_sparse_csr())
    assert batch_digest(dense.to_sparse_csr()) != batch_digest((dense + 1).to_sparse_csr())


def test_every_tensor_path_hashes_the_same_content():
    """The fast path (``Tensor.numpy``) and the fallbacks agree: a tensor that requires
    grad, a conjugated or negated view, a bfloat16 tensor."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert batch_digest(x.clone().requires_grad_(True)) == batch_digest(x)
    z = torch.complex(x, -x)
    assert batch_digest(z.conj()) == batch_digest(z.conj().resolve_conj())
    assert batch_digest(x.to(torch.bfloat16)) == batch_digest(x.to(torch.bfloat16).clone())
    expected = hashlib.sha256(
        b"Ttorch.bfloat16(2, 3)" + x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    )
    assert batch_digest(x.to(torch.bfloat16)) == expected.hexdigest()


def test_the_raw_memory_path_hashes_what_numpy_would():
    """A contiguous CPU tensor is hashed through its memory, not ``Tensor.numpy``: a view
    at an offset into its storage, an empty tensor and views with a lazy negative or
    conjugate bit (whose memory is not their values) hash their values, alone or inside a
    batch."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    row = x[1]
    expected = hashlib.sha256(b"Ttorch.float32(3,)" + np.float32([3, 4, 5]).tobytes())
    assert batch_digest(row) == expected.hexdigest()
    assert batch_digest(torch.zeros(0)) == hashlib.sha256(b"Ttorch.float32(0,)").hexdigest()
    for lazy in (torch._neg_view(x), torch.complex(x, x).conj()):  # contiguous, lazy
        assert lazy.is_contiguous() and (lazy.is_neg() or lazy.is_conj())
        plain = lazy.resolve_neg().resolve_conj()
        assert batch_digest(lazy) == batch_digest(plain)
        assert batch_digest([lazy]) == batch_digest([plain])


def test_a_tensor_at_a_recycled_address_hashes_its_own_bytes():
    """Buffers over tensor memory are kept by address: a new tensor (or new content) at an
    address seen before is hashed from its own bytes."""
    t = torch.arange(256)
    first = batch_digest(t)
    t.add_(1)
    expected = hashlib.sha256(b"Ttorch.int64(256,)" + np.arange(1, 257, dtype="<i8").tobytes())
    assert batch_digest(t) == expected.hexdigest() != first
    for _ in range(100):  # the allocator often returns a freed batch's address
        fresh = torch.full((256,), 7)
        want = hashlib.sha256(b"Ttorch.int64(256,)" + np.full(256, 7, "<i8").tobytes())
        assert batch_digest(fresh) == want.hexdigest()
        del fresh
