"""End to end: SIGKILL examples/train_lm.py, resume it, compare with a run that never stopped.

A small version of ``tools/demo.py`` (whose helpers it uses): a few dozen steps over a
few dozen windows of the stdlib, so that epochs end during the run and the kill and the
resume fall mid-epoch or on an epoch boundary.
"""

from __future__ import annotations

import importlib.util
import json
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

# One worker runs this module whole (pytest-xdist --dist loadgroup): the uninterrupted
# runs of its module-scoped fixture are shared by the tests that need the same one.
pytestmark = pytest.mark.xdist_group("test_example")

REPO = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("ledger_demo", REPO / "tools" / "demo.py")
assert _spec is not None and _spec.loader is not None
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

STEPS = 56
BATCH = 4
CKPT_EVERY = 8
KILL_AT = 21  # the killed run's last checkpoint is step 16


def _train_args(num_workers: int, samples: int) -> list[str]:
    return [
        "--steps", str(STEPS),
        "--batch-size", str(BATCH),
        "--seq-len", "32",
        "--num-workers", str(num_workers),
        "--ckpt-every", str(CKPT_EVERY),
        "--seed", "3",
        "--max-files", "40",
        "--max-samples", str(samples),
    ]  # fmt: skip


CleanRun = Callable[[list[str]], tuple[Path, "Future[tuple[int, list[str]]]"]]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CleanRun]:
    """The uninterrupted run of some arguments: its directory and its future, started (in a
    thread, alongside the run the test kills) by the first test that asks for those
    arguments. kill-2-26 and after-commit-2-26 train on the same arguments: one run."""
    runs: dict[tuple[str, ...], tuple[Path, Future[tuple[int, list[str]]]]] = {}
    with ThreadPoolExecutor(1) as pool:

        def clean(args: list[str]) -> tuple[Path, Future[tuple[int, list[str]]]]:
            if tuple(args) not in runs:
                root = tmp_path_factory.mktemp("clean")
                runs[tuple(args)] = root, pool.submit(demo.run_train, root, args)
            return runs[tuple(args)]

        yield clean


@pytest.mark.slow
@pytest.mark.parametrize(
    ("crash_mode", "num_workers", "samples"),
    [
        # 8 batches per epoch: the resume falls on an epoch boundary.
        ("kill", 0, 32),
        # 7 batches per epoch, the last one short: the resume falls mid-epoch, with
        # batches prefetched by the workers that the killed run never consumed.
        ("kill", 2, 26),
        # Dies between the log commit of step 24 and its checkpoint: the resume from
        # step 16 must leave commit 24 of attempt 0 as an abandoned branch.
        ("after-commit", 2, 26),
    ],
)
def test_sigkill_and_resume_is_exact(
    tmp_path: Path, clean_run: CleanRun, crash_mode: str, num_workers: int, samples: int
) -> None:
    args = _train_args(num_workers, samples)
    crash = tmp_path / "crash"

    # The reference run goes alongside the one to kill: same results, half the wait.
    clean, reference = clean_run(args)
    if crash_mode == "kill":
        rc, _ = demo.run_train(crash, args, kill_at=KILL_AT)
    else:
        rc, _ = demo.run_train(crash, [*args, "--die-after-commit", str(3 * CKPT_EVERY)])
    assert reference.result()[0] == 0
    assert rc == -signal.SIGKILL
    killed = demo.effective_stream(crash / "stream.jsonl")
    assert KILL_AT < len(killed) < STEPS

    rc, lines = demo.run_train(crash, args, resume=True)
    assert rc == 0
    resumed_from = next(int(m.group(1)) for ln in lines if (m := demo.RESUMED_RE.match(ln)))
    assert resumed_from == 2 * CKPT_EVERY
    if crash_mode == "after-commit":
        assert len(killed) == 3 * CKPT_EVERY
        log = crash / "log"
        assert (log / "commits" / "000000000024-0000.json").exists()
        attempt1 = json.loads((log / "attempts" / "0001.json").read_text())
        assert attempt1["parent"] == "000000000016-0000"

    # The resumed attempt redid the steps after its checkpoint, nothing else.
    raw = [json.loads(ln) for ln in (crash / "stream.jsonl").read_text().splitlines()]
    assert [r["step"] for r in raw] == [*range(len(killed)), *range(resumed_from, STEPS)]

    ref = demo.effective_stream(clean / "stream.jsonl")
    eff = demo.effective_stream(crash / "stream.jsonl")
    assert len(ref) == STEPS
    per_epoch = -(-samples // BATCH)
    assert [r["epoch"] - ref[0]["epoch"] for r in ref] == [s // per_epoch for s in range(STEPS)]
    assert demo.count_differences(ref, eff) == 0
    assert demo.weights_diff(clean / "final.pt", crash / "final.pt") == []


def test_effective_stream_keeps_last_record_per_step(tmp_path: Path) -> None:
    path = tmp_path / "stream.jsonl"
    recs = [
        {"step": 0, "epoch": 0, "digest": "a"},
        {"step": 1, "epoch": 0, "digest": "b"},
        {"step": 2, "epoch": 0, "digest": "x"},
        {"step": 1, "epoch": 0, "digest": "c"},
        {"step": 2, "epoch": 1, "digest": "d"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 3, "ep')
    assert demo.effective_stream(path) == [recs[0], recs[3], recs[4]]
    assert demo.count_differences([recs[0], recs[1]], [recs[0], recs[3], recs[4]]) == 2
