"""How a worker's batches reach the main process: small tensors by value.

torch's workers send every tensor of a batch through shared memory
(:mod:`torch.multiprocessing`'s ``file_descriptor`` strategy): the worker moves the
tensor's storage into a new shared-memory file, and the main process, unpickling it, asks
the worker's resource-sharer thread for its descriptor over a Unix socket and maps it.
That costs both processes a few hundred microseconds of CPU *per tensor*, whatever its
size: for a batch of 256 ``int64`` (2 KiB) it is most of what a worker and the training
loop do per batch. Copying the bytes with the batch's pickle through the data queue's pipe
costs a few microseconds per KiB instead, so below some size copying wins.

In ledger's workers (:func:`install`, run by the loader's worker init before the user's
``worker_init_fn``) a tensor of fewer than ``limit`` bytes travels by value: its bytes, dtype
and shape; the main process rebuilds a tensor of its own (:func:`rebuild`). Every other
tensor takes torch's way (:func:`torch.multiprocessing.reductions.reduce_tensor`): one that
requires grad, is not a plain strided CPU tensor (sparse, quantized, named, a subclass),
is not C-contiguous, carries a conjugate or negative bit, or shares its storage with
another tensor (views of one storage keep sharing it, as with torch). A tensor that
``default_collate`` stacked in a worker already lives in shared memory (torch allocates it
there to spare the move), yet the main process still fetches its descriptor: it is copied
too. The batch's values, dtypes and shapes are the same either way; a tensor that came by
value is not in shared memory (``is_shared()`` is ``False``) and is C-contiguous.

Measured by ``python tools/bench.py --transport`` on this project's 2-core machine (2
workers, a batch of one float32 tensor, µs per batch, median of 3 runs of up to 1,500
batches, load ~2): 2 KiB 284 by value against 678 through shared memory, 64 KiB 341
against 541, 128 KiB 527 against 690, 256 KiB 671 against 807, 768 KiB 1,401 against
1,139, 2 MiB 3,385 against 1,841 (the pipe holds 64 KiB: above it the worker and the main
process take turns): hence the default limit of 256 KiB per tensor
(:data:`COPY_BELOW_BYTES`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import partial
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

COPY_BELOW_BYTES = 256 * 1024
"""Default of ``copy_below_bytes``: tensors of fewer bytes travel by value."""

_STRIDED = torch.strided
_use_count: Callable[[Any], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def install(limit: int) -> None:
    """Send tensors of fewer than ``limit`` bytes by value from this process (a worker)
    through :class:`multiprocessing.reduction.ForkingPickler` (the data queue's pickler).

    Args:
        limit: bytes; ``0`` leaves torch's shared-memory transport for every tensor.
    """
    if limit > 0:
        ForkingPickler.register(torch.Tensor, partial(reduce, limit))


def reduce(limit: int, t: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The pickle reduction of ``t``: :func:`rebuild` and ``(dtype, shape, bytes)`` for a
    small tensor that can travel by value (see the module's docstring), else torch's.

    Args:
        limit: bytes; tensors of ``limit`` bytes or more take torch's shared memory.
        t: the tensor being pickled.
    """
    try:
        if _by_value(limit, t):
            data = ctypes.string_at(t.data_ptr(), t.nbytes) if t.nbytes else b""
            return rebuild, (t.dtype, tuple(t.shape), data)
    except Exception:  # never fail here: the queue's feeder thread would die silently
        pass  # and the main process wait for the batch forever; torch's way then
    return reduce_tensor(t)


def _by_value(limit: int, t: torch.Tensor) -> bool:
    return (
        t.nbytes < limit
        and t.layout is _STRIDED
        and t.is_cpu
        and not t.requires_grad
        and not t.is_quantized
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and _use_count is not None
        # The tensor's impl and the wrapper made here: no other tensor shares the storage.
        and _use_count(t.untyped_storage()._cdata) <= 2
        # A named tensor (a prototype of older torch releases) keeps its names torch's way.
        and not any(getattr(t, "names", None) or ())
    )


def rebuild(dtype: torch.dtype, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    """A new C-contiguous CPU tensor of ``dtype`` and ``shape`` holding ``data``.

    Raises:
        ValueError: if ``data`` is not the tensor's size in bytes.
    """
    t = torch.empty(shape, dtype=dtype)
    if len(data) != t.nbytes:
        raise ValueError(f"{len(data)} bytes for a {dtype} tensor of shape {shape}")
    if data:
        ctypes.memmove(t.data_ptr(), data, len(data))
    return t
