"""One sample as a worker makes it (transform with its seeded context), and a logged
batch of a stream made again from its samples."""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ledger.errors import DataError, LedgerError, UnsupportedArgument
from ledger.order import rngs_preserved, sample_seed, seed_globals
from ledger.stream.packing import assemble
from ledger.stream.source import BadRecord

if TYPE_CHECKING:
    from ledger.stream.spec import Stream


class SampleContext:
    """What a transform gets besides the record.

    Attributes:
        sample_id: the sample's id (global row number).
        epoch: the epoch.
        draws: values recorded with :meth:`record` (logged with the sample).
    """

    __slots__ = ("_rng", "_run_seed", "_seed", "draws", "epoch", "sample_id")

    def __init__(self, sample_id: int, epoch: int, seed: int | None, run_seed: int = 0) -> None:
        self.sample_id = sample_id
        self.epoch = epoch
        self._seed = seed  # None: derived from run_seed when first asked for
        self._run_seed = run_seed
        self._rng: np.random.Generator | None = None
        self.draws: dict[str, Any] = {}

    @property
    def rng(self) -> np.random.Generator:
        """A numpy ``Generator`` (PCG64) seeded from ``(seed, epoch, sample id)``."""
        if self._rng is None:
            if self._seed is None:
                self._seed = sample_seed(self._run_seed, self.epoch, self.sample_id)
            self._rng = np.random.Generator(np.random.PCG64(self._seed))
        return self._rng

    def record(self, **values: Any) -> None:
        """Log JSON-serialisable values with the sample (e.g. the augmentation drawn)."""
        self.draws.update(values)


def load_sample(
    stream: Stream,
    seed: int,
    epoch: int,
    sid: int,
    record: dict[str, Any],
    per_sample_rng: bool,
) -> tuple[Any, str | None]:
    """Transform one record as a worker does: ``(item, JSON of its draws or None)``.

    The transform gets a :class:`SampleContext` seeded from ``f(seed, epoch, sid)``;
    with ``per_sample_rng`` torch, numpy and ``random`` are seeded from it too. A packed
    stream's item is its tokens (``int64 (length,)``) with the EOS token appended.
    """
    return sample_loader(stream, seed, epoch, per_sample_rng)(sid, record)


def sample_loader(
    stream: Stream, seed: int, epoch: int, per_sample_rng: bool
) -> Callable[[int, dict[str, Any]], tuple[Any, str | None]]:
    """:func:`load_sample` with the stream, seed, epoch and RNG mode bound: ``(sid,
    record) -> (item, draws)``, what a worker calls once per row (the per-row work is
    only the context, the transform and, packed, the tokens' array).
    """
    transform = stream.transform
    packer = stream.packer
    eos = int(packer.eos_id) if packer is not None else None
    refs = sys.getrefcount
    spare: list[SampleContext] = []  # a context no one holds, for the next row

    def load(sid: int, record: dict[str, Any]) -> tuple[Any, str | None]:
        if type(record) is BadRecord:  # a JSONL line that is not a JSON object
            raise DataError(record.message)
        if per_sample_rng:
            s = sample_seed(seed, epoch, sid)
            seed_globals(s)
            ctx = SampleContext(sid, epoch, s)
        elif spare:  # ~0.4 µs less per row than a new one
            ctx = spare.pop()
            ctx.sample_id = sid
            if ctx._rng is not None:
                ctx._rng = ctx._seed = None
            if ctx.draws:
                ctx.draws = {}  # a new dict: one the transform kept stays as it was
        else:  # the seed is derived only if the transform asks for ctx.rng
            ctx = SampleContext(sid, epoch, None, seed)  # positional: ~0.3 us less per row
        if transform is None:
            item: Any = record
        else:
            held = refs(ctx)
            try:
                item = transform(record, ctx)
            except StopIteration as e:  # it would end the worker's rows early, unnamed
                raise LedgerError(
                    f"the transform raised StopIteration for sample {sid}: raise another "
                    "exception (ValueError, KeyError) for a row it cannot load"
                ) from e
            if refs(ctx) == held and not per_sample_rng:
                # The transform kept no reference to it (in what it returned or
                # elsewhere), so no one can see it change: reused for the next row.
                spare.append(ctx)
        if eos is not None:
            item = _with_eos(item, eos, sid)
        return item, (json.dumps(ctx.draws, sort_keys=True) if ctx.draws else None)

    return load


def _with_eos(item: Any, eos: int, sid: int) -> np.ndarray:
    """A packed sample's tokens: :func:`token_ids` of ``item``, then ``eos`` (``int64``).

    A list led by a Python ``int`` whose every element is an integer within int64 (an
    ``int``, or any object with ``__index__``, such as a numpy integer scalar) is taken
    as it is, also where numpy's promotion would have made the list float (Python ints
    with an ``np.uint64`` scalar) and :func:`token_ids` refuses it.

    Such a list's tokens are a read-only array over ``bytes``, an object the cyclic
    garbage collector does not track: the sample waits in the shuffle buffer for
    thousands of allocations, and a view of the ``array("q")`` would keep three objects
    it tracks (the array, a memoryview and its managed buffer). Long-lived tracked
    objects reach Python's oldest generation, whose growth by a quarter triggers a full
    collection, which walks every tracked object of the process (~2 x 10^5 with torch
    imported; a model and an optimizer add more): a packed epoch of 513 batches at 0
    workers ran 2-3 full collections of ~0.1-0.2 s each, 0-1 with the bytes.

    Raises:
        UnsupportedArgument: as :func:`token_ids`.
    """
    if type(item) is list and item and type(item[0]) is int:
        # The common case, in one conversion: a C ``long long`` array takes only integers
        # (``__index__``: no float, string or None) within int64, so it cannot truncate,
        # and it needs no dtype discovery over the elements (~1.5 µs less for 90 tokens
        # than ``np.array`` of the list, ~0.3 ms per packed batch of ~180 samples); then
        # its bytes (~0.1 µs for 100 tokens: no tracked object waits in the buffer).
        try:
            held = array("q", item)
        except (TypeError, OverflowError):  # nested lists, floats, ...: token_ids says
            pass
        else:
            held.append(eos)
            return np.frombuffer(held.tobytes(), np.int64)
    flat = token_ids(item, sid)
    tokens = np.empty(flat.size + 1, np.int64)
    tokens[:-1] = flat
    tokens[-1] = eos
    return tokens


def token_ids(item: Any, sid: int) -> np.ndarray:
    """A transform's item as the token ids a packer takes: integers, flattened (a nested
    sequence, such as one token list per word or a tokenizer's batch of one, is its
    tokens in order).

    Raises:
        UnsupportedArgument: naming the sample, if the item is not a sequence of
            integers that fit int64 (``None``, a string, floats: ``astype`` would
            truncate 0.5 to token 0 without a word).
    """
    tokens = np.asarray(item)
    if tokens.dtype.kind not in "iu" and tokens.size:
        raise UnsupportedArgument(
            f"the transform gave sample {sid} {_short(item)} ({type(item).__name__}, dtype "
            f"{tokens.dtype}): with a packer it must return a sequence of int token ids"
        )
    # uint64 (numpy's type for a Python int in [2**63, 2**64)) would wrap to negative ids.
    if tokens.dtype == np.uint64 and tokens.size and int(tokens.max()) > _INT64_MAX:
        raise UnsupportedArgument(
            f"the transform gave sample {sid} {_short(item)}: token id {int(tokens.max())} "
            "does not fit int64, the packer's token type"
        )
    return tokens.reshape(-1)


_INT64_MAX = int(np.iinfo(np.int64).max)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def rebuild_batch(
    stream: Stream,
    seed: int,
    epoch: int,
    events: Any,
    per_sample_rng: bool,
    collate_fn: Callable[[list[Any]], Any],
) -> Any:
    """Re-create a logged batch of ``stream`` from its events (see :func:`load_sample`).

    Args:
        stream: the run's stream.
        seed: the run's seed.
        epoch: the batch's epoch.
        events: the batch's ``sample``/``span`` events in batch order (an Arrow table
            with ``sample_id``, ``token_start``, ``token_end`` and ``length`` columns).
        per_sample_rng: whether the run seeded the global RNGs per sample.
        collate_fn: the run's collate function (unpacked streams).

    Returns:
        The batch: ``collate_fn(items)``, or for a packed stream the dict of ``tokens``
        and ``sample_ids`` (``int64 (sequences, seq_len)`` each) that the loader yields.

    Raises:
        LedgerError: if a sample's length or a span differs from the log (changed data
            or a transform that is not deterministic).
    """
    ids = [int(i) for i in events.column("sample_id").to_pylist()]
    unique = sorted(set(ids))
    records = dict(zip(unique, stream.source.read(unique), strict=True))
    with rngs_preserved(True):
        items = {
            sid: load_sample(stream, seed, epoch, sid, records[sid], per_sample_rng)[0]
            for sid in dict.fromkeys(ids)
        }
    packer = stream.packer
    if packer is None:
        return collate_fn([items[sid] for sid in ids])
    spans = list(
        zip(
            events.column("token_start").to_pylist(),
            events.column("token_end").to_pylist(),
            events.column("length").to_pylist(),
            strict=True,
        )
    )
    return assemble(packer, ids, spans, items.__getitem__)
