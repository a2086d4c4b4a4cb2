"""Content digest of a batch: one SHA-256 over what the training loop received.

The loader records the digest of every batch it hands out (a ``'batch'`` event), and
``ledger show --materialize`` recomputes it from the dataset and the recorded seeds, so
anyone can check that a batch re-created from the log is the batch the model saw.

The digest hashes a canonical encoding of the (nested) batch, not its pickle, so it does
not depend on the Python version, the process or the memory layout of a tensor:

- tensors and numpy arrays: a type tag, the dtype, the shape, then the elements as
  C-contiguous bytes in native (little-endian on every platform torch supports) order;
- ``Mapping``: its items ordered by ``str(key)``; ``list``/``tuple``: length then items;
- a dataclass instance (a batch class of one's own): its fields in declaration order,
  each name then value (the class's name is not part of it, as a mapping's type is not);
- ``str``/``bytes``: length then the UTF-8/raw bytes; ``int``, ``float`` (``float.hex``),
  ``bool``, ``None`` and numpy scalars by value;
- a sparse tensor: a tag, its layout, dtype and shape, then its index tensors and values
  as tensors (COO coalesced first: ``indices``, ``values``; CSR/BSR ``crow_indices``,
  ``col_indices``, ``values``; CSC/BSC ``ccol_indices``, ``row_indices``, ``values``).

A batch nested deeper than Python's recursion limit, one that holds itself, or a tensor
without data (on the ``meta`` device) cannot be digested: :class:`TypeError`, as for a
type not listed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

DIGEST_ALGORITHM = "sha256-canonical-v1"
"""Name of the encoding and hash below; recorded in ``run.json``."""


def batch_digest(batch: Any) -> str:
    """SHA-256 hex digest (64 characters) of a batch's content: :func:`digest_bytes` in hex."""
    return digest_bytes(batch).hex()


def digest_bytes(batch: Any) -> bytes:
    """SHA-256 digest (32 bytes) of a batch's content, as the log stores it.

    Args:
        batch: a collated batch: tensors (any dtype and shape, on any device), numpy
            arrays (not of ``object`` dtype), and mappings, lists, tuples and dataclass
            instances of them, of ``str``, ``bytes``, ``int``, ``float``, ``bool`` and
            ``None``.

    Returns:
        The 32-byte digest.

    Raises:
        TypeError: if the batch holds another type (a custom class), a tensor without
            data (``meta``), or itself (or nests deeper than the recursion limit); pass
            ``digest=False`` to the loader for such batches.
    """
    if type(batch) is torch.Tensor and batch.layout is _STRIDED:  # the common case, inlined:
        # ~4.5 µs for 2 KiB, ~2.5 of them SHA-256
        layout = _LAYOUTS.get((batch.dtype, batch.shape))
        if layout is None:
            layout = _layout(batch)
        if (
            batch.is_cpu
            and batch.is_contiguous()
            and not batch.is_neg()
            and not (layout.complex and batch.is_conj())
        ):
            address = batch.data_ptr()
            h = layout.prefix.copy()
            h.update(layout.buffers.get(address) or layout.memory(address))
            return h.digest()
    h = hashlib.sha256()
    try:
        _update(h, batch)
    except RecursionError:
        raise TypeError(
            "cannot digest a batch that holds itself or nests deeper than Python's "
            "recursion limit; pass digest=False to the DataLoader for such batches"
        ) from None
    return h.digest()


_STRIDED = torch.strided
_SPARSE_PARTS = {
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


class _Layout:
    """What a tensor's dtype and shape fix: its header, a SHA-256 already fed the header
    (copied per tensor: cheaper than a new hash object and an update), and buffers over
    the bytes of tensors of this layout.

    A buffer is a ``ctypes`` array at the tensor's address (the bytes ``t.numpy()`` would
    expose, at a fraction of its cost), kept by address: the allocator hands a batch's
    tensor the addresses of recent batches' again, so most batches find theirs (a dict
    lookup instead of a ~0.3 µs ``from_address``). A buffer is only used for a live
    tensor at its address, of its size.
    """

    __slots__ = ("buffers", "chars", "complex", "header", "prefix")

    def __init__(self, dtype: torch.dtype, shape: torch.Size, nbytes: int) -> None:
        self.header = f"T{dtype}{tuple(shape)}".encode()
        self.prefix = hashlib.sha256(self.header)
        self.chars: Any = ctypes.c_char * nbytes if nbytes else None  # None: no bytes
        self.complex = dtype.is_complex  # only a complex tensor can carry a conjugate bit
        self.buffers: dict[int, Any] = {}

    def memory(self, address: int) -> Any:
        """A buffer over this layout's bytes at ``address`` (of a live C-contiguous CPU
        tensor without a negative or conjugate bit)."""
        buffer = self.buffers.get(address)
        if buffer is None:
            if self.chars is None:
                return b""
            buffer = self.chars.from_address(address)
            if len(self.buffers) >= 64:
                self.buffers.clear()  # bounded: few addresses recur
            self.buffers[address] = buffer
        return buffer


_LAYOUTS: dict[tuple[torch.dtype, torch.Size], _Layout] = {}


def _layout(t: torch.Tensor) -> _Layout:
    key = (t.dtype, t.shape)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _Layout(t.dtype, t.shape, t.nbytes)
        if len(_LAYOUTS) < 4096:  # batches have few shapes; bound it anyway
            _LAYOUTS[key] = layout
    return layout


def _update(h: Any, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        if x.layout is not _STRIDED:
            _update_sparse(h, x)
            return
        if x.is_meta:
            raise TypeError(
                "cannot digest a tensor on the meta device (it holds no data); pass "
                "digest=False to the DataLoader for such batches"
            )
        layout = _layout(x)
        h.update(layout.header)
        if (
            x.is_cpu
            and x.is_contiguous()
            and not x.is_neg()
            and not (layout.complex and x.is_conj())
        ):
            h.update(layout.memory(x.data_ptr()))
            return
        try:  # a CPU tensor numpy can view (no grad, a numpy dtype)
            a = x.numpy()
        except (TypeError, RuntimeError):
            t = x.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            try:  # the same bytes either way; the first costs fewer torch calls
                a = t.resolve_conj().resolve_neg().numpy()
            except TypeError:  # a dtype numpy lacks (bfloat16, float8...)
                a = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        try:  # a C-contiguous array is hashed through its buffer, without a copy
            h.update(a)
        except (BufferError, ValueError, TypeError):
            h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    elif isinstance(x, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(x)
        if a.dtype.hasobject:
            raise TypeError(
                "cannot digest a numpy array of dtype object; pass digest=False to the "
                "DataLoader for such batches"
            )
        h.update(f"A{a.dtype.str}{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    elif isinstance(x, Mapping):
        items = sorted(x.items(), key=lambda kv: str(kv[0]))
        h.update(f"M{len(items)}".encode())
        for key, value in items:
            _update(h, key)
            _update(h, value)
    elif isinstance(x, (list, tuple)):
        h.update(f"{'L' if isinstance(x, list) else 'U'}{len(x)}".encode())
        for item in x:
            _update(h, item)
    elif isinstance(x, str):
        raw = x.encode()
        h.update(f"S{len(raw)}:".encode())
        h.update(raw)
    elif isinstance(x, (bytes, bytearray)):
        h.update(f"B{len(x)}:".encode())
        h.update(x)
    elif x is None or isinstance(x, bool):  # before int: bool is an int
        h.update(f"N{x}".encode())
    elif isinstance(x, int):
        h.update(f"I{x};".encode())
    elif isinstance(x, float):
        h.update(f"F{x.hex()};".encode())
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = dataclasses.fields(x)
        h.update(f"D{len(fields)}".encode())
        for f in fields:
            _update(h, f.name)
            _update(h, getattr(x, f.name))
    else:
        raise TypeError(
            f"cannot digest a batch holding {type(x).__module__}.{type(x).__qualname__}: "
            "batches of tensors, arrays, numbers, strings, lists, dicts and dataclasses "
            "can be digested; "
            "pass digest=False to the DataLoader for other batches"
        )


def _update_sparse(h: Any, x: torch.Tensor) -> None:
    """A sparse tensor: its layout, dtype and shape, then its index tensors and values."""
    if x.layout is torch.sparse_coo:
        t = x.detach().coalesce()
        parts = (t.indices(), t.values())
    elif x.layout in _SPARSE_PARTS:
        t = x.detach()
        parts = tuple(getattr(t, name)() for name in _SPARSE_PARTS[x.layout])
    else:
        raise TypeError(
            f"cannot digest a tensor of layout {x.layout}; pass digest=False to the "
            "DataLoader for such batches"
        )
    h.update(f"P{x.layout}{x.dtype}{tuple(x.shape)}".encode())
    for part in parts:
        _update(h, part)
