"""The one interface between :class:`ledger.DataLoader` and what turns a dataset into batches.

A *pipeline* is a map-style dataset's (:class:`ledger.mapstyle.MapPipeline`: order ->
fetch) or a stream's (:class:`ledger.stream.pipeline.StreamPipeline`: shard plan ->
shuffle buffer -> packing). The loader holds one and never asks which: it

1. stores :meth:`Pipeline.config` in ``run.json`` (what must not change across a resume),
2. starts from :meth:`Pipeline.initial_state`,
3. iterates :meth:`Pipeline.begin` (the rest of the state's epoch, as torch batches tagged
   with what the main process needs to log them),
4. folds each batch it hands to the training loop with :meth:`Pipeline.record` (the
   events to log and the state after the batch),
5. adds :meth:`Pipeline.snapshot` (buffer contents) to each commit, and
6. on resume, rebuilds the state with :meth:`Pipeline.replay` (:mod:`ledger.replay`).

:func:`build` picks the implementation for a dataset, once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.utils.data as tud
from torch.utils.data._utils.pin_memory import pin_memory

from ledger.commits import Commit, PipelineState
from ledger.fetch import OnError, RngMode
from ledger.journal import JournalOrder
from ledger.schema import EventChunk
from ledger.store import Store


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderSettings:
    """What the loader decided that a pipeline needs (one frozen object, not 14 arguments).

    Attributes:
        seed: the run's seed.
        shuffle: shuffle each epoch.
        batch_size: samples (or packed sequences) per batch on this rank.
        drop_last: drop an epoch's short last step (map-style datasets).
        rank, world_size: this rank and the number of ranks.
        num_workers: torch DataLoader workers (0: the main process).
        collate_fn: the user's collate function (torch's ``default_collate`` if none).
        rng: how the dataset's random draws are seeded (:mod:`ledger.fetch`).
        digest: record each batch's content digest.
        persistent_workers: keep torch's workers between epochs.
        torch_kwargs: the other ``torch.utils.data.DataLoader`` arguments.
        store: the log root.
        on_error: ``"raise"`` or ``"skip"`` (leave out a sample whose loading raises,
            and log it as an ``error`` event).
    """

    seed: int
    shuffle: bool
    batch_size: int
    drop_last: bool
    rank: int
    world_size: int
    num_workers: int
    collate_fn: Callable[[list[Any]], Any]
    rng: RngMode
    digest: bool
    persistent_workers: bool
    torch_kwargs: dict[str, Any]
    store: Store
    on_error: OnError = "raise"


class Pipeline(Protocol):
    """What :class:`ledger.DataLoader` needs from a pipeline (see the module docstring).

    Attributes:
        dataset: the user's dataset object (``ledger show --materialize`` and
            ``verify_data`` re-create batches through it).
        workers: logical workers per rank recorded in each state (0: a map-style
            dataset, whose state holds none).
        torch_loader: the ``torch.utils.data.DataLoader`` it runs (the loader shuts its
            workers down on :meth:`ledger.DataLoader.close`).
    """

    dataset: Any
    workers: int
    torch_loader: Any

    def config(self) -> dict[str, Any]:
        """What must not change across a resume (stored in ``run.json``)."""
        ...

    def check_logged(self, logged: dict[str, Any]) -> None:
        """Refuse a resume whose input changed, naming what changed, before the generic
        configuration check (``logged``: the run's stored configuration).

        Raises:
            ConfigMismatch: naming the first input (e.g. a shard) that changed.
        """
        ...

    def batches_per_epoch(self) -> int:
        """Batches per epoch on this rank.

        Raises:
            TypeError: if it is not known in advance (a stream's depends on packing).
        """
        ...

    def initial_state(self) -> PipelineState:
        """The state at the start of the run (and forget any replayed buffers)."""
        ...

    def begin(self, state: PipelineState) -> Iterable[tuple[Any, Any]]:
        """The rest of ``state``'s epoch: ``(tag, batch)`` pairs from torch's loader.

        Raises:
            LedgerError: if this rank has nothing to serve in the epoch.
        """
        ...

    def record(self, state: PipelineState, tag: Any) -> tuple[PipelineState, list[EventChunk]]:
        """Fold one batch handed to the training loop: the state after it, and its events.

        Raises:
            LedgerError: if the batch is not the one the pipeline predicts.
        """
        ...

    def skip(
        self, state: PipelineState, batches: int, reason: str
    ) -> tuple[PipelineState, list[EventChunk]]:
        """Skip the next ``batches`` batches on purpose: the state after them, and their
        ``rollback`` events (JSON ``{"reason": reason}`` in ``value``). A pipeline whose
        next batches are a function of the state skips them without reading data."""
        ...

    def finish(self, state: PipelineState, start_epoch: int) -> None:
        """Check, when torch's iterator ends, that the epoch begun in ``start_epoch`` is over.

        Raises:
            LedgerError: if torch ended the epoch while samples were left.
        """
        ...

    def journal_order(self) -> JournalOrder | None:
        """The order whose consecutive positions this pipeline's ``from_order`` chunks
        hold (a map-style dataset's), for the journal; ``None``: it makes none."""
        ...

    def snapshot(self, state: PipelineState) -> list[EventChunk]:
        """Events that hold what the state alone does not (``buffer`` events), at a commit."""
        ...

    def enter_phase(self, phase: dict[str, Any] | None) -> None:
        """Serve the phase of an attempt record (``None``: the run's first phase)."""
        ...

    def new_phase(
        self, store: Store, head: Commit, current: dict[str, Any] | None, logged: dict[str, Any]
    ) -> dict[str, Any]:
        """The record of a new phase starting after ``head`` with this pipeline's
        configuration (``load_state_dict(token, new_phase=True)``).

        Args:
            store: the log root.
            head: the commit resumed from.
            current: the phase ``head`` belongs to (``None``: the first).
            logged: the run's configuration (``run.json``).

        Raises:
            ConfigMismatch: if the change is not one a phase can make exactly.
        """
        ...

    def replay(self, store: Store, head: Commit) -> tuple[PipelineState, list[EventChunk]]:
        """Rebuild this rank's state at ``head`` from the log, and verify it.

        Returns:
            The state, and events to log when the new attempt starts (``skip`` events
            of a tail an elastic resume cannot serve).

        Raises:
            LogCorrupted, ResumeMismatch: if the log is inconsistent, or the pipeline
                would not continue it exactly.
        """
        ...

    def confirm_replay(self) -> None:
        """Finish the checks :meth:`replay` left running in the background (a map-style
        resume: the newest segment's SHA-256); the loader calls it before the first batch
        after a resume reaches the training loop, and before it records or commits
        anything. A no-op when none is left.

        Raises:
            LogCorrupted: if the check fails (it raises again on every call).
        """
        ...


_profiler_enabled = torch._C._autograd._profiler_enabled


def in_process(
    torch_loader: tud.DataLoader[Any], fetch: Callable[[Any], Any] | None = None
) -> Iterator[Any]:
    """Iterate a ``num_workers=0`` torch DataLoader as torch would, at less cost per batch.

    torch's own single-process iterator is made (its ``pin_memory`` decision and device,
    its warnings) and does the work (``_SingleProcessDataLoaderIter._next_data``: the next
    request of the batch sampler, the fetch, ``collate_fn``, ``pin_memory``), called
    here. What is left out is its ``__next__`` wrapper, whose
    ``torch.autograd.profiler.record_function`` costs ~20-40 µs per batch even when no
    profiler runs: the annotation is entered here only while a profiler is active
    (``torch._C._autograd._profiler_enabled()``: ``torch.profiler``, the autograd
    profiler, ``emit_nvtx``, on-demand traces), under torch's name
    (``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__``, once per batch and
    once for the call that ends the epoch, as torch does), so traces and the tools that
    look for it still see the data loading. The wrapper's other work, a warning when an
    ``IterableDataset`` outgrows a ``len()`` asked of torch's loader, never applies:
    ledger does not ask it.

    Args:
        torch_loader: a DataLoader with ``num_workers=0``.
        fetch: for a map-style loader whose dataset's ``__getitems__`` makes the whole
            batch and whose ``collate_fn`` passes it on unchanged (ledger's): that
            ``__getitems__``, called with each request of the batch sampler instead of
            torch's fetcher (the same result, a few µs less per batch).

    Yields:
        What iterating ``torch_loader`` yields, in the same order.

    Raises:
        Whatever iterating ``torch_loader`` raises (e.g. torch's error for a ``timeout``
        at 0 workers, when the iteration starts).
    """
    iterator = iter(torch_loader)
    name = iterator._profile_name
    profiled = _profiler_enabled
    item: Any
    if fetch is not None:
        pin, device = iterator._pin_memory, iterator._pin_memory_device
        for request in iterator._sampler_iter:
            if profiled():
                with torch.autograd.profiler.record_function(name):
                    item = fetch(request)
                    if pin:
                        item = pin_memory(item, device)
            else:
                item = fetch(request)
                if pin:
                    item = pin_memory(item, device)
            yield item
        if profiled():  # torch annotates the call that ends the epoch too
            with torch.autograd.profiler.record_function(name):
                pass
        return
    next_data: Callable[[], Any] = iterator._next_data
    while True:
        try:
            if profiled():
                with torch.autograd.profiler.record_function(name):
                    item = next_data()
            else:
                item = next_data()
        except StopIteration:
            return
        yield item


def build(dataset: Any, settings: LoaderSettings) -> Pipeline:
    """The pipeline of ``dataset``: a :class:`ledger.Mixture`'s, a
    :class:`ledger.stream.Stream`'s, or a map-style dataset's.

    Raises:
        ValueError: if the arguments do not fit the dataset's kind, or an epoch would
            hold no batch.
    """
    from ledger.mixture import Mixture
    from ledger.stream.spec import Stream

    if isinstance(dataset, Mixture):
        if dataset.streams:
            from ledger.stream.mixing import MixedStreamPipeline

            return MixedStreamPipeline(dataset, settings)
        from ledger.mixture import MixturePipeline

        return MixturePipeline(dataset, settings)
    if isinstance(dataset, Stream):
        from ledger.stream.pipeline import StreamPipeline

        return StreamPipeline(dataset, settings)
    from ledger.mapstyle import MapPipeline

    return MapPipeline(dataset, settings)


PHASE_BATCHING = ("batch_size", "drop_last")
"""Configuration keys a new phase of a map-style dataset (or a mixture of them) may
change: how the order's positions are cut into batches. A stream's new phase may change
its ``batch_size``."""


def refuse_phase(mine: dict[str, Any], logged: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Raise ``ConfigMismatch`` for the first key outside ``allowed`` that a new phase
    would change (world size and workers are elastic, not a phase).

    Raises:
        ConfigMismatch: naming the key, both values and what a phase can change.
    """
    from ledger.commits import ELASTIC_KEYS, upgrade_config
    from ledger.errors import ConfigMismatch

    logged = upgrade_config(logged)
    for key in sorted((set(logged) | set(mine)) - set(ELASTIC_KEYS)):
        if key not in allowed and logged.get(key) != mine.get(key):
            # TODO(phases): a new seed, shuffle, dataset or stream source would need a
            # definition of what the new order continues from (which samples of the
            # current epoch are left); refused until one is written down.
            raise ConfigMismatch(
                key,
                logged.get(key),
                mine.get(key),
                "A new phase can change the batch size (and drop_last of a map-style "
                "dataset), and a ledger.Mixture's weights, schedule and sources; resume "
                "with the run's configuration otherwise, or start a new run.",
            )


def phase_record(
    config: dict[str, Any],
    current: dict[str, Any] | None,
    logged: dict[str, Any],
    allowed: tuple[str, ...],
    start: int,
) -> dict[str, Any]:
    """The record of a new phase with ``config`` after ``current`` (an attempt record's
    ``phase``: ``number``, ``config``, ``start``, ``base``).

    Args:
        config: the resuming loader's configuration.
        current: the phase resumed from (``None``: the run's first).
        logged: the run's configuration (``run.json``).
        allowed: the keys this pipeline's phase may change (:func:`refuse_phase`).
        start: the global position where the phase starts (``epoch * len + position``;
            0 for a stream, whose positions are not global).

    Raises:
        ConfigMismatch: see :func:`refuse_phase`.
    """
    base = current["config"] if current is not None else logged
    refuse_phase(config, base, allowed)
    number = current["number"] + 1 if current is not None else 1
    return {"number": number, "config": config, "start": start, "base": []}
