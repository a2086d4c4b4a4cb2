"""ledger.preemption: signals recorded, handlers chained and restored, and a real SIGTERM
to a training subprocess's process group followed by an exact resume."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading

import pytest
from conftest import Augmented, text_shards

import ledger
from ledger.errors import LedgerError, Preempted
from ledger.testing import batches_equal, take

# One worker runs this module whole (pytest-xdist --dist loadgroup): its module-scoped
# fixture is built once.
pytestmark = pytest.mark.xdist_group("test_preemption")

CHILD = os.path.join(os.path.dirname(__file__), "preempt_child.py")
TOTAL = 20


def test_records_the_signal_and_chains_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        mine = signal.getsignal(signal.SIGUSR1)
        with ledger.preemption.handle() as preempt:
            assert not preempt.requested and not ledger.preemption.requested()
            os.kill(os.getpid(), signal.SIGUSR1)
            assert preempt.requested and ledger.preemption.requested()
            assert preempt.signal == signal.SIGUSR1 and preempt.count == 1
            assert seen == [signal.SIGUSR1]  # chained
            os.kill(os.getpid(), signal.SIGUSR1)  # recorded again, not fatal
            assert preempt.count == 2 and seen == [signal.SIGUSR1] * 2
            with pytest.raises(Preempted, match="SIGUSR1 received"):
                preempt.check()
            assert preempt.agreed() is True  # no torch.distributed: the local record
        assert signal.getsignal(signal.SIGUSR1) is mine  # restored
        assert not ledger.preemption.requested()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_default_handlers_are_not_chained_and_sigterm_does_not_kill():
    with ledger.preemption.handle(signals=[signal.SIGTERM]) as preempt:
        os.kill(os.getpid(), signal.SIGTERM)  # SIG_DFL before: would kill this process
        assert preempt.signal == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_main_thread_only_and_no_double_install():
    errors = []

    def install():
        try:
            ledger.preemption.handle().install()
        except LedgerError as e:
            errors.append(str(e))

    t = threading.Thread(target=install)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in errors[0]
    with ledger.preemption.handle() as preempt, pytest.raises(LedgerError, match="already"):
        preempt.install()


def test_a_handler_installed_over_ours_stays(caplog):
    def theirs(s, f):
        return None

    preempt = ledger.preemption.handle(signals=[signal.SIGUSR1]).install()
    try:
        signal.signal(signal.SIGUSR1, theirs)
        with caplog.at_level(logging.WARNING, logger="ledger"):
            preempt.restore()
        assert signal.getsignal(signal.SIGUSR1) is theirs
        assert "SIGUSR1 handler was replaced" in caplog.text
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_stop_loaders_raises_at_the_batch_boundary_and_resumes_exactly(tmp_path):
    def make():
        return ledger.DataLoader(
            Augmented(23), batch_size=4, shuffle=True, seed=3, log=str(tmp_path / "log")
        )

    reference = list(take(make(), 12))  # two epochs of 6 batches
    loader = make()
    got = []
    with ledger.preemption.handle(stop_loaders=True), pytest.raises(Preempted) as raised:
        for batch in take(loader, 12):
            got.append(batch)
            if len(got) == 8:
                os.kill(os.getpid(), signal.SIGTERM)
    assert raised.value.signal == signal.SIGTERM
    assert len(got) == 8  # the 9th batch was not loaded
    token = loader.state_dict()
    assert token["step"] == 8
    resumed = make()
    resumed.load_state_dict(token)
    got += take(resumed, 4)
    assert [i for i in range(12) if not batches_equal(got[i], reference[i])] == []


def test_without_stop_loaders_the_loader_keeps_going(tmp_path):
    loader = ledger.DataLoader(Augmented(8), batch_size=4, seed=3, log=str(tmp_path / "log"))
    with ledger.preemption.handle() as preempt:
        n = 0
        for _ in loader:
            os.kill(os.getpid(), signal.SIGTERM)
            n += 1
        assert n == 2 and preempt.requested


def test_spawned_workers_learn_the_handled_signals_from_the_pickled_init():
    from ledger.loader import _WorkerInit

    init = _WorkerInit(None, os.getpid(), check=False, copy_below=0)
    with ledger.preemption.handle():
        spawned = pickle.loads(pickle.dumps(init))  # what a spawned worker receives
    assert spawned.ignore == {signal.SIGTERM, signal.SIGUSR1}
    assert pickle.loads(pickle.dumps(init)).ignore == frozenset()  # none installed now
    try:
        spawned(0)  # in the worker: the main process decides when to stop
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


# ---------------------------------------------------------------------- real SIGTERM


def _run(args, signal_after_step=None):
    """Run the child; send SIGTERM to its whole process group (as SLURM signals a job
    step, DataLoader workers included) once it printed ``step N``."""
    proc = subprocess.Popen(
        [sys.executable, CHILD, *args], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if signal_after_step is not None and line.strip() == f"step {signal_after_step}":
            os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    return proc.returncode, lines


def _lines(path):
    with open(path) as f:
        return [line.split(" ", 1) for line in f]


def _write_shards(d):
    return text_shards(d, 2, 10, "q", 2)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted streams (map-style and packed stream), run once per module."""
    base = tmp_path_factory.mktemp("preempt")
    shards = _write_shards(base / "shards")
    refs = {}
    for kind, extra in (("map", []), ("stream", ["--shards", shards])):
        out = base / f"{kind}.txt"
        rc, _ = _run(
            [str(base / kind), str(out), str(base / f"{kind}.json"), str(TOTAL), "flag", *extra]
        )
        assert rc == 0
        refs[kind] = (_lines(out), extra)
    return refs


@pytest.mark.parametrize("mode, kind", [("flag", "map"), ("raise", "stream")])
def test_sigterm_to_the_process_group_then_resume_is_exact(tmp_path, references, mode, kind):
    reference, extra = references["stream" if kind == "stream" else "map"]
    if os.environ.get("LEDGER_TEST_SPAWN"):  # spawned workers (slow: ~40 s under load)
        extra = [*extra, "--spawn"]
    out, ckpt = tmp_path / "run.txt", tmp_path / "ck.json"
    args = [str(tmp_path / "log"), str(out), str(ckpt), str(TOTAL), mode, *extra]
    rc, lines = _run(args, signal_after_step=7)
    assert rc == 0, lines  # the workers survived the group's SIGTERM; the child saved
    assert lines[-1] == "preempted SIGTERM"
    stopped = int(lines[-2].split()[1])
    assert 7 <= stopped < TOTAL
    with open(ckpt) as f:
        assert json.load(f)["step"] == stopped  # saved at the step it stopped, not before
    rc, lines = _run([*args, "--resume"])
    assert rc == 0 and lines[-1] == "done"
    resumed = _lines(out)
    # No step redone, none missing: the stopped run's lines, then the resumed run's.
    assert [int(s) for s, _ in resumed] == list(range(TOTAL))
    assert [i for i in range(TOTAL) if resumed[i] != reference[i]] == []


_AGREED = """
import os, signal, sys
import torch.distributed as dist
import ledger
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2)
with ledger.preemption.handle() as preempt:
    before = preempt.agreed()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is told
    print(before, preempt.requested, preempt.agreed(), flush=True)
dist.destroy_process_group()
"""


def test_agreed_is_the_same_answer_on_every_rank():
    from conftest import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _AGREED, str(r)], stdout=subprocess.PIPE, text=True, env=env
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [["False", "False", "True"], ["False", "True", "True"]]
