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
seed). A :class:`ledger.Mixture` with such a source has a ``__getitems__`` too (one call
per source of the batch, :meth:`ledger.mixture.Mixture._getitems`).
Bad samples (``DataLoader(on_error="skip")``, :func:`fetch_samples`): a sample whose
loading raises is left out and reported as a :class:`Failure`; a batched
``__getitems__`` that raises is retried one sample at a time after re-seeding as before
it. The loader logs failures as ``error`` events, and ``ledger show --materialize``
fetches the batch as requested (failures included) with the same function, so it
re-creates the same batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ledger.commits import upgrade_config
from ledger.order import batch_seed, rngs_preserved, sample_seeds, seed_globals

RngMode = Literal["batch", "sample", "off"]
RNG_MODES: tuple[str, ...] = ("batch", "sample", "off")
OnError = Literal["raise", "skip"]
ON_ERROR: tuple[str, ...] = ("raise", "skip")


def check_on_error(on_error: Any) -> OnError:
    """Validate an ``on_error`` argument.

    Raises:
        ValueError: if it is not ``"raise"`` or ``"skip"``.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    return on_error


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


@dataclass(frozen=True, slots=True)
class Failure:
    """A sample whose loading raised (``on_error="skip"``).

    Attributes:
        index: its index in the batch request (``0..len(ids)-1``).
        type: the exception's type (``"ValueError"``, ``"PIL.UnidentifiedImageError"``).
        message: ``str()`` of the exception, cut to :data:`MESSAGE_CHARS` characters.
    """

    index: int
    type: str
    message: str

    def value(self) -> str:
        """The event's ``value``: JSON ``{"type": ..., "message": ...}``."""
        return json.dumps({"type": self.type, "message": self.message})


MESSAGE_CHARS = 500
"""Characters of an exception's message kept in the log."""


def failure_of(index: int, e: Exception) -> Failure:
    """The :class:`Failure` of the sample at ``index`` that raised ``e``."""
    t = type(e)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return Failure(index, name, str(e)[:MESSAGE_CHARS])


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

    Raises:
        Exception: whatever the dataset raised.
    """
    samples, _ = fetch_samples(
        dataset, ids, seed=seed, epoch=epoch, position=position, rng=rng,
        main_process=main_process, skip_errors=False,
    )  # fmt: skip
    return samples


def fetch_samples(
    dataset: Any,
    ids: np.ndarray,
    *,
    seed: int,
    epoch: int,
    position: int,
    rng: RngMode,
    main_process: bool,
    skip_errors: bool,
) -> tuple[list[Any], list[Failure]]:
    """The samples of one batch, and (``skip_errors``) the ones whose loading raised.

    With ``skip_errors`` a sample whose ``dataset[i]`` raises an ``Exception`` is left
    out and reported. A batched ``__getitems__`` that raises is retried one sample at a
    time (``__getitems__([i])``, after re-seeding as before the batched call) to find the
    bad ones. Everything is a function of the dataset and the seeds, so the same samples
    fail, and the others get the same random draws, on every run, resume and re-creation
    (``ledger show --materialize``).

    Args:
        dataset, ids, seed, epoch, position, rng, main_process: as for
            :func:`fetch_batch`.
        skip_errors: leave out failing samples instead of raising.

    Returns:
        ``(samples, failures)``: the samples that loaded, in batch order, and the
        failures in batch order (``[]`` without ``skip_errors``).

    Raises:
        Exception: whatever the dataset raised, without ``skip_errors`` (and
            ``BaseException`` such as ``KeyboardInterrupt`` always).
    """
    id_list = ids.tolist()
    getitems = batch_getter(dataset)
    if rng == "off":
        return _fetch(dataset, getitems, id_list, skip_errors, None)
    with rngs_preserved(main_process):
        if rng == "batch" or getitems is not None:
            return _fetch(
                dataset, getitems, id_list, skip_errors, batch_seed(seed, epoch, position)
            )
        samples: list[Any] = []
        failures: list[Failure] = []
        for i, (sid, s) in enumerate(
            zip(id_list, sample_seeds(seed, epoch, ids).tolist(), strict=True)
        ):
            seed_globals(s)
            try:
                samples.append(dataset[sid])
            except Exception as e:
                if not skip_errors:
                    raise
                failures.append(failure_of(i, e))
        return samples, failures


def _fetch(
    dataset: Any,
    getitems: Callable[[list[int]], Any] | None,
    id_list: list[int],
    skip_errors: bool,
    seed: int | None,
) -> tuple[list[Any], list[Failure]]:
    """Fetch with one seed for the batch (``None``: not seeded)."""
    if seed is not None:
        seed_globals(seed)
    if getitems is not None:
        try:
            return list(getitems(id_list)), []
        except Exception:
            if not skip_errors:
                raise
        if seed is not None:  # the per-sample retry draws as if it came first
            seed_globals(seed)
    samples: list[Any] = []
    failures: list[Failure] = []
    for i, sid in enumerate(id_list):
        try:
            samples.append(getitems([sid])[0] if getitems is not None else dataset[sid])
        except Exception as e:
            if not skip_errors:
                raise
            failures.append(failure_of(i, e))
    return samples, failures
