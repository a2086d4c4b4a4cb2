"""The main process's ids-only mirror of each logical worker of a stream.

The main process does not replay a worker sample by sample: each :class:`Replica` runs
the worker's :class:`~ledger.stream.shuffle.IdFeed` (the same ids, computed a chunk at a
time) and checks each consumed batch against it with array operations.
"""

from __future__ import annotations

import numpy as np

from ledger.commits import WorkerState
from ledger.errors import LedgerError
from ledger.stream.packing import PackState, Tail
from ledger.stream.plan import EpochPlan, buffer_key
from ledger.stream.shuffle import IdFeed
from ledger.stream.spec import Stream
from ledger.stream.worker import BatchMeta

_NOWHERE = np.zeros(0, np.int64)


class Replica:
    """Ids-only mirror of one logical worker, folded from the batches consumed from it.

    Args:
        feed: the worker's id stream.
        worker: logical worker id.
        doc: the packer's document in progress ``(sample id, tokens packed, length)``.
        tails: samples another shape left partly packed, to finish first.
    """

    def __init__(
        self, feed: IdFeed, worker: int, doc: tuple[int, int, int] | None, tails: list[Tail]
    ) -> None:
        self.feed = feed
        self.worker = worker
        self.packing = PackState(doc, tails, f"worker {worker}")
        # Epoch position of the packer's sample in progress (``int64 (1,)``), once known.
        self._doc_placed: np.ndarray | None = None

    @property
    def doc(self) -> Tail | None:
        """The packer's sample in progress ``(sample id, tokens packed, length)``."""
        return self.packing.doc

    @property
    def tails(self) -> list[Tail]:
        """Samples another shape left partly packed, still to finish."""
        return self.packing.tails

    def exhausted(self) -> bool:
        return self.feed.exhausted() and self.packing.exhausted()

    def state(self) -> WorkerState:
        d = self.packing.doc if self.packing.doc is not None else (-1, 0, 0)
        tails = self.packing.tails
        return WorkerState(self.worker, *self.feed.cursor(), *d, tuple(tails) if tails else ())

    def fold(self, meta: BatchMeta) -> np.ndarray | None:
        """Advance by one consumed batch, checking it is what the plan predicts.

        Returns:
            The epoch position of each row's sample (``int64 (rows,)``; rows are
            samples, or spans with packing), or ``None`` if the feed has no ``locate``.

        Raises:
            LedgerError: if the batch differs from the prediction (the data or the
                worker's code is not deterministic).
        """
        ids = meta.sample_ids
        locate = self.feed.locate
        if meta.failures:
            self._fold_failures(meta, meta.failures)
            self._doc_placed = None
            return None if locate is None else locate(ids)
        if meta.spans is not None:
            if locate is None or self.packing.tails:
                self.packing.fold(ids, meta.spans, self._expect)
                self._doc_placed = None
                return None if locate is None else locate(ids)
            return self._fold_spans(ids, meta.spans)
        if locate is None:
            self._expect(ids)
            return None
        want, placed = self.feed.take_placed(ids.size)
        self._check(ids, want)
        return placed

    def _fold_spans(self, ids: np.ndarray, spans: np.ndarray) -> np.ndarray:
        """Fold a packed batch (no tails): check it in one comparison, place its rows."""
        if ids.size == 0:
            return _NOWHERE
        doc = self.packing.doc
        index, begun = self.packing.fold_owners(ids, spans)
        # The sample in progress (if any) owns the first spans: ``owners`` is it followed by
        # the samples begun here. Mostly it is the id the feed handed on last, so one slice
        # of the feed gives both (no copy).
        after = None if doc is None else self.feed.take_placed_after(begun, doc[0])
        if after is not None:
            want, places = after
        else:
            want, places = self.feed.take_placed(begun)
            if doc is not None:
                if self._doc_placed is None:  # a sample the replica did not begin
                    self._doc_placed = self.feed.locate(np.array(doc[:1], np.int64))  # type: ignore[misc]
                want = np.concatenate((np.array(doc[:1], np.int64), want))
                places = np.concatenate((self._doc_placed, places))
        if ids.dtype != np.int64:
            ids = ids.astype(np.int64)
        if want.size <= index.item(-1) or want[index].tobytes() != ids.tobytes():
            # Another sample than the plan's: re-fold from the batch's start for the
            # precise error (a span that does not continue its sample, or the id stream's).
            self.packing.doc = doc
            start = 0 if doc is None else 1
            self.packing.fold(ids, spans, lambda begun_ids: self._check(begun_ids, want[start:]))
            raise LedgerError(f"worker {self.worker} produced a batch the plan does not predict")
        placed = places[index]
        self._doc_placed = placed[-1:] if self.packing.doc is not None else None
        return placed

    def _fold_failures(self, meta: BatchMeta, failures: list[tuple[int, int, str]]) -> None:
        # Samples that failed to load (on_error="skip") left the shuffled stream between
        # the good ones: the ids taken are the good ones with the failed ones put back.
        begun: list[np.ndarray] = []
        if meta.spans is None:
            begun.append(meta.sample_ids)
        else:
            self.packing.fold(meta.sample_ids, meta.spans, begun.append)
        good = np.concatenate(begun) if begun else np.zeros(0, np.int64)
        taken = np.empty(meta.pulled, np.int64)
        failed = np.zeros(meta.pulled, np.bool_)
        at = [k for _, k, _ in failures]
        if good.size + len(at) != meta.pulled or not all(0 <= k < meta.pulled for k in at):
            raise LedgerError(
                f"worker {self.worker} says it took {meta.pulled} samples for a batch, but "
                f"the batch begins {good.size} and {len(at)} failed"
            )
        failed[at] = True
        taken[failed] = [sid for sid, _, _ in failures]
        taken[~failed] = good
        self._expect(taken)

    def _expect(self, ids: np.ndarray) -> None:
        self._check(ids, self.feed.take(ids.size))

    def _check(self, ids: np.ndarray, want: np.ndarray) -> None:
        # Comparing the raw bytes of two int64 arrays is one memcmp (~10x cheaper than
        # np.array_equal on a batch).
        if ids.dtype != np.int64:
            ids = ids.astype(np.int64)
        if want.size != ids.size or want.tobytes() != ids.tobytes():
            bad = next(
                (i for i in range(ids.size) if i >= want.size or want[i] != ids[i]), ids.size
            )
            said = int(want[bad]) if bad < want.size else "the end of its epoch"
            raise LedgerError(
                f"worker {self.worker} produced sample {int(ids[bad])}, but the plan says "
                f"{said}: the pipeline is not deterministic (changed data, or a transform "
                "that changes the order)"
            )


def replicas(
    stream: Stream,
    plan: EpochPlan,
    rank: int,
    seed: int,
    states: tuple[WorkerState, ...],
    buffers: dict[int, list[int]],
) -> list[Replica]:
    """Ids-only replicas of a rank's logical workers at the given states and buffers."""
    out = []
    for st in states:
        feed = IdFeed(
            stream.source,
            plan.pieces(rank, st.worker),
            st,
            buffers.get(st.worker, []),
            stream.shuffle_buffer,
            buffer_key(seed, plan.epoch, rank, st.worker),
            plan.positions,
            ahead=True,
        )
        doc = (st.doc, st.doc_offset, st.doc_length) if st.doc >= 0 else None
        out.append(Replica(feed, st.worker, doc, list(st.tails)))
    return out


def next_worker(reps: list[Replica], after: int) -> int:
    """The first logical worker after ``after`` (cyclically) that is not exhausted; -1 if none."""
    n = len(reps)
    nxt = after + 1 if after + 1 < n else 0
    if not reps[nxt].exhausted():  # the common case, once per batch
        return nxt
    for step in range(2, n + 1):
        w = (after + step) % n
        if not reps[w].exhausted():
            return w
    return -1
