"""Checks for users and for ledger's own tests: resume anywhere, get the same stream.

In the spirit of Grain's checkpoint checker: run a loader once, checkpointing after every
batch, then resume a fresh loader from each checkpoint and require the rest of its
stream to equal the uninterrupted one element by element.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ledger.loader import DataLoader


def flatten(batch: Any) -> list[Any]:
    """Turn a collated batch into a flat list of comparable leaves (numpy arrays, scalars).

    Tensors become numpy arrays with their dtype; mappings are walked in key order.
    """
    out: list[Any] = []
    if isinstance(batch, torch.Tensor):
        out.append((str(batch.dtype), tuple(batch.shape), batch.detach().cpu().numpy()))
    elif isinstance(batch, np.ndarray):
        out.append((str(batch.dtype), batch.shape, batch))
    elif isinstance(batch, Mapping):
        for key in sorted(batch, key=str):
            out.append(("key", str(key)))
            out.extend(flatten(batch[key]))
    elif isinstance(batch, (list, tuple)):
        out.append(("seq", len(batch)))
        for item in batch:
            out.extend(flatten(item))
    else:
        out.append(batch)
    return out


def batches_equal(a: Any, b: Any) -> bool:
    """Whether two collated batches are equal element by element (dtype and shape too)."""
    fa, fb = flatten(a), flatten(b)
    if len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb, strict=True):
        if isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], np.ndarray):
            if not (isinstance(y, tuple) and len(y) == 3 and x[:2] == y[:2]):
                return False
            if not np.array_equal(x[2], y[2], equal_nan=x[2].dtype.kind == "f"):
                return False
        elif x != y:
            return False
    return True


def take(loader: DataLoader, count: int) -> Iterator[Any]:
    """The next ``count`` batches of ``loader``, crossing epoch boundaries as needed."""
    taken = 0
    while taken < count:
        served = 0
        for batch in loader:
            yield batch
            served += 1
            taken += 1
            if taken == count:
                return
        if served == 0:
            raise AssertionError("the loader served an empty epoch")


def assert_resume_exact(
    make_loader: Callable[[], DataLoader],
    *,
    batches: int,
    every: int = 1,
    resume_at: Sequence[int] | None = None,
) -> int:
    """Assert that resuming from any checkpoint continues the stream exactly.

    Runs ``make_loader()`` for ``batches`` batches, calling ``state_dict()`` after every
    ``every``-th batch (the token is round-tripped through ``torch.save`` /
    ``torch.load(weights_only=True)``). Then, for each saved token, builds a fresh loader
    with ``make_loader()``, calls ``load_state_dict`` and asserts the remaining batches
    equal the uninterrupted ones. All loaders must log to the same root.

    Args:
        make_loader: builds a fresh loader with identical arguments.
        batches: length of the uninterrupted stream (batches; may span epochs).
        every: checkpoint period (batches).
        resume_at: resume only from the checkpoints after these batch counts.

    Returns:
        The number of resumes checked.

    Raises:
        AssertionError: naming the checkpoint and the first differing batch.
    """
    import io

    reference: list[Any] = []
    tokens: list[tuple[int, dict[str, Any]]] = []
    loader = make_loader()
    for batch in take(loader, batches):
        reference.append(batch)
        if len(reference) % every == 0:
            buf = io.BytesIO()
            torch.save(loader.state_dict(), buf)
            buf.seek(0)
            tokens.append((len(reference), torch.load(buf, weights_only=True)))
    if len(reference) != batches:
        raise AssertionError(f"the loader served {len(reference)} batches, not {batches}")
    wanted = set(resume_at) if resume_at is not None else None
    checked = 0
    for done, token in tokens:
        if wanted is not None and done not in wanted:
            continue
        resumed = make_loader()
        resumed.load_state_dict(token)
        rest = list(take(resumed, batches - done))
        for i, (got, want) in enumerate(zip(rest, reference[done:], strict=False)):
            if not batches_equal(got, want):
                raise AssertionError(
                    f"resumed after batch {done}: batch {done + i} differs from the "
                    f"uninterrupted run:\n got  {got!r}\n want {want!r}"
                )
        if len(rest) != batches - done:
            raise AssertionError(
                f"resumed after batch {done}: got {len(rest)} batches, want {batches - done}"
            )
        checked += 1
    return checked
