"""torch's DataLoader arguments, translated into ledger's or refused with what to do instead.

``ledger.DataLoader`` takes torch's arguments in torch's order so that it drops in. ledger
orders each epoch itself (a seeded bijection it can evaluate at any position, which is
what makes a resume exact without replaying the epoch), so an argument that would hand
the order to other code is accepted only where it is one of torch's own orders that
ledger's configuration expresses: ``SequentialSampler`` (``shuffle=False``),
``RandomSampler`` without replacement (``shuffle=True``; its generator seeds the run),
``DistributedSampler`` (its replicas, rank, shuffle and seed) and a ``BatchSampler`` over
one of those. Everything else raises :class:`ledger.errors.UnsupportedArgument` with a
sentence saying what ledger does instead.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data as tud

from ledger.errors import UnsupportedArgument

_SEED_MASK = (1 << 63) - 1  # seeds are stored as BIGINT in the audit views


@dataclass(frozen=True, slots=True)
class LoaderArgs:
    """ledger's reading of a torch-style argument list.

    Attributes:
        batch_size: samples per batch on this rank.
        shuffle: whether epochs use the seeded permutation.
        drop_last: whether a short final batch is dropped.
        seed: the run's seed.
        seed_from_torch: the seed is ``torch.initial_seed()`` (no ``seed``, ``generator``
            or seeded sampler was given), so a resume needs the same ``torch.manual_seed``.
        rank, world_size: ``None`` where neither the caller nor a sampler gave them.
    """

    batch_size: int
    shuffle: bool
    drop_last: bool
    seed: int
    seed_from_torch: bool
    rank: int | None
    world_size: int | None


def _generator_seed(generator: Any, what: str) -> int:
    if not isinstance(generator, torch.Generator):
        raise UnsupportedArgument(
            f"{what} must be a torch.Generator, got {type(generator).__name__}"
        )
    # The seed it was created or manual_seed()-ed with; ledger draws nothing from it.
    return int(generator.initial_seed()) & _SEED_MASK


def _seed(seed: Any) -> int:
    """``seed`` as an int, if it is an integer torch.manual_seed takes (numpy integers
    too); a float or string would otherwise be truncated or parsed without a word."""
    try:
        value = operator.index(seed)
    except TypeError:
        value = None
    if value is None or isinstance(seed, bool) or not -(1 << 63) <= value < 1 << 64:
        raise UnsupportedArgument(
            f"seed must be an integer in [-2**63, 2**64), got {seed!r} ({type(seed).__name__})"
        )
    return value


def count(name: str, value: Any, low: int) -> int:
    """``value`` as an int, if it is an integer >= ``low`` (numpy integers too).

    Raises:
        UnsupportedArgument: naming ``name`` and the value, otherwise.
    """
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < low:
        raise UnsupportedArgument(f"{name} must be an int >= {low}, got {value!r}")
    return number


def worker_options(
    num_workers: int, prefetch_factor: Any, timeout: Any
) -> tuple[int | None, float]:
    """``prefetch_factor`` and ``timeout`` checked by torch's rules when the loader is made,
    not when its first iterator starts its workers (where torch 2.13 asserts on
    ``prefetch_factor=0`` and takes a float one as far as ``range()``).

    Returns:
        ``(prefetch_factor, timeout)``: an int >= 1 or ``None``, and a float >= 0 (seconds).

    Raises:
        UnsupportedArgument: ``prefetch_factor`` not ``None`` nor an int >= 1, or given with
            ``num_workers=0``; ``timeout`` not a real number >= 0.
    """
    if prefetch_factor is not None:
        prefetch_factor = count("prefetch_factor", prefetch_factor, 1)
        if num_workers == 0:
            raise UnsupportedArgument(
                f"prefetch_factor={prefetch_factor} needs worker processes: with num_workers=0 "
                "leave prefetch_factor=None (torch's rule)"
            )
    seconds = float(timeout) if isinstance(timeout, numbers.Real) else math.nan
    if isinstance(timeout, bool) or not 0 <= seconds < math.inf:
        raise UnsupportedArgument(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    return prefetch_factor, seconds


def _check_dataset(dataset: Any) -> None:
    from ledger.stream.spec import Stream

    if isinstance(dataset, Stream):
        return
    if isinstance(dataset, tud.IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    ):
        raise UnsupportedArgument(
            f"{type(dataset).__name__} is an iterable dataset: ledger.DataLoader takes a "
            "map-style dataset (__len__ and __getitem__), or a ledger.stream.Stream for "
            "sharded data read in order (ledger.stream.ShardedSource over Parquet/JSONL "
            "files, with a shuffle buffer and packing), which ledger can resume exactly"
        )
    if isinstance(dataset, Mapping) and len(dataset) and 0 not in dataset:
        keys = ", ".join(repr(k) for k in itertools.islice(dataset, 5))
        raise UnsupportedArgument(
            f"{type(dataset).__name__} is a mapping without the key 0 (its keys: {keys}"
            f"{', ...' if len(dataset) > 5 else ''}): ledger.DataLoader takes a map-style "
            "dataset indexed 0 .. len - 1; for a datasets.DatasetDict pass one split, e.g. "
            "dataset['train']"
        )


def _from_sampler(sampler: Any, dataset: Any) -> tuple[bool, int | None, int | None, int | None]:
    """``(shuffle, seed, rank, world_size)`` a torch sampler stands for, or a refusal."""
    if isinstance(sampler, tud.SequentialSampler):
        _check_sampled_length(sampler, sampler.data_source, dataset)
        return False, None, None, None
    if isinstance(sampler, tud.RandomSampler):
        if sampler.replacement or sampler.num_samples != len(dataset):
            raise UnsupportedArgument(
                "RandomSampler with replacement or num_samples is not supported: ledger "
                "serves each sample once per epoch in a seeded order (shuffle=True, seed=...); "
                "to draw a subset, pass torch.utils.data.Subset(dataset, indices)"
            )
        seed = None
        if sampler.generator is not None:
            seed = _generator_seed(sampler.generator, "RandomSampler's generator")
        return True, seed, None, None
    if isinstance(sampler, tud.DistributedSampler):
        _check_sampled_length(sampler, sampler.dataset, dataset)
        return (
            bool(sampler.shuffle),
            int(sampler.seed) & _SEED_MASK,
            int(sampler.rank),
            int(sampler.num_replicas),
        )
    name = type(sampler).__name__
    hint = {
        "SubsetRandomSampler": "pass torch.utils.data.Subset(dataset, indices) with shuffle=True",
        "WeightedRandomSampler": "sampling with replacement by weight cannot be resumed from "
        "a position; repeat or subset indices with torch.utils.data.Subset instead",
    }.get(name, "pass shuffle=True and seed=... (or a torch.utils.data.Subset of the dataset)")
    raise UnsupportedArgument(
        f"sampler={name} is not supported: ledger orders each epoch itself, with a seeded "
        "permutation it can recompute at any position (that is what makes a resume exact "
        f"without replaying the epoch), and cannot recompute another sampler's order; {hint}"
    )


def _check_sampled_length(sampler: Any, source: Any, dataset: Any) -> None:
    """Refuse a sampler over a source of another length than the loader's dataset: it
    orders ``range(len(source))``, which ledger's order over the dataset is not.

    Raises:
        UnsupportedArgument: naming both lengths.
    """
    try:
        n = len(source)
    except TypeError:
        return  # no length to compare; the sampler iterates the dataset's indices
    if n != len(dataset):
        name = type(sampler).__name__
        raise UnsupportedArgument(
            f"{name} over {n} samples for a dataset of {len(dataset)}: ledger orders every "
            "index of the dataset; to serve part of it, pass "
            "torch.utils.data.Subset(dataset, indices)"
        )


def resolve(
    dataset: Any,
    *,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
    generator: Any,
    seed: int | None,
    in_order: bool,
    rank: int | None,
    world_size: int | None,
) -> LoaderArgs:
    """Read torch's DataLoader arguments as ledger's configuration.

    Args:
        dataset: the dataset passed to the loader.
        batch_size, shuffle, sampler, batch_sampler, drop_last, generator, in_order: as
            for ``torch.utils.data.DataLoader``.
        seed: ledger's seed argument (``None``: from ``generator``, a seeded sampler, or
            ``torch.initial_seed()``, the seed ``torch.manual_seed`` set).
        rank, world_size: the caller's, or ``None``.

    Returns:
        The :class:`LoaderArgs`.

    Raises:
        UnsupportedArgument: for an iterable dataset, ``batch_size=None``,
            ``in_order=False``, a sampler whose order ledger cannot recompute, or
            arguments that contradict each other (named in the message).
    """
    _check_dataset(dataset)
    if batch_sampler is not None:
        # torch's own rule: a batch sampler decides batch size, order and drop_last.
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise UnsupportedArgument(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, "
                "sampler, and drop_last"
            )
        if not isinstance(batch_sampler, tud.BatchSampler):
            raise UnsupportedArgument(
                f"batch_sampler={type(batch_sampler).__name__} is not supported: ledger "
                "forms batches itself (batch_size=, drop_last=) from a seeded order it can "
                "recompute at any position; a torch.utils.data.BatchSampler over a "
                "SequentialSampler, RandomSampler or DistributedSampler is translated"
            )
        sampler = batch_sampler.sampler
        batch_size = batch_sampler.batch_size
        drop_last = batch_sampler.drop_last
    if batch_size is None:
        raise UnsupportedArgument(
            "batch_size=None (no automatic batching) is not supported: ledger logs and "
            "resumes batches; use batch_size=1 and take element 0"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UnsupportedArgument(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not in_order:
        raise UnsupportedArgument(
            "in_order=False is not supported: ledger hands batches to the training loop in "
            "order, so that the stream it logs and resumes does not depend on which worker "
            "finishes first; a slow worker delays the next batch instead"
        )
    sampler_seed = None
    if sampler is not None:
        if shuffle:
            raise UnsupportedArgument("sampler option is mutually exclusive with shuffle")
        shuffle, sampler_seed, sampler_rank, sampler_world = _from_sampler(sampler, dataset)
        for name, ours, found in (
            ("rank", rank, sampler_rank),
            ("world_size", world_size, sampler_world),
        ):
            if ours is not None and found is not None and ours != found:
                raise UnsupportedArgument(
                    f"{name}={ours} contradicts the sampler's {name}={found}: pass one"
                )
        rank = rank if rank is not None else sampler_rank
        world_size = world_size if world_size is not None else sampler_world
    sources = {
        "seed": None if seed is None else _seed(seed),
        "generator": None if generator is None else _generator_seed(generator, "generator"),
        "the sampler's seed": sampler_seed,
    }
    seeds = {k: v for k, v in sources.items() if v is not None}
    if len(set(seeds.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in seeds.items())
        raise UnsupportedArgument(f"the seeds given differ ({listed}): pass one seed")
    from_torch = not seeds
    # No seed given: the one torch.manual_seed set, as torch's own shuffle would use.
    run_seed = next(iter(seeds.values())) if seeds else int(torch.initial_seed()) & _SEED_MASK
    return LoaderArgs(
        batch_size=batch_size,
        shuffle=bool(shuffle),
        drop_last=bool(drop_last),
        seed=run_seed,
        seed_from_torch=from_torch,
        rank=rank,
        world_size=world_size,
    )
