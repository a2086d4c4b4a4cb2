"""Resource hygiene for long-lived processes: close(), context manager, GC, logging."""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref

import psutil
import pytest
from conftest import Augmented

import ledger
from ledger.errors import LedgerError
from ledger.testing import take


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()}


def _wait_until_gone(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while (alive := pids & _children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_dropped_loaders_close_their_journals(tmp_path):
    before = _open_fds()
    for i in range(60):
        loader = ledger.DataLoader(Augmented(8), batch_size=2, log=str(tmp_path / f"r{i}"))
        list(take(loader, 2))
        del loader  # no close(), no gc.collect(): reference counting alone
    assert _open_fds() - before < 5


def test_close_and_context_manager_close_the_journal(tmp_path):
    before = _open_fds()
    with ledger.DataLoader(Augmented(8), batch_size=2, log=str(tmp_path / "a")) as loader:
        list(take(loader, 1))
        assert _open_fds() == before + 1  # the journal
    assert _open_fds() == before
    loader.close()  # idempotent
    with pytest.raises(LedgerError, match="closed"):
        iter(loader)
    with pytest.raises(LedgerError, match="closed"):
        loader.state_dict()


def test_state_dict_then_close_keeps_what_was_committed(root):
    loader = ledger.DataLoader(Augmented(12), batch_size=3, shuffle=True, log=root)
    expected = list(take(loader, 4))
    loader.close()
    loader = ledger.DataLoader(Augmented(12), batch_size=3, shuffle=True, log=root)
    list(take(loader, 2))
    token = loader.state_dict()
    loader.close()
    resumed = ledger.DataLoader(Augmented(12), batch_size=3, shuffle=True, log=root)
    resumed.load_state_dict(token)
    assert [b["id"].tolist() for b in take(resumed, 2)] == [b["id"].tolist() for b in expected[2:]]


def _serving(root, before, persistent):
    """A 2-worker loader that served one batch: ``(loader, its iterator, its workers)``
    (``before``: the children this process had already)."""
    loader = ledger.DataLoader(
        Augmented(64), batch_size=4, log=root, num_workers=2, persistent_workers=persistent
    )
    it = iter(loader)
    next(it)
    workers = _children() - before
    assert len(workers) >= 2
    return loader, it, workers


@pytest.mark.parametrize("how", ["del", "close"])
def test_persistent_workers_end_with_the_loader(root, how):
    gc.disable()  # a reference cycle would keep the workers until a collection
    before = _children()  # other tests' servers (rclone) may be children of this process
    try:
        loader, it, workers = _serving(root, before, persistent=True)
        if how == "close":
            loader.close()
        del it, loader
        assert _wait_until_gone(workers, 10) == set()
    finally:
        gc.enable()


class _FailsAt(Augmented):
    """Augmented whose sample 5 raises ``error`` (in the worker that loads it)."""

    def __init__(self, n, error):
        super().__init__(n)
        self.error = error

    def __getitem__(self, i):
        if i == 5:
            raise self.error
        return super().__getitem__(i)


@pytest.mark.parametrize("error", [StopIteration(), KeyError("bad sample")])
def test_workers_end_when_an_iteration_raises(root, error):
    """An iteration that raises (the dataset's error re-raised from a worker, or the
    epoch torch ended early) ends its workers then: the exception's traceback holds
    torch's iterator, so without that a reference cycle would keep them until a garbage
    collection, which then waits on them (~5-20 s here)."""
    gc.disable()
    before = _children()
    try:
        loader = ledger.DataLoader(
            _FailsAt(64, error), batch_size=4, shuffle=False, log=root, num_workers=2
        )
        it = iter(loader)
        next(it)
        workers = _children() - before
        assert len(workers) >= 2
        with pytest.raises((LedgerError, KeyError)):
            list(it)
        assert _wait_until_gone(workers, 10) == set()
    finally:
        gc.enable()


@pytest.mark.parametrize("persistent", [False, True])
def test_a_loader_whose_iteration_raised_is_freed_at_del(root, persistent):
    """After a worker's error, the dropped loader goes at once with its workers (persistent
    ones too) and its journal: torch's re-raise holds the exception in a frame of its
    traceback, a cycle through the loader's iteration that only a collection would free."""
    gc.disable()
    before, fds = _children(), _open_fds()
    try:
        loader = ledger.DataLoader(
            _FailsAt(64, KeyError("bad sample")), batch_size=4, shuffle=False, log=root,
            num_workers=2, persistent_workers=persistent,
        )  # fmt: skip
        with pytest.raises(KeyError):
            for _ in loader:
                pass
        workers = _children() - before
        gone = weakref.ref(loader)
        del loader
        assert gone() is None
        assert _wait_until_gone(workers, 10) == set()
        assert _open_fds() == fds
    finally:
        gc.enable()


@pytest.mark.parametrize("persistent", [False, True])
def test_close_ends_a_live_iterator_and_its_workers(root, persistent):
    """A live iterator's next batch after close() is an error naming the closed loader
    (not the end of the epoch), and its workers end in close()."""
    loader, it, workers = _serving(root, _children(), persistent)
    loader.close()
    assert _wait_until_gone(workers, 10) == set()
    with pytest.raises(LedgerError, match="closed"):
        next(it)
    with pytest.raises(LedgerError, match="closed"):
        iter(loader)


def test_close_ends_a_live_iterator_without_workers(root):
    loader = ledger.DataLoader(Augmented(64), batch_size=4, log=root)
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(LedgerError, match="closed"):
        next(it)


def test_resume_commit_and_reshape_are_logged(root, caplog):
    caplog.set_level(logging.INFO, logger="ledger")
    loader = ledger.DataLoader(Augmented(16), batch_size=2, log=root, rank=0, world_size=1)
    list(take(loader, 3))
    token = loader.state_dict()
    assert any(
        r.name == "ledger" and "committed 000000000003-0000" in r.getMessage()
        for r in caplog.records
    )
    caplog.clear()
    resumed = ledger.DataLoader(Augmented(16), batch_size=2, log=root)
    resumed.load_state_dict(token)
    messages = [r.getMessage() for r in caplog.records if r.name == "ledger"]
    assert any("resumed" in m and "000000000003-0000" in m and "batch 3" in m for m in messages)


def test_a_reshaped_stream_resume_is_logged(tmp_path, caplog):
    from ledger.stream import ShardedSource, Stream

    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(4):
        (shards / f"part-{s}.jsonl").write_text(
            "".join(f'{{"id": {s * 10 + i}}}\n' for i in range(10))
        )
    stream = Stream(ShardedSource(str(shards / "*.jsonl")), shuffle_buffer=3)

    def make(nw):
        return ledger.DataLoader(
            stream, batch_size=4, log=str(tmp_path / "log"), num_workers=nw, collate_fn=list
        )

    loader = make(0)
    list(take(loader, 2))
    token = loader.state_dict()
    caplog.set_level(logging.INFO, logger="ledger")
    make(2).load_state_dict(token)
    assert any(
        "elastic resume" in r.getMessage() and "logical workers per rank 1 -> 2" in r.getMessage()
        for r in caplog.records
    )
