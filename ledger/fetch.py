"""Fetching a map-style batch with the run's RNG mode: one definition for the loader's
workers and for ``ledger show --materialize``.

RNG modes (``DataLoader(rng=...)``, recorded in ``run.json``):

* ``"batch"`` (default): torch, numpy and ``random`` are seeded once per batch from
  :func:`ledger.order.batch_seed` of ``(seed, epoch, position of the batch's first
  sample)``, for the dataset and then the collate function. Batches are fixed by the
  plan, so a batch's draws do not depend on the number of workers nor on which worker
  loads it. numpy and ``random`` are seeded lazily: only once a batch of the process
  has drawn from them (that batch is loaded a second time, seeded; see
  :func:`seeded_lazily`). Costs ~7 µs per batch (~10 µs in the main process, which also
  saves and restores the training loop's torch generator), ~15 µs more once numpy or
  ``random`` is drawn from.
* ``"sample"``: seeded before each ``dataset[i]`` from
  :func:`ledger.order.sample_seeds` of ``(seed, epoch, sample id)``: a sample's draws do
  not even depend on the batch it lands in (so they survive a change of world size or
  batch composition). The collate function continues from the last sample's seeds.
  Costs ~13 µs per sample.
* ``"off"``: nothing is seeded (for datasets that draw no random numbers).

Streams (:class:`ledger.stream.Stream`) are not fetched by batch: a sample is loaded
when a worker reads it into its shuffle buffer, and re-read alone on resume. Their
transform draws from ``ctx.rng``, seeded per sample in every mode; ``"sample"`` also
seeds torch, numpy and ``random`` before each sample (:func:`ledger.stream.sample.
load_sample`); ``"batch"`` and ``"off"`` leave them alone.

A dataset with ``__getitems__`` (HF ``datasets.Dataset``, ``torch.utils.data.Subset``)
is always fetched a batch at a time: one ``__getitems__`` call per batch. Its batch code
runs once, so it is seeded once per batch in the ``"sample"`` mode too (with the batch
seed). What it returns goes to ``collate_fn`` unchanged, as torch's DataLoader hands it
(a list of samples, torch's documented contract, or e.g. a dict of columns or an
already-batched tensor); a list must hold one sample per id. A :class:`ledger.Mixture`
with such a source has a ``__getitems__`` too (one call per source of the batch,
:meth:`ledger.mixture.Mixture._getitems`), which interleaves the sources' samples and so
needs each source's to return a list.
Bad samples (``DataLoader(on_error="skip")``, :func:`load_batch`): a sample whose
loading raises is left out and reported as a :class:`Failure`; a batched
``__getitems__`` that raises is retried one sample at a time after re-seeding as before
it. The loader logs failures as ``error`` events, and ``ledger show --materialize``
fetches the batch as requested (failures included) with the same function, so it
re-creates the same batch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from ledger.commits import upgrade_config
from ledger.errors import UnsupportedArgument
from ledger.order import (
    _NO_GAUSS,
    LoopStates,
    batch_seed,
    drew_from_globals,
    loop_states,
    mark_dropped,
    mark_globals,
    restore_globals,
    restore_torch,
    rngs_preserved,
    sample_seeds,
    save_torch,
    seed_globals,
)

logger = logging.getLogger("ledger")

RngMode = Literal["batch", "sample", "off"]
RNG_MODES: tuple[str, ...] = ("batch", "sample", "off")
OnError = Literal["raise", "skip"]
ON_ERROR: tuple[str, ...] = ("raise", "skip")


def check_on_error(on_error: Any) -> OnError:
    """Validate an ``on_error`` argument.

    Raises:
        UnsupportedArgument: if it is not ``"raise"`` or ``"skip"``.
    """
    if on_error not in ON_ERROR:
        raise UnsupportedArgument(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    return on_error


def check_rng(rng: Any) -> RngMode:
    """Validate an ``rng`` argument.

    Raises:
        UnsupportedArgument: if it is not one of :data:`RNG_MODES`.
    """
    if rng not in RNG_MODES:
        raise UnsupportedArgument(
            f"rng must be one of {', '.join(map(repr, RNG_MODES))}, got {rng!r}"
        )
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


def load_batch(
    dataset: Any,
    ids: np.ndarray,
    *,
    seed: int,
    epoch: int,
    position: int,
    rng: RngMode,
    main_process: bool,
    skip_errors: bool,
    collate: Callable[[list[Any]], Any] | None = None,
    known_seed: int | None = None,
) -> tuple[Any, list[Failure], Any]:
    """Fetch one batch with the run's RNG mode and collate it, under the same seeds.

    The collate function runs inside the seeded block, so a collate that draws (random
    masking, whole-word masking) draws the same numbers whatever the number of workers,
    as the dataset does.

    With ``skip_errors`` a sample whose ``dataset[i]`` raises an ``Exception`` is left
    out and reported. A batched ``__getitems__`` that raises is retried one sample at a
    time (``__getitems__([i])``, after re-seeding as before the batched call) to find the
    bad ones. Everything is a function of the dataset and the seeds, so the same samples
    fail, and the others get the same random draws, on every run, resume and re-creation
    (``ledger show --materialize``).

    Args:
        dataset: the map-style dataset.
        ids: ``int64 (batch,)`` sample ids, in batch order.
        seed: the run's seed.
        epoch: the batch's epoch.
        position: position of the batch's first sample in the epoch's order.
        rng: the RNG mode (see the module docstring).
        main_process: restore the global RNG states afterwards (the training loop's,
            when there are no workers or when re-creating a batch).
        skip_errors: leave out failing samples instead of raising.
        collate: applied to the samples that loaded (if any); ``None``: not collated.
        known_seed: the batch's seed, :func:`ledger.order.batch_seed` of ``(seed,
            epoch, position)``, if the caller computed it already (the loader does, a
            chunk of batches at a time with :func:`ledger.order.batch_seeds`); ``None``:
            computed here.

    Returns:
        ``(samples, failures, data)``: the samples that loaded, in batch order (a list;
        or what a ``__getitems__`` returned, unchanged, when it did not raise); the
        failures in batch order (``[]`` without ``skip_errors``); ``collate(samples)``,
        or ``None`` without ``collate`` or without samples.

    Raises:
        UnsupportedArgument: if ``__getitems__`` returned a list of another length than
            ``ids``, or with ``skip_errors``, retried one id at a time, not a list of one
            sample.
        Exception: whatever the dataset or ``collate`` raised, without ``skip_errors``
            (and ``BaseException`` such as ``KeyboardInterrupt`` always).
    """
    id_list = ids.tolist()
    getitems = batch_getter(dataset)

    def block(reseed: Callable[[], Any] | None) -> tuple[Any, list[Failure], Any]:
        samples, failures = _fetch(dataset, getitems, id_list, skip_errors, reseed)
        return samples, failures, _collated(collate, samples)

    if rng == "off":
        return block(None)
    if rng == "batch" or getitems is not None:
        if known_seed is None:
            known_seed = batch_seed(seed, epoch, position)
        return seeded_lazily(block, known_seed, main_process)
    with rngs_preserved(main_process):
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
        return samples, failures, _collated(collate, samples)


def _collated(collate: Callable[[Any], Any] | None, samples: Any) -> Any:
    """``collate(samples)``; ``None`` without ``collate`` or when no sample loaded (an
    empty list: every one failed). ``samples`` may be what a ``__getitems__`` returned
    that is not a list (a dict of columns, a tensor), which is not asked for its truth."""
    if collate is None or (isinstance(samples, list) and not samples):
        return None
    return collate(samples)


def load_in_loop(
    dataset: Any, ids: np.ndarray, collate: Callable[[list[Any]], Any], seed: int
) -> Any:
    """The data of :func:`load_batch` with ``rng="batch"``, ``main_process=True``,
    ``skip_errors=False`` and ``known_seed=seed``, for a dataset without
    ``__getitems__``, on the training loop's thread (``num_workers=0``): the same seeds,
    samples and collated batch, with fewer calls per batch.

    Raises:
        Exception: whatever the dataset or ``collate`` raised.
    """
    id_list = ids.tolist()

    def block(reseed: Callable[[], Any] | None) -> Any:
        samples = [dataset[i] for i in id_list]
        return collate(samples) if samples else None

    return seeded_lazily(block, seed, True)


_T = TypeVar("_T")

_globals_drawn = False
"""Whether a batch or sample loaded in this process drew from numpy's or ``random``'s
global generator (then both are seeded before every one; see :func:`seeded_lazily`)."""


def seeded_lazily(block: Callable[[Callable[[], Any] | None], _T], seed: int, main: bool) -> _T:
    """Run ``block`` with torch, numpy and ``random`` seeded by ``seed``, paying for numpy
    and ``random`` only when the block draws from them: what a map-style batch (fetch,
    then collate; :func:`load_batch`) and a map-style sample in a mixture's lane
    (:meth:`ledger.stream.indexed.IndexedSource.load`) are loaded under.

    torch's default generator is seeded every time (cheap, and ``torch.initial_seed()``
    then reads the seed). numpy's global ``RandomState`` and ``random``'s generator cost
    more to seed (~15-25 µs the pair), and most datasets never touch them: until a block
    of this process draws from either, they are left unseeded and watched
    (:func:`ledger.order.mark_globals`); the first block that draws (or raises after
    drawing) is put back and run again with all three seeded, as is every later block of
    the process (batch or sample: one flag per process). The result is what the seeded
    block makes, in either case: code that draws nothing from a generator cannot depend
    on its state (unless it reads the state without drawing, e.g.
    ``np.random.get_state()``, which ledger does not support). A block that raises
    without having drawn raises as the seeded one would.

    Args:
        block: called with a function that re-seeds as before the block (for the
            one-by-one retry of a failed ``__getitems__``).
        seed: the batch or sample seed (int in ``[0, 2**63)``).
        main: restore the global states afterwards (the training loop's).

    Returns:
        What ``block`` returned.

    Raises:
        Exception: whatever the seeded ``block`` raised.
    """
    global _globals_drawn
    if _globals_drawn:
        with rngs_preserved(main):
            seed_globals(seed)
            return block(partial(seed_globals, seed))
    if main:
        states = loop_states()
        if states is not None:
            return _lazily_in_loop(block, seed, states)
    generator = torch.default_generator
    torch_saved = save_torch() if main else None
    marks = mark_globals()
    drew = True
    try:
        generator.manual_seed(seed)
        try:
            out = block(partial(generator.manual_seed, seed))
        except Exception:
            if not drew_from_globals(marks):
                drew = False
                raise
        else:
            if not drew_from_globals(marks):
                drew = False
                return out
        _globals_drawn = True
        logger.debug("the dataset draws from numpy or random: both are seeded from now on")
        restore_globals(marks)
        seed_globals(seed)
        return block(partial(seed_globals, seed))
    finally:
        if torch_saved is not None:
            restore_torch(torch_saved)
            if drew or mark_dropped(marks):  # else numpy and random are as they were
                restore_globals(marks)


def _lazily_in_loop(
    block: Callable[[Callable[[], Any] | None], _T], seed: int, s: LoopStates
) -> _T:
    """:func:`seeded_lazily` on the training loop's thread, where the three generators'
    layouts are known: the same steps, on their state bytes directly (one copy of each
    before the block, a comparison of numpy's and ``random``'s after, one copy back of
    torch's and of the cached variates), ~3 µs per batch less than through
    :func:`ledger.order.mark_globals` and torch's ``get_state``/``set_state``."""
    global _globals_drawn
    np_key_bytes, rnd_bytes, owner = s.np_key_bytes, s.rnd_bytes, s.rnd_owner
    torch_saved, key, rnd_key = s.torch_bytes(), np_key_bytes(), rnd_bytes()
    # Drop the cached normal variates, so that a normal draw moves a key as any draw does.
    gauss = None
    words = s.gauss_words
    if words[0] or words[1]:  # as mark_globals: any byte of the 16 not zero
        gauss = s.np_gauss.tobytes()
        s.np_gauss[:] = _NO_GAUSS
    rnd_gauss = owner.gauss_next
    owner.gauss_next = None
    drew = True
    generator = torch.default_generator
    try:
        generator.manual_seed(seed)
        try:
            out = block(lambda: generator.manual_seed(seed))
        except Exception:
            if np_key_bytes() == key and rnd_bytes() == rnd_key:
                drew = False
                raise
        else:
            if np_key_bytes() == key and rnd_bytes() == rnd_key:
                drew = False
                return out
        _globals_drawn = True
        logger.debug("the dataset draws from numpy or random: both are seeded from now on")
        s.np_key[:] = key
        s.rnd[:] = rnd_key
        seed_globals(seed)
        return block(partial(seed_globals, seed))
    finally:
        s.torch[:] = torch_saved
        if drew:
            s.np_key[:] = key
            s.rnd[:] = rnd_key
            s.np_gauss[:] = _NO_GAUSS  # the seeded block may have cached one
        if gauss is not None:
            s.np_gauss[:] = gauss
        owner.gauss_next = rnd_gauss


def _fetch(
    dataset: Any,
    getitems: Callable[[list[int]], Any] | None,
    id_list: list[int],
    skip_errors: bool,
    reseed: Callable[[], Any] | None,
) -> tuple[Any, list[Failure]]:
    """Fetch the batch (seeded by the caller); ``reseed`` re-seeds as before the batch
    for the one-by-one retry of a ``__getitems__`` that raised (``None``: not seeded).

    Returns:
        ``(samples, failures)``: a list of the samples that loaded, or, from a
        ``__getitems__`` that did not raise, whatever it returned (for ``collate_fn``,
        unchanged, as torch's fetch passes it).

    Raises:
        UnsupportedArgument: if ``__getitems__`` returned a list of another length than
            the ids (the log would name samples the model never got), or, when it is
            retried one id at a time (``on_error="skip"``), returned something other than
            a list of one sample.
        Exception: whatever the dataset raised, without ``skip_errors``.
    """
    if getitems is not None:
        try:
            got = getitems(id_list)
        except Exception:
            if not skip_errors:
                raise
        else:
            if not isinstance(got, list) or len(got) == len(id_list):
                return got, []
            # The log would name samples the model never got (or not name ones it got).
            if not skip_errors:
                raise UnsupportedArgument(
                    f"the dataset's __getitems__ returned {len(got)} items for "
                    f"{len(id_list)} ids: a list must hold one sample per id, in order"
                )
        if reseed is not None:  # the per-sample retry draws as if it came first
            reseed()
    elif not skip_errors:  # torch's own fetch: a sample that raises stops the batch
        return [dataset[sid] for sid in id_list], []
    samples: list[Any] = []
    failures: list[Failure] = []
    for i, sid in enumerate(id_list):
        try:
            sample = dataset[sid] if getitems is None else _one(getitems([sid]))
        except UnsupportedArgument:
            raise
        except Exception as e:
            if not skip_errors:
                raise
            failures.append(failure_of(i, e))
        else:
            samples.append(sample)
    return samples, failures


def _one(got: Any) -> Any:
    """The sample of a ``__getitems__([i])`` retried alone (``on_error="skip"``).

    Raises:
        UnsupportedArgument: if it is not a list of one sample: a batch of another shape
            (a dict of columns, a tensor) cannot be split into the samples that loaded.
    """
    if isinstance(got, list) and len(got) == 1:
        return got[0]
    raise UnsupportedArgument(
        "on_error='skip' retries a failed __getitems__ one id at a time and needs it to "
        f"return a list of one sample, got {type(got).__name__}"
        + (f" of {len(got)} items" if isinstance(got, list) else "")
        + ": return a list of samples (torch's Dataset.__getitems__ contract), or "
        "use on_error='raise'"
    )
