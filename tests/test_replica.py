"""The vectorised id stream (IdFeed), the workers' Feed and the replica equal the shuffle buffer's
sample-at-a-time definition (DocFeed, below)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ledger.stream.shuffle as shuffle_module
from ledger.commits import WorkerState
from ledger.errors import LedgerError
from ledger.order import _mix_scalar
from ledger.stream.packing import PackState
from ledger.stream.replica import Replica
from ledger.stream.shuffle import IdFeed
from ledger.stream.worker import BatchMeta, Feed

_M64 = (1 << 64) - 1
_DEFAULT_CHUNK = shuffle_module._CHUNK
_GOLDEN = 0x9E3779B97F4A7C15


class DocFeed:
    """The shuffle buffer's definition, a sample at a time (the workers' code before the
    vectorised IdFeed): the reference both IdFeed and the workers' Feed must equal.

    Args:
        source: the rows (their counts; data is read through ``read``).
        pieces: the worker's row ranges ``(shard, start, stop)`` in reading order.
        state: where the worker stands.
        buffer: sample ids in the buffer's slots, in slot order.
        payloads: payloads of those slots (``None``: a replica, ids only).
        size: buffer size (rows).
        key: 64-bit key of the buffer's counter-based generator.
        read: ``(shard, row, stop) -> iterator of payloads of that shard from that row``;
            ``None`` for a replica.
    """

    def __init__(
        self,
        source: Any,
        pieces: list[tuple[int, int, int]],
        state: WorkerState,
        buffer: list[int],
        payloads: list[Any] | None,
        size: int,
        key: int,
        read: Callable[[int, int, int], Iterator[Any]] | None = None,
    ) -> None:
        self.source = source
        self.pieces = pieces
        self.shard = state.shard
        self.row = state.row
        self.rows_read = state.rows_read
        self.draws = state.draws
        self.emitted = state.emitted
        self.ids = list(buffer)
        self.payloads = payloads if payloads is not None else [None] * len(buffer)
        self.size = size
        self.key = key
        self._read = read
        self._rows: Iterator[Any] | None = None
        self._skip_empty()

    def _skip_empty(self) -> None:
        # ``shard`` indexes the pieces; ``row`` is the next row of that piece's shard.
        while self.shard < len(self.pieces):
            _, start, stop = self.pieces[self.shard]
            self.row = max(self.row, start)
            if self.row < stop:
                return
            self.shard += 1
            self.row = 0
            self._rows = None

    def has_rows(self) -> bool:
        return self.shard < len(self.pieces)

    def exhausted(self) -> bool:
        """No row left to read and nothing in the buffer."""
        return not self.has_rows() and not self.ids

    def _next_row(self) -> tuple[int, Any]:
        file, _, stop = self.pieces[self.shard]
        sid = int(self.source.offsets[file]) + self.row
        payload = None
        if self._read is not None:
            if self._rows is None:
                self._rows = self._read(file, self.row, stop)
            payload = next(self._rows)
        self.row += 1
        self.rows_read += 1
        self._skip_empty()
        return sid, payload

    def _draw(self, n: int) -> int:
        j = _mix_scalar((self.key + self.draws * _GOLDEN) & _M64) % n
        self.draws += 1
        return j

    def next(self) -> tuple[int, Any] | None:
        """The next sample of the shuffled stream, or ``None`` at the end of the epoch."""
        if self.size == 0:
            if not self.has_rows():
                return None
            self.emitted += 1
            return self._next_row()
        while len(self.ids) < self.size and self.has_rows():
            sid, payload = self._next_row()
            self.ids.append(sid)
            self.payloads.append(payload)
        if not self.ids:
            return None
        j = self._draw(len(self.ids))
        out = (self.ids[j], self.payloads[j])
        if self.has_rows():
            self.ids[j], self.payloads[j] = self._next_row()
        else:  # drain: remove slot j, keep the others in order of their slots
            self.ids[j], self.payloads[j] = self.ids[-1], self.payloads[-1]
            self.ids.pop()
            self.payloads.pop()
        self.emitted += 1
        return out

    def state(
        self, worker: int, doc: tuple[int, int, int] | None, tails: list[tuple[int, int, int]]
    ) -> WorkerState:
        """The worker's state now; ``doc`` is the packer's ``(sample id, offset, length)``."""
        d = doc if doc is not None else (-1, 0, 0)
        return WorkerState(
            worker,
            self.shard,
            self.row,
            self.rows_read,
            self.draws,
            self.emitted,
            *d,
            tails=tuple(tails),
        )


def _source(rows: list[int]) -> SimpleNamespace:
    return SimpleNamespace(offsets=np.concatenate([[0], np.cumsum(rows)]).astype(np.int64))


@st.composite
def feeds(draw: st.DrawFn) -> tuple:
    rows = draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    pieces = []
    for f, n in enumerate(rows):
        if draw(st.booleans()):
            lo = draw(st.integers(0, n))
            pieces.append((f, lo, draw(st.integers(lo, n))))
    pieces = draw(st.permutations(pieces))
    size = draw(st.sampled_from([0, 1, 2, 3, 7, 16, 50]))
    key = draw(st.integers(0, 2**64 - 1))
    skip = draw(st.integers(0, 60))  # samples handed on before the replica starts
    chunks = draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    return rows, pieces, size, key, skip, chunks


@settings(max_examples=300, deadline=None)
@given(feeds(), st.sampled_from([1, 3, 17, 4096]), st.booleans())
def test_idfeed_equals_docfeed_from_any_state(case: tuple, chunk: int, ahead: bool) -> None:
    """Step for step, whatever the chunk of steps computed at once, and whether each
    chunk is computed ahead on the background thread (``ahead``) or when needed."""
    rows, pieces, size, key, skip, chunks = case
    shuffle_module._CHUNK = chunk
    try:
        source = _source(rows)
        worker = DocFeed(source, list(pieces), WorkerState(0), [], None, size, key)  # type: ignore[arg-type]
        for _ in range(skip):
            if worker.next() is None:
                break
        state = worker.state(0, None, [])
        replica = IdFeed(source, list(pieces), state, list(worker.ids), size, key, ahead=ahead)  # type: ignore[arg-type]
        for k in chunks:
            want = []
            for _ in range(k):
                nxt = worker.next()
                if nxt is None:
                    break
                want.append(nxt[0])
            got = replica.take(k)
            assert got.tolist() == want
            assert replica.buffer() == worker.ids
            assert replica.exhausted() == worker.exhausted()
            assert (
                replica.shard,
                replica.row,
                replica.rows_read,
                replica.draws,
                replica.emitted,
            ) == (
                worker.shard,
                worker.row,
                worker.rows_read,
                worker.draws,
                worker.emitted,
            )
    finally:
        shuffle_module._CHUNK = _DEFAULT_CHUNK


def _placed_in(source: SimpleNamespace) -> Callable[[np.ndarray], np.ndarray]:
    """A stand-in for an epoch plan's positions: each sample id plus a constant of its
    shard (what ``IdFeed`` requires of ``locate``), a different one per shard."""
    shift = np.arange(len(source.offsets) - 1, dtype=np.int64)[::-1] * 7919 + 3

    def placed(ids: np.ndarray) -> np.ndarray:
        return ids + shift[np.searchsorted(source.offsets, ids, side="right") - 1]

    return placed


@settings(max_examples=200, deadline=None)
@given(feeds(), st.sampled_from([1, 3, 17, 4096]), st.sampled_from([0, 1, 4, 9]), st.booleans())
def test_replica_positions_and_states_follow_the_worker(
    case: tuple, chunk: int, seq_len: int, ahead: bool
) -> None:
    """Batch after batch (packed when ``seq_len`` > 0), the replica returns every row's
    position and the worker's state, whatever the chunk of steps computed at once and
    whether computed ahead (``ahead``)."""
    rows, pieces, size, key, skip, batches = case
    shuffle_module._CHUNK = chunk
    try:
        source = _source(rows)
        worker = DocFeed(source, list(pieces), WorkerState(0), [], None, size, key)  # type: ignore[arg-type]
        for _ in range(skip):
            if worker.next() is None:
                break
        state = worker.state(0, None, [])
        _placed = _placed_in(source)
        feed = IdFeed(
            source,  # type: ignore[arg-type]
            list(pieces),
            state,
            list(worker.ids),
            size,
            key,
            _placed,
            ahead=ahead,
        )
        replica = Replica(feed, 0, None, [])
        packer = PackState(None, [])

        def pull() -> tuple[int, int] | None:
            nxt = worker.next()
            return None if nxt is None else (nxt[0], 1 + nxt[0] % 7)  # length: 1-7 tokens

        for k in batches:
            if seq_len:
                chosen = packer.pack(seq_len, k, pull, lambda tail: None)
                meta = _meta([c[0] for c in chosen], [c[1:] for c in chosen])
            else:
                taken = [nxt[0] for _ in range(k) if (nxt := worker.next()) is not None]
                meta = _meta(taken, None)
            placed = replica.fold(meta)
            assert placed is not None
            assert placed.tolist() == _placed(meta.sample_ids).tolist()
            assert replica.state() == worker.state(0, packer.doc, [])
            assert replica.exhausted() == (worker.exhausted() and packer.exhausted())
    finally:
        shuffle_module._CHUNK = _DEFAULT_CHUNK


def _meta(ids: list[int], spans: list[tuple[int, int, int]] | None) -> BatchMeta:
    arr = None if spans is None else np.array(spans, np.int64).reshape(-1, 3)
    return BatchMeta(0, 0, np.array(ids, np.int64), arr, None)


def _replica(size: int = 0, placed: bool = False) -> Replica:
    source = _source([10])
    locate = _placed_in(source) if placed else None
    feed = IdFeed(source, [(0, 0, 10)], WorkerState(0), [], size, 7, locate)  # type: ignore[arg-type]
    return Replica(feed, 0, None, [])


@pytest.mark.parametrize("placed", [False, True])
def test_fold_checks_ids_and_packing(placed: bool) -> None:
    """The same errors with and without positions (with: packed batches take the
    one-comparison path, PackState.fold_owners)."""
    r = _replica(placed=placed)
    r.fold(_meta([0, 1], None))
    with pytest.raises(LedgerError, match="produced sample 3, but the plan says 2"):
        r.fold(_meta([3], None))
    r = _replica(placed=placed)
    # Sample 0 (5 tokens) split over two sequences, then sample 1 begins.
    first = r.fold(_meta([0], [(0, 3, 5)]))
    assert r.doc == (0, 3, 5)
    after = r.fold(_meta([0, 1], [(3, 5, 5), (0, 1, 4)]))
    assert r.doc == (1, 1, 4)
    if placed:
        assert first is not None and after is not None
        assert (first.tolist(), after.tolist()) == ([3], [3, 4])  # id + 3 (one shard)
    assert r.state().emitted == 2
    with pytest.raises(LedgerError, match=r"packed tokens \[2, 4\) of sample 1"):
        r.fold(_meta([1], [(2, 4, 4)]))  # skips token 1
    r = _replica(placed=placed)
    with pytest.raises(LedgerError, match="produced sample 1, but the plan says 0"):
        r.fold(_meta([1], [(0, 2, 2)]))
    # Inside a batch: a sample begun out of the plan's order, a span that continues
    # its sample under another id, a span that starts past where its sample stood,
    # and a sample past the end of the worker's epoch.
    r = _replica(placed=placed)
    with pytest.raises(LedgerError, match="produced sample 2, but the plan says 1"):
        r.fold(_meta([0, 2], [(0, 3, 3), (0, 1, 4)]))
    r = _replica(placed=placed)
    with pytest.raises(
        LedgerError, match=r"packed tokens \[3, 5\) of sample 1, but its packer was at \(0, 3\)"
    ):
        r.fold(_meta([0, 1], [(0, 3, 5), (3, 5, 5)]))
    r = _replica(placed=placed)
    with pytest.raises(
        LedgerError, match=r"packed tokens \[4, 5\) of sample 0, but its packer was at \(0, 3\)"
    ):
        r.fold(_meta([0, 0], [(0, 3, 5), (4, 5, 5)]))
    r = _replica(placed=placed)
    r.fold(_meta(list(range(10)), None))
    with pytest.raises(LedgerError, match="produced sample 10, but the plan says the end"):
        r.fold(_meta([10], [(0, 1, 1)]))


@settings(max_examples=150, deadline=None)
@given(feeds())
def test_the_workers_feed_equals_the_definition_with_payloads(case: tuple) -> None:
    rows, pieces, size, key, skip, _ = case
    source = _source(rows)

    def read(shard: int, row: int, stop: int) -> Iterator[str]:
        base = int(source.offsets[shard])
        return (f"payload {base + r}" for r in range(row, stop))

    reference = DocFeed(source, list(pieces), WorkerState(0), [], None, size, key, read)
    for _ in range(skip):
        if reference.next() is None:
            break
    state = reference.state(0, None, [])
    buffer = list(reference.ids)

    def blocks(shard: int, row: int, stop: int) -> Iterator[list[str]]:
        rows = list(read(shard, row, stop))  # in blocks of 1, 2, 3, 1, ... rows
        out: list[list[str]] = []
        while rows[sum(map(len, out)) :]:
            done = sum(map(len, out))
            out.append(rows[done : done + 1 + len(out) % 3])
        return iter(out)

    feed = Feed(
        source, list(pieces), state, buffer, [f"payload {i}" for i in buffer], size, key, blocks
    )  # type: ignore[arg-type]
    while True:
        want, got = reference.next(), feed.next()
        assert got == want
        if want is None:
            break


def test_take_placed_after_slices_the_previous_id_or_declines():
    """``IdFeed.take_placed_after``: the id handed on last and the next ``k`` (one slice),
    exactly what ``take_placed`` would give after it; ``None`` (nothing taken) when the
    previous id differs or no id was handed on yet."""
    source = _source([40, 40])
    pieces = [(0, 0, 40), (1, 0, 40)]
    state = WorkerState(0)

    def feed() -> IdFeed:
        return IdFeed(source, pieces, state, [], 8, 5, _placed_in(source))  # type: ignore[arg-type]

    ref, got = feed(), feed()
    first = ref.take_placed(3)[0]
    assert got.take_placed_after(2, 0) is None  # nothing handed on yet
    got.take_placed(3)
    assert got.take_placed_after(2, int(first[-1]) + 1) is None  # another id
    ids, places = got.take_placed_after(4, int(first[-1]))
    want, _ = ref.take_placed(4)
    assert ids.tolist() == [int(first[-1]), *want.tolist()]
    assert places.tolist() == _placed_in(source)(ids).tolist()
    assert got.take(50).tolist() == ref.take(50).tolist()


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=0, max_size=30),
    seq_len=st.integers(1, 24),
    sequences=st.integers(1, 6),
    pad=st.integers(-3, 3),
)
def test_assemble_lays_out_what_a_token_by_token_packer_would(lengths, seq_len, sequences, pad):
    """:func:`assemble` (whole-batch array operations) against the definition: the
    samples' tokens concatenated in span order, cut into ``seq_len`` rows, the last padded
    with ``pad_id`` and owner -1; ``tokens`` is called once per span, in order."""
    from ledger.stream.packing import Packer, assemble

    docs = {sid: np.arange(n, dtype=np.int64) + 1000 * sid for sid, n in enumerate(lengths)}
    pulled = iter(docs.items())
    state = PackState(None, [])
    spans = state.pack(seq_len, sequences, lambda: next(((s, d.size) for s, d in pulled), None),
                       lambda tail: None)  # fmt: skip
    asked: list[int] = []

    def tokens(sid: int) -> np.ndarray:
        asked.append(sid)
        return docs[sid]

    ids = [s for s, _, _, _ in spans]
    out = assemble(Packer(seq_len, pad_id=pad), ids, [sp[1:] for sp in spans], tokens)
    assert asked == ids
    flat_tokens = [int(t) for s, a, b, _ in spans for t in docs[s][a:b]]
    flat_owners = [s for s, a, b, _ in spans for _ in range(b - a)]
    rows = -(-len(flat_tokens) // seq_len)
    padding = rows * seq_len - len(flat_tokens)
    assert out["tokens"].shape == out["sample_ids"].shape == (rows, seq_len)
    assert out["tokens"].reshape(-1).tolist() == flat_tokens + [pad] * padding
    assert out["sample_ids"].reshape(-1).tolist() == flat_owners + [-1] * padding


def test_assemble_names_the_first_span_that_is_not_this_packing():
    from ledger.stream.packing import Packer, assemble

    docs = {1: np.arange(5), 2: np.arange(4), 3: np.arange(6)}
    good = [(0, 5, 5), (0, 3, 4), (3, 4, 4), (0, 6, 6)]
    ids = [1, 2, 2, 3]
    packer = Packer(8)
    assert assemble(packer, ids, good, docs.__getitem__)["tokens"].shape == (2, 8)
    # A sample whose length changed since it was logged: its first span is named,
    # even with a later span that would not fit.
    with pytest.raises(
        LedgerError, match=r"sample 2 has 4 tokens now; the log packed tokens \[0, 3\) of 7"
    ):
        assemble(packer, ids, [(0, 5, 5), (0, 3, 7), (3, 9, 9), (0, 6, 6)], docs.__getitem__)
    # A span of 5 tokens where the sequence has 3 left (5 + 5 > 8).
    with pytest.raises(LedgerError, match="a span of 5 tokens of sample 1 into a sequence with 3"):
        assemble(packer, [1, 1], [(0, 5, 5), (0, 5, 5)], docs.__getitem__)
    with pytest.raises(LedgerError, match=r"packed tokens \[2, 2\) of 6"):
        assemble(packer, [3], [(2, 2, 6)], docs.__getitem__)


@pytest.mark.parametrize("layout", ["none", "column-major", "row-major", "empty"])
def test_a_batch_meta_crosses_the_result_queue_as_it_was_made(layout: str) -> None:
    """A worker's BatchMeta is pickled (torch's result queue) through its own reduce: the
    same fields, int64 arrays the main process may write to, spans column-major."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    rows = 0 if layout == "empty" else 9
    spans = {
        "none": None,
        "column-major": np.asfortranarray(np.arange(27, dtype=np.int64).reshape(9, 3)),
        "row-major": np.arange(27, dtype=np.int64).reshape(9, 3),
        "empty": np.zeros((0, 3), np.int64),
    }[layout]
    ids = np.arange(rows, dtype=np.int64) * 7 + 2**40
    draws = [None, '{"a": 1}'] + [None] * (rows - 2) if rows else None
    failures = [(5, 1, '{"type": "E", "message": "m"}')]
    meta = BatchMeta(3, 2, ids, spans, draws, b"\x01" * 32, failures, 11)
    back = pickle.loads(bytes(ForkingPickler.dumps(meta, pickle.HIGHEST_PROTOCOL)))
    assert (back.worker, back.epoch, back.draws, back.digest, back.failures, back.pulled) == (
        meta.worker, meta.epoch, meta.draws, meta.digest, meta.failures, meta.pulled
    )  # fmt: skip
    assert back.sample_ids.dtype == np.int64 and back.sample_ids.tolist() == ids.tolist()
    assert back.sample_ids.flags.writeable
    if spans is None:
        assert back.spans is None
    else:
        assert back.spans.dtype == np.int64 and back.spans.shape == spans.shape
        assert back.spans.tolist() == spans.tolist()
        assert back.spans.flags.f_contiguous and back.spans.flags.writeable


def test_a_feed_computes_ahead_on_the_background_thread_and_takes_that_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ahead=True``: each chunk is computed on the ``feed`` background thread while the
    one before it is taken (the first at construction), and the main thread installs
    that result instead of computing it again; the ids equal a feed that computes each
    chunk when needed. A chunk computed from a state the feed no longer stands at is
    not used."""
    shuffle_module._CHUNK = 64
    try:
        source = _source([300, 200])
        pieces = [(0, 0, 300), (1, 10, 200)]
        computed: list[tuple[int, str, bool]] = []  # (feed, thread, a chunk came out)
        compute = IdFeed._compute

        def spy(self: IdFeed, start: Any) -> Any:
            chunk = compute(self, start)
            computed.append((id(self), threading.current_thread().name, chunk is not None))
            return chunk

        monkeypatch.setattr(IdFeed, "_compute", spy)
        ahead = IdFeed(source, pieces, WorkerState(0), [], 16, 99, _placed_in(source), ahead=True)  # type: ignore[arg-type]
        assert ahead._pending is not None  # the first chunk is on its way
        ahead._pending[2].result()
        assert computed == [(id(ahead), "ledger-feed_0", True)]
        now = IdFeed(source, pieces, WorkerState(0), [], 16, 99, _placed_in(source))  # type: ignore[arg-type]
        for k in [5, 64, 1, 100, 200, 7, 300]:
            got, want = ahead.take_placed(k), now.take_placed(k)
            assert got[0].tolist() == want[0].tolist()
            assert got[1].tolist() == want[1].tolist()
            assert ahead.buffer() == now.buffer()
            assert ahead.cursor() == now.cursor()
        assert ahead.exhausted() and now.exhausted()
        # Each feed computed each chunk once: the ahead feed on the background thread,
        # the other on the main thread.
        chunks = [(f, t) for f, t, some in computed if some]
        # 490 rows: 16 fill the buffer, 474 steady steps in 8 chunks of <= 64, the drain.
        assert chunks.count((id(ahead), "ledger-feed_0")) == 9
        assert chunks.count((id(now), "MainThread")) == 9
        assert len(chunks) == 18
        # A pending chunk from another state is not used: the chunk is computed anew.
        stale = IdFeed(source, pieces, WorkerState(0), [], 16, 99, ahead=True)  # type: ignore[arg-type]
        assert stale._pending is not None
        stale._pending[2].result()
        stale._draws += 1  # as if the feed had moved since
        fresh = IdFeed(source, pieces, WorkerState(0), [], 16, 99)  # type: ignore[arg-type]
        fresh._draws += 1
        assert stale.take(40).tolist() == fresh.take(40).tolist()
        # Nor one another process submitted (a forked child's copy of the feed): its
        # future would never finish here, so it is not waited for.
        forked = IdFeed(source, pieces, WorkerState(0), [], 16, 99, ahead=True)  # type: ignore[arg-type]
        assert forked._pending is not None
        forked._pending = (forked._pending[0], os.getpid() + 1, Future())
        fresh = IdFeed(source, pieces, WorkerState(0), [], 16, 99)  # type: ignore[arg-type]
        assert forked.take(40).tolist() == fresh.take(40).tolist()
    finally:
        shuffle_module._CHUNK = _DEFAULT_CHUNK


def test_a_feed_that_cannot_compute_ahead_computes_when_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At interpreter shutdown an executor refuses new work (``RuntimeError``): the feed
    then computes each chunk when it is needed, and hands on the same ids."""

    class Refusing:
        def submit(self, *args: object) -> None:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(shuffle_module, "background", lambda name: Refusing())
    source = _source([30, 20])
    pieces = [(0, 0, 30), (1, 0, 20)]
    ahead = IdFeed(source, pieces, WorkerState(0), [], 4, 3, ahead=True)  # type: ignore[arg-type]
    assert ahead._pending is None
    now = IdFeed(source, pieces, WorkerState(0), [], 4, 3)  # type: ignore[arg-type]
    assert ahead.take(60).tolist() == now.take(60).tolist()
    assert ahead.exhausted()
