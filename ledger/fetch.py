"""Fetching a map-style batch with the run's RNG mode: one definition for the loader's
workers and for ``ledger show --materialize``.

RNG modes (``DataLoader(rng=...)``, recorded in ``run.json``):

* ``"batch"`` (default): torch, numpy and ``random`` are seeded once per batch from
  :func:`ledger.order.batch_seed` of ``(seed, epoch, position of the batch's first
  sample)``. Batches are fixed by the plan, so a batch's draws do not depend on the
  number of workers nor on which worker loads it. Costs ~13 µs per batch.
* ``"sample"``: seeded before each ``dataset[i]`` from
  :func:`ledger.order.sample_seeds` of ``(seed, epoch, sample id)``: a sample's draws do
  not even depend on the batch it lands in (so they survive a change of world size or
  batch composition). Costs ~13 µs per sample.
* ``"off"``: nothing is seeded (for datasets that draw no random numbers).

Streams (:class:`ledger.stream.Stream`) are not fetched by batch: a sample is loaded
when a worker reads it into its shuffle buffer, and re-read alone on resume. Their
transform draws from ``ctx.rng``, seeded per sample in every mode; ``"sample"`` also
seeds torch, numpy and ``random`` before each sample (:func:`ledger.stream.sample.
load_sample`); ``"batch"`` and ``"off"`` leave them alone.

A dataset with ``__getitems__`` (HF ``datasets.Dataset``, ``torch.utils.data.Subset``)
is always fetched a batch at a time: one ``__getitems__`` call per batch. Its batch code
runs once, so it is seeded once per batch in the ``"sample"`` mode too (with the batch
seed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from ledger.commits import upgrade_config
from ledger.order import batch_seed, rngs_preserved, sample_seeds, seed_globals

RngMode = Literal["batch", "sample", "off"]
RNG_MODES: tuple[str, ...] = ("batch", "sample", "off")


def check_rng(rng: Any) -> RngMode:
    """Validate an ``rng`` argument.

    Raises:
        ValueError: if it is not one of :data:`RNG_MODES`.
    """
    if rng not in RNG_MODES:
        raise ValueError(f"rng must be one of {', '.join(map(repr, RNG_MODES))}, got {rng!r}")
    return rng


def rng_of(config: dict[str, Any]) -> RngMode:
    """The RNG mode recorded in a run's configuration (``run.json``); logs written
    before the mode existed record ``per_sample_rng`` (``True``: ``"sample"``)."""
    return check_rng(upgrade_config(config).get("rng", "sample"))


def batch_getter(dataset: Any) -> Callable[[list[int]], Any] | None:
    """The dataset's ``__getitems__`` (batched fetch), or ``None`` if it has none."""
    return getattr(dataset, "__getitems__", None)


def fetch_batch(
    dataset: Any,
    ids: np.ndarray,
    *,
    seed: int,
    epoch: int,
    position: int,
    rng: RngMode,
    main_process: bool,
) -> list[Any]:
    """The samples of one batch, fetched with the run's RNG mode.

    Args:
        dataset: the map-style dataset.
        ids: ``int64 (batch,)`` sample ids, in batch order.
        seed: the run's seed.
        epoch: the batch's epoch.
        position: position of the batch's first sample in the epoch's order.
        rng: the RNG mode (see the module docstring).
        main_process: restore the global RNG states afterwards (the training loop's,
            when there are no workers or when re-creating a batch).

    Returns:
        The samples, a list of ``len(ids)`` items as the dataset returned them.
    """
    id_list = ids.tolist()
    getitems = batch_getter(dataset)
    if rng == "off":
        return list(getitems(id_list)) if getitems else [dataset[i] for i in id_list]
    with rngs_preserved(main_process):
        if rng == "batch" or getitems is not None:
            seed_globals(batch_seed(seed, epoch, position))
            return list(getitems(id_list)) if getitems else [dataset[i] for i in id_list]
        samples = []
        for sid, s in zip(id_list, sample_seeds(seed, epoch, ids).tolist(), strict=True):
            seed_globals(s)
            samples.append(dataset[sid])
        return samples
