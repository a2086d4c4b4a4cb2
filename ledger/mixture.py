"""Weighted mixtures of map-style datasets: ``ledger.Mixture({...}, weights={...})``.

How a mixture's order is made (all of it a pure function of the seed, so nothing needs
logging and any position can be computed directly, e.g. after a resume):

1. **Positions.** A mixture epoch is ``epoch_size`` positions (default: the sources'
   total length). Position ``p`` of epoch ``e`` is global position ``P = e *
   epoch_size + p``; the loader's plan (ranks, batches, ``drop_last``, elastic resume)
   works on positions exactly as for a map-style dataset.
2. **Source of a position.** Global positions are cut into blocks of :data:`BLOCK`.
   A block holds exactly ``n_s`` positions of source ``s``: the weights in force at the
   block (:class:`Schedule`), times ``BLOCK``, rounded by the largest-remainder method
   (so the realised target share is ``n_s / BLOCK``: weights have a resolution of
   ``1 / BLOCK``). The slots are placed by a seeded permutation of the block
   (:class:`ledger.order.EpochOrder` keyed by the seed and the block: a Feistel network,
   counter-based), so the source of ``P`` is a function of ``(seed, P)`` alone, and
   the number of positions of ``s`` before any ``P`` is known in closed form.
3. **Sample of a position.** Each source keeps its own order and its own epochs: the
   ``k``-th position given to source ``s`` over the whole run takes the sample at
   position ``k mod N_s`` of the source's epoch ``k // N_s`` (its own seeded order of
   ``[0, N_s)``). A small source with a large weight repeats: it runs through several
   of its epochs per mixture epoch; every source epoch holds each of its samples once.

The log names each event's source (the ``source`` column); ``sample_id`` is the index in
that source. ``ledger audit --check mixture`` compares realised with target shares.

A mixture with :class:`ledger.stream.Stream` sources places sources on positions by the
same blocks, but its positions are dealt to the logical workers and each worker reads
each source through its own lane of that stream (:mod:`ledger.stream.mixing`); a
map-style source beside streams is read through lanes too, each over a run of its seeded
order of each of its epochs (:mod:`ledger.stream.indexed`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ledger.commits import PHASE_KEYS, Commit, PipelineState
from ledger.errors import ConfigMismatch, UnsupportedArgument
from ledger.fetch import batch_getter
from ledger.journal import JournalOrder
from ledger.mapstyle import MapPipeline
from ledger.order import BatchPlan, EpochOrder, derive_key
from ledger.pipeline import PHASE_BATCHING, LoaderSettings, refuse_phase
from ledger.replay import resume_elastic
from ledger.schema import EventChunk
from ledger.store import Store

BLOCK = 1000
"""Global positions per block: each block realises the weights exactly, to ``1/BLOCK``."""

MIX_ALGORITHM = "block-largest-remainder-feistel-v1"
"""Name of the construction above, recorded in ``run.json``."""

_MIX_KEY = 0x4D4958  # "MIX": keys the block permutations apart from the epoch orders
_BEFORE_KEY = 0x424546  # "BEF": a phase's blocks extended backward from its start


class Schedule:
    """Weights that change with the number of samples the mixture has served.

    A piecewise-constant schedule: ``{0: {"web": 0.7, "code": 0.3}, 90_000: {"web":
    0.2, "code": 0.8}}`` serves the first 90,000 global positions (samples, summed over
    ranks) with the first weights and the rest with the second: e.g. an annealing phase
    in the last 10% of 100,000 samples. Boundaries are in samples, not steps, so they
    stay put when an elastic resume changes the world size; for a boundary at step
    ``t`` pass ``t * batch_size * world_size``.

    Args:
        pieces: start (global position, a multiple of :data:`BLOCK`, the first 0) ->
            weights by source name (non-negative, finite, not all zero; they are
            normalised).

    Raises:
        UnsupportedArgument: (a ``ValueError``) if the first start is not 0, a start is
            not a multiple of :data:`BLOCK`, or a piece's weights are invalid.
    """

    def __init__(self, pieces: Mapping[int, Mapping[str, float]]) -> None:
        if not isinstance(pieces, Mapping):
            raise UnsupportedArgument(
                f"a Schedule takes a dict of start sample to weights, got {type(pieces).__name__}"
            )
        starts = sorted(int(s) for s in pieces)
        if not starts or starts[0] != 0:
            raise UnsupportedArgument(
                f"a schedule's first piece starts at sample 0, got {starts[:1]}"
            )
        for s in starts:
            if s % BLOCK:
                raise UnsupportedArgument(
                    f"schedule boundary {s} is not a multiple of {BLOCK} samples (a mixture "
                    f"realises its weights a block of {BLOCK} positions at a time)"
                )
        self.starts: tuple[int, ...] = tuple(starts)
        self.weights: tuple[dict[str, float], ...] = tuple(
            _normalised(pieces[s], f"the schedule's piece at sample {s}") for s in starts
        )

    def to_json(self) -> list[list[Any]]:
        """``[[start, {name: weight}], ...]`` (normalised weights)."""
        return [[s, dict(w)] for s, w in zip(self.starts, self.weights, strict=True)]

    def __repr__(self) -> str:
        return f"Schedule({dict(zip(self.starts, self.weights, strict=True))!r})"


def _normalised(weights: Mapping[str, float], where: str) -> dict[str, float]:
    out = {}
    if not isinstance(weights, Mapping):
        raise UnsupportedArgument(
            f"{where}: weights are {type(weights).__name__}, expected a dict of source name "
            "to weight"
        )
    for name, given in weights.items():
        try:
            w = float(given)
        except (TypeError, ValueError):
            w = math.nan
        if not math.isfinite(w) or w < 0:
            raise UnsupportedArgument(
                f"{where}: weight of {name!r} is {w}; weights are finite and >= 0"
            )
        out[str(name)] = w
    total = sum(out.values())
    if total <= 0:
        raise UnsupportedArgument(
            f"{where}: the weights sum to {total}; give some source a weight > 0"
        )
    return {name: w / total for name, w in out.items()}


def _counts(weights: dict[str, float], names: Sequence[str]) -> np.ndarray:
    """Positions per block of each source (largest-remainder rounding; ties: source order)."""
    raw = np.array([weights.get(n, 0.0) * BLOCK for n in names])
    counts = np.floor(raw).astype(np.int64)
    left = BLOCK - int(counts.sum())
    if left:
        rank = sorted(range(len(names)), key=lambda i: (-(raw[i] - counts[i]), i))
        counts[rank[:left]] += 1
    return counts


class Mixture:
    """Datasets or streams mixed with weights, to hand to :class:`ledger.DataLoader`.

    See the module docstring for the order. ``mixture[i]`` takes a *flat* id: source
    ``s``'s sample ``j`` is ``offsets[s] + j`` (the loader fetches through it; the log
    records ``source`` and ``j``). A mixture with streams (some source a
    :class:`ledger.stream.Stream`; :mod:`ledger.stream.mixing`) has no ``mixture[i]``:
    its sources are read through per-worker lanes; a stream's ``sample_id`` is a row of
    the source, a map-style source's the index (:mod:`ledger.stream.indexed`: its lanes
    read its seeded order of each of its epochs, ``dataset[i]`` one sample at a time).

    Args:
        sources: name -> map-style dataset (``__len__``, ``__getitem__``) or
            :class:`ledger.stream.Stream`, in a fixed order (it is part of the run's
            configuration).
        weights: name -> weight (normalised), or a :class:`Schedule`.
        epoch_size: positions per mixture epoch (default: the sources' total length,
            in rows for streams).

    Raises:
        UnsupportedArgument: (a ``ValueError``) if there is no source, a source is empty,
            a mixture, or neither a map-style dataset nor a stream, a weight names no
            source or is not a finite number >= 0, ``epoch_size < 1``, or streams pack
            differently.
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float] | Schedule,
        *,
        epoch_size: int | None = None,
    ) -> None:
        from ledger.stream.spec import Stream

        if not isinstance(sources, Mapping) or not sources:
            raise UnsupportedArgument(
                "a Mixture takes a non-empty dict of source name to dataset or Stream, got "
                f"{sources!r:.60}"
            )
        self.names: tuple[str, ...] = tuple(str(n) for n in sources)
        self.sources: tuple[Any, ...] = tuple(sources.values())
        streams = [isinstance(ds, Stream) for ds in self.sources]
        self.streams = any(streams)
        """Some source is a stream: the mixture is read through per-worker lanes
        (:mod:`ledger.stream.mixing`), its map-style sources too
        (:mod:`ledger.stream.indexed`)."""
        for name, ds in zip(self.names, self.sources, strict=True):
            if isinstance(ds, Mixture):
                raise UnsupportedArgument(
                    f"source {name!r} is a Mixture: mix its sources into this one instead"
                )
            if isinstance(ds, Stream):
                continue
            if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
                raise UnsupportedArgument(
                    f"source {name!r} ({type(ds).__name__}) is neither a map-style dataset "
                    "(__len__ and __getitem__) nor a ledger.stream.Stream"
                )
        if self.streams:
            from ledger.stream.indexed import IndexedSource
            from ledger.stream.mixing import check_sources

            stream_names = tuple(n for n, st in zip(self.names, streams, strict=True) if st)
            check_sources(tuple(ds for ds in self.sources if isinstance(ds, Stream)), stream_names)
            # A map-style source beside streams is read through lanes too, over its seeded
            # order; in a packed mixture its items are token sequences (the streams' packer).
            packer = next(ds.packer for ds in self.sources if isinstance(ds, Stream))
            self.sources = tuple(
                ds if isinstance(ds, Stream) else IndexedSource(ds, packer) for ds in self.sources
            )
        self.lengths = np.array(
            [ds.source.num_rows if isinstance(ds, Stream) else len(ds) for ds in self.sources],
            np.int64,
        )
        empty = [n for n, k in zip(self.names, self.lengths.tolist(), strict=True) if k == 0]
        if empty:
            raise UnsupportedArgument(f"source {empty[0]!r} is empty")
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.schedule = weights if isinstance(weights, Schedule) else Schedule({0: weights})
        for start, piece in zip(self.schedule.starts, self.schedule.weights, strict=True):
            unknown = sorted(set(piece) - set(self.names))
            if unknown:
                raise UnsupportedArgument(
                    f"the weights at sample {start} name {unknown[0]!r}, which is not a "
                    f"source ({', '.join(self.names)})"
                )
        self.epoch_size = int(epoch_size if epoch_size is not None else self.offsets[-1])
        if self.epoch_size < 1:
            raise UnsupportedArgument(f"epoch_size must be >= 1, got {self.epoch_size}")
        # Per piece: positions of each source per block; and the first block of each.
        self.counts = np.stack([_counts(w, self.names) for w in self.schedule.weights])
        zero = np.zeros(len(self.names), np.int64)
        self.phases: list[Phase] = [Phase(0, zero, self.counts, self.schedule.starts)]
        if not self.streams and any(batch_getter(ds) is not None for ds in self.sources):
            # Then a batch is fetched as one (ledger.fetch: seeded once per batch, also
            # with rng="sample"), one __getitems__ call per source that has one.
            self.__getitems__ = self._getitems

    def __len__(self) -> int:
        """Positions per mixture epoch."""
        return self.epoch_size

    def __getitem__(self, flat: int) -> Any:
        """The sample of a flat id (``offsets[s] + j``: sample ``j`` of source ``s``).

        Raises:
            TypeError: for a mixture of streams (no random access).
        """
        if self.streams:
            raise TypeError(
                "a Mixture with streams has no random access (mixture[i]): its sources are "
                "read through per-worker lanes"
            )
        s = int(np.searchsorted(self.offsets, flat, side="right")) - 1
        if not 0 <= s < len(self.sources) or flat < 0:
            raise IndexError(f"flat id {flat} is outside [0, {int(self.offsets[-1])})")
        return self.sources[s][int(flat - self.offsets[s])]

    def _getitems(self, flats: list[int]) -> list[Any]:
        """The samples of flat ids, in order: each source's ids of the batch fetched by one
        ``__getitems__`` call where the source has one (HF ``datasets``), else one by one.
        The mixture's ``__getitems__`` when a source has one.

        Raises:
            IndexError: for a flat id outside the sources.
            UnsupportedArgument: if a source's ``__getitems__`` returns anything but a
                list of one sample per id (the samples of the sources are interleaved).
            Exception: whatever a source raised.
        """
        flat = np.asarray(flats, np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.offsets[-1]):
            bad = int(flat[(flat < 0) | (flat >= self.offsets[-1])][0])
            raise IndexError(f"flat id {bad} is outside [0, {int(self.offsets[-1])})")
        codes, ids = self.split(flat)
        out: list[Any] = [None] * flat.size
        for s in np.unique(codes).tolist():
            rows = np.flatnonzero(codes == s).tolist()
            source = self.sources[s]
            wanted = ids[rows].tolist()
            getitems = batch_getter(source)
            got = getitems(wanted) if getitems is not None else [source[i] for i in wanted]
            if not isinstance(got, list) or len(got) != len(wanted):
                raise UnsupportedArgument(
                    f"the __getitems__ of mixture source {self.names[s]!r} returned "
                    + (f"{len(got)} items" if isinstance(got, list) else type(got).__name__)
                    + f" for {len(wanted)} ids: a mixture interleaves its sources' samples, "
                    "so it needs a list of one sample per id, in order"
                )
            for row, item in zip(rows, got, strict=True):
                out[row] = item
        return out

    def targets(self, piece: int = 0) -> dict[str, float]:
        """Target share of each source in a piece of the schedule: ``n_s / BLOCK``."""
        return {n: int(c) / BLOCK for n, c in zip(self.names, self.counts[piece], strict=True)}

    def config(self) -> dict[str, Any]:
        """What must not change across a resume (stored in ``run.json``)."""
        return {
            "algorithm": MIX_ALGORITHM,
            "block": BLOCK,
            "epoch_size": self.epoch_size,
            "sources": [
                {"name": n, "len": int(k)} for n, k in zip(self.names, self.lengths, strict=True)
            ],
            "schedule": self.schedule.to_json(),
            "targets": [self.targets(i) for i in range(len(self.schedule.starts))],
        }

    def split(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Flat ids -> ``(source codes int16, sample ids in their source int64)``."""
        codes = np.searchsorted(self.offsets, flat, side="right") - 1
        return codes.astype(np.int16), flat - self.offsets[codes]

    @property
    def total(self) -> int:
        """Samples (or rows) in all sources: the number of flat ids."""
        return int(self.offsets[-1])

    def ext_id(self, epoch: Any, source: int, row: Any) -> Any:
        """Extended id of row(s) of a source in a source epoch: ``epoch * total +
        offsets[source] + row`` (int or ``int64`` arrays; mixtures of streams)."""
        return epoch * self.total + int(self.offsets[source]) + row

    def split_ext(self, ext: Any) -> tuple[Any, Any, Any]:
        """Extended ids -> ``(source epoch, source index, row in the source)``."""
        epoch, flat = np.divmod(np.asarray(ext, np.int64), self.total)
        source = np.searchsorted(self.offsets, flat, side="right") - 1
        row = flat - self.offsets[source]
        if np.ndim(ext) == 0:
            return int(epoch), int(source), int(row)
        return epoch, source, row

    def join(self, names: Sequence[str | None], ids: np.ndarray) -> np.ndarray:
        """Sources by name and ids in them -> flat ids (``-1`` for an unknown source)."""
        index = {n: i for i, n in enumerate(self.names)}
        codes = np.array([index.get(n, -1) if n is not None else -1 for n in names], np.int64)
        flat = self.offsets[np.maximum(codes, 0)] + ids
        return np.where(codes >= 0, flat, -1)

    # ------------------------------------------------------------------ the order

    def enter_phase(self, phases: Sequence[Phase]) -> None:
        """Serve positions by these phases (each from its ``start`` on) instead of phase 0
        of this mixture's own schedule alone (see :class:`Phase`)."""
        self.phases = sorted(phases, key=lambda ph: ph.start)

    def _phase_rows(self, positions: np.ndarray) -> list[tuple[Phase, np.ndarray]]:
        if len(self.phases) == 1:
            return [(self.phases[0], np.arange(positions.size))]
        starts = np.array([ph.start for ph in self.phases], np.int64)
        which = np.searchsorted(starts, positions, side="right") - 1
        return [(ph, np.flatnonzero(which == i)) for i, ph in enumerate(self.phases)]

    def flat_ids(self, seed: int, shuffle: bool, positions: np.ndarray) -> np.ndarray:
        """Flat ids at global positions (``int64``, any 1-D array)."""
        positions = np.asarray(positions, np.int64)
        src = np.empty(positions.size, np.int64)
        nth = np.empty(positions.size, np.int64)  # index in the source's own stream
        for phase, rows in self._phase_rows(positions):
            if rows.size:
                src[rows], nth[rows] = phase.locate(seed, positions[rows])
        out = np.empty(positions.size, np.int64)
        for s in np.unique(src).tolist():
            rows = np.flatnonzero(src == s)
            n = int(self.lengths[s])
            epochs, pos = np.divmod(nth[rows], n)
            source_seed = derive_key(seed, zlib.crc32(self.names[s].encode()))
            for e in np.unique(epochs).tolist():
                sel = epochs == e
                order = EpochOrder(n, source_seed, e, shuffle)
                out[rows[sel]] = self.offsets[s] + order.sample_ids(pos[sel])
        return out

    def sources_at(self, seed: int, positions: np.ndarray) -> np.ndarray:
        """Source index (``int64``) of each global position: the ground truth of shares."""
        positions = np.asarray(positions, np.int64)
        out = np.empty(positions.size, np.int64)
        for phase, rows in self._phase_rows(positions):
            if not rows.size:
                continue
            src = phase.locate(seed, positions[rows])[0]
            if phase.remap is not None:  # an earlier phase with other sources
                src = phase.remap[src]
                gone = np.flatnonzero(src < 0)  # of a source removed since: see Phase
                if gone.size:
                    src[gone] = self.phases[-1].sources_before(seed, positions[rows[gone]])
            out[rows] = src
        return out


class Phase:
    """A stretch of global positions ``[start, ...)`` mixed by one schedule.

    Phase 0 starts at position 0 with its source counts at 0. A new phase (a deliberate
    change of weights at a resume, ``load_state_dict(token, new_phase=True)``) starts
    where the consumed positions reached, with each source's count carried over, so
    every source continues its own stream where it stood; its schedule's boundaries
    count from the phase's start.

    Args:
        start: first global position of the phase.
        base: ``int64 (sources,)``: positions each source was given before ``start``.
        counts: ``int64 (pieces, sources)``: positions per block of each source, per piece.
        piece_starts: first position of each piece, relative to ``start``.
        number: the phase's number (0 for the run's first).
    """

    def __init__(
        self,
        start: int,
        base: np.ndarray,
        counts: np.ndarray,
        piece_starts: Sequence[int],
        number: int = 0,
    ) -> None:
        self.start = int(start)
        self.base = np.asarray(base, np.int64)
        self.counts = np.asarray(counts, np.int64)
        self.first_block = np.array(piece_starts, np.int64) // BLOCK
        self.number = number
        # Phase 0's blocks keep the key they had before phases existed.
        self.key_parts = (_MIX_KEY,) if number == 0 else (_MIX_KEY, number, self.start)
        self.remap: np.ndarray | None = None
        """``int64 (sources,)``: for a phase whose sources are not the mixture's (a later
        phase added or removed some; :mod:`ledger.stream.mixing`), the mixture's index of
        each of its sources, ``-1`` for one removed; ``None``: the same sources."""
        self._blocks: dict[tuple[int, int, bool], tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, seed: int, block: int, before: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(source of each offset int64 (BLOCK,), index among the block's positions of
        that source int64 (BLOCK,))`` of one block of the phase (``before``: of the
        ``block``-th block of its first piece extended backward from its start)."""
        key = (seed, block, before)
        found = self._blocks.get(key)
        if found is not None:
            return found
        piece = 0 if before else int(np.searchsorted(self.first_block, block, side="right")) - 1
        bounds = np.concatenate([[0], np.cumsum(self.counts[piece])])
        parts = (*self.key_parts, _BEFORE_KEY) if before else self.key_parts
        order = EpochOrder(BLOCK, derive_key(seed, *parts), block, True)
        src = np.searchsorted(bounds, order.range(0, BLOCK), side="right") - 1
        k = np.empty(BLOCK, np.int64)
        for s in range(self.counts.shape[1]):
            where = np.flatnonzero(src == s)
            k[where] = np.arange(where.size)
        if len(self._blocks) >= 256:
            self._blocks.clear()
        self._blocks[key] = (src, k)
        return src, k

    def _before(self, blocks: np.ndarray) -> np.ndarray:
        """``int64 (len(blocks), sources)``: positions of each source before each block."""
        starts = self.first_block
        ends = np.concatenate([starts[1:], [np.iinfo(np.int64).max]])
        span = np.clip(np.minimum(blocks[:, None], ends[None, :]) - starts[None, :], 0, None)
        return span @ self.counts  # (blocks, pieces) @ (pieces, sources)

    def locate(self, seed: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, index in the source's own stream)`` of global positions >= start."""
        blocks, offsets = np.divmod(positions - self.start, BLOCK)
        unique, inverse = np.unique(blocks, return_inverse=True)
        src = np.empty(positions.size, np.int64)
        k = np.empty(positions.size, np.int64)
        for i, b in enumerate(unique.tolist()):
            rows = np.flatnonzero(inverse == i)
            block_src, block_k = self._block(seed, b)
            src[rows] = block_src[offsets[rows]]
            k[rows] = block_k[offsets[rows]]
        return src, self.base[src] + self._before(unique)[inverse, src] + k

    def sources_before(self, seed: int, positions: np.ndarray) -> np.ndarray:
        """Source (``int64``) of global positions below ``start`` by the phase's first
        piece extended backward: position ``start - 1 - d`` is offset ``d % BLOCK`` of
        backward block ``d // BLOCK`` (blocks keyed apart from the phase's own). A stream
        mixture's position that an earlier phase gave a source this phase removed, and
        that no worker had served when it began, takes its source from here."""
        blocks, offsets = np.divmod(self.start - 1 - np.asarray(positions, np.int64), BLOCK)
        out = np.empty(blocks.size, np.int64)
        for b in np.unique(blocks).tolist():
            rows = np.flatnonzero(blocks == b)
            out[rows] = self._block(seed, b, True)[0][offsets[rows]]
        return out

    def counts_before(self, seed: int, position: int) -> np.ndarray:
        """``int64 (sources,)``: positions each source was given before ``position``
        (>= start), this phase's and the earlier ones'."""
        block, offset = divmod(position - self.start, BLOCK)
        src, _ = self._block(seed, block)
        partial = np.bincount(src[:offset], minlength=self.counts.shape[1])
        return self.base + self._before(np.array([block]))[0] + partial

    def to_json(self) -> dict[str, Any]:
        """The phase's place in the positions: ``{"number", "start", "base"}``."""
        return {"number": self.number, "start": self.start, "base": self.base.tolist()}


class MixtureOrder:
    """One mixture epoch's order: position -> flat id (the loader's ``EpochOrder``)."""

    def __init__(self, mixture: Mixture, seed: int, epoch: int, shuffle: bool) -> None:
        self.mixture = mixture
        self.seed = seed
        self.epoch = epoch
        self.shuffle = shuffle
        self.n = mixture.epoch_size

    def sample_ids(self, positions: np.ndarray | int) -> np.ndarray:
        """Flat ids at positions of this epoch."""
        p = np.asarray(positions, np.int64)
        flat = self.mixture.flat_ids(self.seed, self.shuffle, p.reshape(-1) + self.epoch * self.n)
        return flat.reshape(p.shape)

    def range(self, start: int, stop: int) -> np.ndarray:
        """Flat ids at positions ``[start, stop)``."""
        return self.sample_ids(np.arange(start, stop, dtype=np.int64))


def _phase_of(record: dict[str, Any], schedule: list[list[Any]], names: Sequence[str]) -> Phase:
    """A :class:`Phase` from its record (``number``, ``start``, ``base``) and schedule."""
    starts = [int(st) for st, _ in schedule]
    counts = np.stack([_counts(dict(w), names) for _, w in schedule])
    base = np.array(record["base"], np.int64)
    return Phase(int(record["start"]), base, counts, starts, int(record["number"]))


class MixturePipeline(MapPipeline):
    """A mixture's pipeline: a map-style pipeline over mixture positions whose events
    name their source (:class:`ledger.pipeline.Pipeline`).

    Args:
        mixture: the mixture.
        settings: the loader's settings.
    """

    def __init__(self, mixture: Mixture, settings: LoaderSettings) -> None:
        self.mixture = mixture
        self._mixture_orders: dict[int, MixtureOrder] = {}
        super().__init__(mixture, settings)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "mixture": self.mixture.config()}

    def journal_order(self) -> JournalOrder | None:
        return None  # a mixture's ids hold their sources: the journal records them

    def order(self, epoch: int) -> MixtureOrder:  # type: ignore[override]
        order = self._mixture_orders.get(epoch)
        if order is None:
            order = MixtureOrder(self.mixture, self.settings.seed, epoch, self.settings.shuffle)
            self._mixture_orders = {epoch: order}
        return order

    def record(self, state: PipelineState, tag: Any) -> tuple[PipelineState, list[EventChunk]]:
        state, events = super().record(state, tag)
        return state, [self._named(c) for c in events]

    def skip(
        self, state: PipelineState, batches: int, reason: str
    ) -> tuple[PipelineState, list[EventChunk]]:
        state, events = super().skip(state, batches, reason)
        return state, [self._named(c) for c in events]

    def _named(self, chunk: EventChunk) -> EventChunk:
        """The chunk with per-source ids and its ``source`` codes."""
        return _named(chunk, self.mixture)

    def enter_phase(self, phase: dict[str, Any] | None) -> None:
        """Serve positions by the phase of an attempt record, and the one before it (whose
        last batches a resume verifies); ``None``: the mixture's own schedule from 0."""
        names = self.mixture.names
        if phase is None:
            zero = np.zeros(len(names), np.int64)
            own = Phase(0, zero, self.mixture.counts, self.mixture.schedule.starts)
            self.mixture.enter_phase([own])
            return
        phases = []
        previous = phase.get("previous")
        if previous is not None and previous.get("names", names) == list(names):
            phases.append(_phase_of(previous, previous["schedule"], names))
        phases.append(_phase_of(phase, phase["config"]["mixture"]["schedule"], names))
        self.mixture.enter_phase(phases)
        self._mixture_orders = {}

    def new_phase(
        self, store: Store, head: Commit, current: dict[str, Any] | None, logged: dict[str, Any]
    ) -> dict[str, Any]:
        """A new phase with this mixture's weights, sources and batch size, starting where
        ``head``'s ranks reached.

        Every source present before and after continues its own stream where it stood
        (its count of positions carries over); a new source starts at its sample 0 of its
        epoch 0; a removed one is no longer drawn. Positions from the phase's start are
        mixed by the new weights (a schedule's boundaries count from the start) and cut
        into batches of the new size (:meth:`MapPipeline.new_phase`).

        Raises:
            ConfigMismatch: if the seed, shuffle, the epoch size, the length of a source
                kept by name, or anything but the weights, sources and batching changed.
            ResumeMismatch: if the ranks at ``head`` stopped at different steps.
        """
        old = current["config"] if current is not None else logged
        mine = self.config()
        for key in ("algorithm", "block", "epoch_size"):
            if old["mixture"].get(key) != mine["mixture"].get(key):
                raise ConfigMismatch(
                    f"mixture {key}",
                    old["mixture"].get(key),
                    mine["mixture"].get(key),
                    "A new phase keeps a mixture's epoch size (pass epoch_size= the old "
                    "value when sources change).",
                )
        refuse_phase(mine, old, (*PHASE_BATCHING, *PHASE_KEYS))
        was_len = {src["name"]: int(src["len"]) for src in old["mixture"]["sources"]}
        for name, n in zip(self.mixture.names, self.mixture.lengths.tolist(), strict=True):
            if was_len.get(name, n) != n:
                raise ConfigMismatch(
                    f"mixture source {name!r} length",
                    was_len[name],
                    n,
                    "A source kept in a new phase continues its own order, which needs its "
                    "length; add a changed dataset under a new name.",
                )
        # The positions so far, as the current phase served them (its sources, weights
        # and batch size): an ids-only mixture of the old sources.
        served = _ids_only(old["mixture"])
        record = current or {"number": 0, "start": 0, "base": [0] * len(served.names)}
        was = _phase_of(record, old["mixture"]["schedule"], served.names)
        served.enter_phase([was])
        seed, shuffle = self.settings.seed, self.settings.shuffle
        before = BatchPlan(self.plan.n, int(old["batch_size"]), bool(old["drop_last"]))
        state, skip = resume_elastic(
            store,
            head,
            self.plan,
            lambda epoch: MixtureOrder(served, seed, epoch, shuffle),
            lambda rows: _logged_ids(rows, served),
            before=before,
        )
        self._started = (head.id, state, [_named(skip, served)] if skip is not None else [])
        start = state.epoch * self.mixture.epoch_size + state.epoch_start
        counts = dict(zip(served.names, was.counts_before(seed, start).tolist(), strict=True))
        return {
            "number": was.number + 1,
            "config": mine,
            "start": start,
            "base": [counts.get(name, 0) for name in self.mixture.names],
            "previous": {
                **was.to_json(),
                "schedule": old["mixture"]["schedule"],
                "names": list(served.names),
            },
        }

    def logged_ids(self, rows: pa.Table) -> np.ndarray:
        """Flat ids of logged events (their ``source`` and ``sample_id``)."""
        return _logged_ids(rows, self.mixture)

    def replay(self, store: Store, head: Commit) -> tuple[PipelineState, list[EventChunk]]:
        started = self._phase_started(head)
        if started is not None:
            return started
        if head.world_size != self.plan.world_size:
            state, skip = resume_elastic(store, head, self.plan, self.order, self.logged_ids)
            return state, [self._named(skip)] if skip is not None else []
        return self._replay_same_shape(store, head, self.logged_ids), []


class _Sized:
    """A source known by its length only: the ids-only mixture of an earlier phase."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        raise TypeError("an earlier phase's source is known by its length only")


def _ids_only(config: dict[str, Any]) -> Mixture:
    """The mixture a phase's configuration describes, ids only (its ``mixture`` key)."""
    return Mixture(
        {src["name"]: _Sized(int(src["len"])) for src in config["sources"]},
        Schedule({int(start): weights for start, weights in config["schedule"]}),
        epoch_size=int(config["epoch_size"]),
    )


def _logged_ids(rows: pa.Table, mixture: Mixture) -> np.ndarray:
    """Flat ids in ``mixture`` of logged events (their ``source`` and ``sample_id``)."""
    names = rows["source"].cast(pa.string()).to_pylist() if "source" in rows.column_names else []
    if len(names) != rows.num_rows:
        names = [None] * rows.num_rows
    return mixture.join(names, rows["sample_id"].to_numpy())


def _named(chunk: EventChunk, mixture: Mixture) -> EventChunk:
    """The chunk with per-source ids and its ``source`` codes in ``mixture``."""
    codes, ids = mixture.split(chunk.sample_ids)
    return EventChunk(
        chunk.kind,
        chunk.epoch,
        chunk.batch,
        chunk.worker,
        chunk.position,
        ids,
        positions=chunk.positions,  # bad samples leave gaps (on_error="skip")
        values=chunk.values,  # an error's exception, a rollback's reason
        digest=chunk.digest,
        sources=codes,
        source_names=mixture.names,
    )
