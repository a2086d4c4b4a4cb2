"""The main process's ids-only mirror of each logical worker of a stream.

The main process does not replay a worker sample by sample: each :class:`Replica` runs
the worker's :class:`~ledger.stream.shuffle.IdFeed` (the same ids, computed a chunk at a
time) and checks each consumed batch against it with array operations.
"""

from __future__ import annotations

import numpy as np

from ledger.commits import WorkerState
from ledger.errors import LedgerError
from ledger.stream.pipeline import BatchMeta, EpochPlan, Stream, Tail, buffer_key
from ledger.stream.shuffle import IdFeed


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
        self.doc = doc
        self.tails = list(tails)

    def exhausted(self) -> bool:
        return self.feed.exhausted() and self.doc is None and not self.tails

    def state(self) -> WorkerState:
        f = self.feed
        d = self.doc if self.doc is not None else (-1, 0, 0)
        return WorkerState(
            self.worker,
            f.shard,
            f.row,
            f.rows_read,
            f.draws,
            f.emitted,
            *d,
            tails=tuple(self.tails),
        )

    def fold(self, meta: BatchMeta) -> None:
        """Advance by one consumed batch, checking it is what the plan predicts.

        Raises:
            LedgerError: if the batch differs from the prediction (the data or the
                worker's code is not deterministic).
        """
        ids = meta.sample_ids
        if meta.spans is None:
            self._expect(ids)
        elif self.tails:
            self._fold_spans_slowly(ids, meta.spans)
        else:
            self._fold_spans(ids, meta.spans)

    def _expect(self, ids: np.ndarray) -> None:
        want = self.feed.take(ids.size)
        if want.size != ids.size or not np.array_equal(want, ids):
            bad = next(
                (i for i in range(ids.size) if i >= want.size or want[i] != ids[i]), ids.size
            )
            said = int(want[bad]) if bad < want.size else "the end of its epoch"
            raise LedgerError(
                f"worker {self.worker} produced sample {int(ids[bad])}, but the plan says "
                f"{said}: the pipeline is not deterministic (changed data, or a transform "
                "that changes the order)"
            )

    def _fold_spans(self, ids: np.ndarray, spans: np.ndarray) -> None:
        """Packed batch, vectorised: spans continue their document or begin the next."""
        n = ids.size
        if n == 0:
            return
        start, end, length = spans[:, 0], spans[:, 1], spans[:, 2]
        # Span i begins a document iff the one before it finished its document.
        finished = end >= length
        begins = np.empty(n, bool)
        begins[0] = self.doc is None
        begins[1:] = finished[:-1]
        cont = ~begins
        prev_ids = np.empty(n, np.int64)
        prev_end = np.empty(n, np.int64)
        if self.doc is not None:
            prev_ids[0], prev_end[0] = self.doc[0], self.doc[1]
        prev_ids[1:], prev_end[1:] = ids[:-1], end[:-1]
        bad = (cont & ((ids != prev_ids) | (start != prev_end))) | (begins & (start != 0))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            at = (int(prev_ids[i]), int(prev_end[i])) if cont[i] else None
            raise LedgerError(
                f"worker {self.worker} packed tokens [{int(start[i])}, {int(end[i])}) of "
                f"sample {int(ids[i])}, but its packer was at {at if at else 'a new sample'}"
            )
        self._expect(ids[begins])
        last = n - 1
        self.doc = None if finished[last] else (int(ids[last]), int(end[last]), int(length[last]))

    def _fold_spans_slowly(self, ids: np.ndarray, spans: np.ndarray) -> None:
        """Packed batch, span by span: while samples another shape left come first."""
        for sid, (start, end, length) in zip(ids.tolist(), spans.tolist(), strict=True):
            if self.doc is None:
                if self.tails:
                    self.doc = self.tails.pop(0)
                elif start == 0:
                    self._expect(np.array([sid], np.int64))
                    self.doc = (sid, 0, length)
            if self.doc is None or self.doc[:2] != (sid, start):
                raise LedgerError(
                    f"worker {self.worker} packed tokens [{start}, {end}) of sample {sid}, "
                    f"but its packer was at {self.doc}"
                )
            self.doc = (sid, end, length) if end < length else None


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
        )
        doc = (st.doc, st.doc_offset, st.doc_length) if st.doc >= 0 else None
        out.append(Replica(feed, st.worker, doc, list(st.tails)))
    return out


def next_worker(reps: list[Replica], after: int) -> int:
    """The first logical worker after ``after`` (cyclically) that is not exhausted; -1 if none."""
    n = len(reps)
    for step in range(1, n + 1):
        w = (after + step) % n
        if not reps[w].exhausted():
            return w
    return -1
