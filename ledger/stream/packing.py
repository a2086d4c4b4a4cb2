"""Sequence packing: one state machine for the workers, the replicas and re-creation.

A packer concatenates tokenised samples, each followed by EOS, into sequences of
``seq_len`` tokens; a sample that does not fit is split and its rest starts the next
sequence. Which tokens of which sample land where is a pure function of the packer's
state (:class:`PackState`: the sample in progress and the samples another shape left
partly packed) and of the lengths of the samples that come next, so three places run
the same machine:

- a worker packs real tokens (:meth:`PackState.pack` chooses the spans,
  :func:`assemble` copies the tokens);
- the main process's replica folds the logged spans ids-only
  (:meth:`PackState.fold`, vectorised), checking they continue the packer's state;
- ``ledger show --materialize`` re-creates a logged batch from its spans
  (:func:`assemble`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ledger.errors import LedgerError
from ledger.torch_args import count

Tail = tuple[int, int, int]  # (sample id, tokens already packed, length in tokens)


@dataclass(frozen=True, slots=True)
class Packer:
    """Concatenates tokenised samples, each followed by ``eos_id``, into sequences.

    A sample that does not fit is split: the rest starts the next sequence. The last
    sequence of a logical worker's epoch is padded with ``pad_id`` (its ``sample_ids`` are
    ``-1`` there), so every token of every sample is served exactly once per epoch.

    Args:
        seq_len: tokens per sequence (>= 1).
        eos_id: token appended after each sample.
        pad_id: token that fills the end of a worker's last sequence of an epoch.
    """

    seq_len: int
    eos_id: int = 0
    pad_id: int = 0

    def __post_init__(self) -> None:
        count("seq_len", self.seq_len, 1)
        count("eos_id", self.eos_id, -(1 << 63))
        count("pad_id", self.pad_id, -(1 << 63))


class PackState:
    """Where a packer stands between two batches.

    Args:
        doc: the sample in progress ``(sample id, tokens packed, length)``, or ``None``
            when the next span begins a sample.
        tails: samples another shape left partly packed, to finish first (in order).
        who: how errors name the packer (e.g. ``"worker 3"``).
    """

    __slots__ = ("doc", "tails", "who")

    def __init__(self, doc: Tail | None, tails: list[Tail], who: str = "the packer") -> None:
        self.doc = doc
        self.tails = list(tails)
        self.who = who

    def exhausted(self) -> bool:
        """No sample in progress and no tail left."""
        return self.doc is None and not self.tails

    def pack(
        self,
        seq_len: int,
        sequences: int,
        pull: Callable[[], tuple[int, int] | None],
        open_tail: Callable[[Tail], None],
    ) -> list[tuple[int, int, int, int]]:
        """Choose the spans of up to ``sequences`` sequences (the worker's side).

        Tails come first, then samples from ``pull``. A sequence is filled before the
        next begins; only the last one of the worker's epoch may be short.

        Args:
            seq_len: tokens per sequence.
            sequences: sequences wanted (the batch size).
            pull: the next sample ``(sample id, length in tokens)``, or ``None`` at the
                end of the worker's epoch.
            open_tail: called with a tail before its first span (to load its tokens).

        Returns:
            Spans ``(sample id, token start, token end, length)`` in packing order.
        """
        spans: list[tuple[int, int, int, int]] = []
        for _ in range(sequences):
            n = 0
            while n < seq_len:
                if self.doc is None and self.tails:
                    self.doc = self.tails.pop(0)
                    open_tail(self.doc)
                if self.doc is None:
                    nxt = pull()
                    if nxt is None:
                        break
                    self.doc = (nxt[0], 0, nxt[1])
                sid, off, length = self.doc
                take = min(seq_len - n, length - off)
                spans.append((sid, off, off + take, length))
                self.doc = (sid, off + take, length) if off + take < length else None
                n += take
            if n == 0:
                break
        return spans

    def fold(
        self, ids: np.ndarray, spans: np.ndarray, expect: Callable[[np.ndarray], None]
    ) -> np.ndarray:
        """Advance by a batch's logged spans (the replica's side), checking each continues
        the sample in progress or begins one.

        Args:
            ids: ``int64 (rows,)``: the sample of each span.
            spans: ``int64 (rows, 3)``: ``token_start, token_end, length``.
            expect: checks the ids of the samples that begin here, in order, against the
                worker's id stream.

        Returns:
            ``bool (rows,)``: the spans that begin a sample from the worker's id stream
            (not a tail another shape left).

        Raises:
            LedgerError: if a span does not continue the packer's state.
        """
        if self.tails:
            return self._fold_slowly(ids, spans, expect)
        n = ids.size
        if n == 0:
            return np.zeros(0, bool)
        # Few numpy calls on small arrays (each costs ~1 µs whatever its size; this runs
        # once per batch in the main process), and no Python loop over the spans.
        start, end, length = spans[:, 0], spans[:, 1], spans[:, 2]
        doc = self.doc
        s0 = int(start[0])
        if (s0 != 0) if doc is None else (int(ids[0]) != doc[0] or s0 != doc[1]):
            self._refuse(0, ids, spans, doc[:2] if doc else None)
        # Span i > 0 continues span i - 1's sample if that one did not finish it (then it
        # is the same sample, from where that one ended), else it begins one at token 0:
        # ``start[i] - end[i - 1] * going`` and ``(ids[i] - ids[i - 1]) * going`` are 0.
        going = end[:-1] < length[:-1]
        bad = start[1:] - end[:-1] * going
        bad |= (ids[1:] - ids[:-1]) * going
        if np.count_nonzero(bad):
            i = int(np.flatnonzero(bad)[0]) + 1
            prev = (int(ids[i - 1]), int(end[i - 1])) if going[i - 1] else None
            self._refuse(i, ids, spans, prev)
        begins = np.empty(n, bool)
        begins[0] = doc is None
        np.logical_not(going, out=begins[1:])
        expect(ids[begins])
        e, le = int(end[-1]), int(length[-1])
        self.doc = None if e >= le else (int(ids[-1]), e, le)
        return begins

    def fold_owners(self, ids: np.ndarray, spans: np.ndarray) -> tuple[np.ndarray, int]:
        """:meth:`fold` in fewer array operations, for the replica's hot path (no tails).

        Checks that every span's tokens continue the packer (a span starts where the
        previous one ended if that one left its sample unfinished, else at token 0) and
        says which sample each span must belong to; the caller checks the ids: ``ids ==
        owners[index]``, where ``owners`` is the sample in progress at the batch's start
        (if any) followed by the next ``begun`` ids of the worker's id stream. One
        comparison of the whole batch then checks both the samples begun here and that
        a continuing span keeps its sample.

        Args:
            ids: ``int64 (rows,)``: the sample of each span.
            spans: ``int64 (rows, 3)``: ``token_start, token_end, length``
                (column-major, so each column is contiguous).

        Returns:
            ``(index, begun)``: ``int64 (rows,)`` into ``owners``, and how many samples
            begin here.

        Raises:
            LedgerError: if a span does not start where the packer stands. The caller
                that finds the ids differ from ``owners[index]`` re-folds the batch
                with :meth:`fold` from the state before it, for the precise error.
        """
        n = ids.size
        doc = self.doc
        if n == 0:
            return np.zeros(0, np.int64), 0
        start, end, length = spans[:, 0], spans[:, 1], spans[:, 2]
        if start.item(0) != (0 if doc is None else doc[1]):
            self._refuse(0, ids, spans, doc[:2] if doc else None)
        # int64 throughout: a ufunc on int64 and bool operands, and an accumulate that
        # casts bool, cost 2-5x the same on int64 (~1 µs each on a batch's spans).
        going = np.less(end, length).astype(np.int64)  # 1: span i + 1 goes on with its sample
        if start[1:].tobytes() != (end * going)[:-1].tobytes():
            self.fold(ids, spans, _nothing)  # from 0 after a finish: raises the precise error
        # Span i's sample: the one in progress (index 0, if any), else the latest begun.
        index = np.empty(n, np.int64)
        index[0] = 0
        np.subtract(1, going[:-1], out=index[1:])
        np.add.accumulate(index, out=index)
        begun = index.item(-1) + (doc is None)
        e, le = end.item(-1), length.item(-1)
        self.doc = None if e >= le else (ids.item(-1), e, le)
        return index, begun

    def _refuse(
        self, i: int, ids: np.ndarray, spans: np.ndarray, at: tuple[int, int] | None
    ) -> None:
        start, end = int(spans[i, 0]), int(spans[i, 1])
        raise LedgerError(
            f"{self.who} packed tokens [{start}, {end}) of "
            f"sample {int(ids[i])}, but its packer was at {at if at else 'a new sample'}"
        )

    def _fold_slowly(
        self, ids: np.ndarray, spans: np.ndarray, expect: Callable[[np.ndarray], None]
    ) -> np.ndarray:
        """Span by span: while samples another shape left come first."""
        begins = np.zeros(ids.size, bool)
        for i, (sid, (start, end, length)) in enumerate(
            zip(ids.tolist(), spans.tolist(), strict=True)
        ):
            if self.doc is None:
                if self.tails:
                    self.doc = self.tails.pop(0)
                elif start == 0:
                    expect(np.array([sid], np.int64))
                    begins[i] = True
                    self.doc = (sid, 0, length)
            if self.doc is None or self.doc[:2] != (sid, start):
                raise LedgerError(
                    f"{self.who} packed tokens [{start}, {end}) of sample {sid}, "
                    f"but its packer was at {self.doc}"
                )
            self.doc = (sid, end, length) if end < length else None
        return begins


def _nothing(ids: np.ndarray) -> None:
    return None


def assemble(
    packer: Packer,
    ids: list[int],
    spans: list[tuple[int, int, int]] | np.ndarray,
    tokens: Callable[[int], np.ndarray],
) -> dict[str, torch.Tensor]:
    """Lay spans out into sequences and copy their tokens: the batch a packed stream yields.

    A sequence is filled before the next one begins; the last may be short and is padded
    with ``pad_id`` (its ``sample_ids`` are ``-1`` there).

    Args:
        packer: the stream's packer.
        ids: the sample of each span.
        spans: ``(token_start, token_end, length)`` of each span (``int64 (rows, 3)``, or
            a list of triples).
        tokens: a sample's tokens (``int64 (length,)``, EOS included) by sample id;
            called once per span, in order.

    Returns:
        ``{"tokens", "sample_ids"}``: ``int64 (sequences, seq_len)`` each.

    Raises:
        LedgerError: if a sample's length differs from its span's, or the spans are not
            a packing of this packer (changed data or a transform that is not
            deterministic); the first such span is named.
    """
    seq_len = packer.seq_len
    arr = np.asarray(spans, np.int64).reshape(-1, 3)
    start, end, length = arr[:, 0], arr[:, 1], arr[:, 2]
    docs = [tokens(sid) for sid in ids]
    # Whole-batch checks and copies: a Python step per span costs ~2 µs, and a packed
    # batch has hundreds of spans.
    have = np.fromiter(map(len, docs), np.int64, len(docs))
    take = end - start
    wrong = (have != length) | (start < 0) | (start >= end) | (end > length) | (take > seq_len)
    # A sequence is full before the next begins: a span that starts inside a sequence
    # fits in what is left of it. (``take`` of a wrong span may be anything: masked.)
    take = np.where(wrong, 0, take)
    at = np.cumsum(take) - take  # tokens laid out before each span
    inside = at % seq_len
    overflows = (inside != 0) & (inside + take > seq_len)
    bad = np.flatnonzero(wrong | overflows)
    if bad.size:
        i = int(bad[0])
        sid, s, e, n = int(ids[i]), int(start[i]), int(end[i]), int(length[i])
        if wrong[i]:
            raise LedgerError(
                f"sample {sid} has {int(have[i])} tokens now; the log packed tokens "
                f"[{s}, {e}) of {n}: the data or the transform changed"
            )
        raise LedgerError(
            f"the log packs a span of {e - s} tokens of sample {sid} into a sequence "
            f"with {seq_len - int(inside[i])} tokens left: it is not this stream's packing"
        )
    total = int(take.sum())
    rows = -(-total // seq_len)
    both = _int64_pair(rows, seq_len)
    flat_tokens, flat_owners = both.numpy().reshape(2, -1)
    if docs:
        pieces = [d[s:e] for d, s, e in zip(docs, start.tolist(), end.tolist(), strict=True)]
        np.concatenate(pieces, out=flat_tokens[:total], casting="unsafe")
        flat_owners[:total] = np.repeat(np.asarray(ids, np.int64), take)
    flat_tokens[total:] = packer.pad_id  # the padding of a short last sequence
    flat_owners[total:] = -1
    return {"tokens": both[0], "sample_ids": both[1]}


def _int64_pair(rows: int, seq_len: int) -> torch.Tensor:
    """An uninitialised ``int64 (2, rows, seq_len)`` tensor: a packed batch's tokens and
    owners in one buffer, so that a worker sends the batch to the main process as one
    block of shared memory, not two (sharing and mapping one costs ~0.6 ms).

    In a DataLoader worker it is allocated in shared memory from the start, as torch's
    ``default_collate`` does, so sending it copies nothing.
    """
    if torch.utils.data.get_worker_info() is None:
        return torch.empty((2, rows, seq_len), dtype=torch.int64)
    storage = torch.UntypedStorage._new_shared(2 * rows * seq_len * 8)
    return torch.empty(0, dtype=torch.int64).set_(storage).view(2, rows, seq_len)
