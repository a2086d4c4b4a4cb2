"""End to end: SIGKILL examples/train_lm.py, resume it, compare with a run that never stopped.

A small version of ``tools/demo.py`` (whose helpers it uses): a few dozen steps over a
few dozen windows of the stdlib, so that epochs end during the run and the kill and the
resume fall mid-epoch or on an epoch boundary.
"""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("ledger_demo", REPO / "tools" / "demo.py")
assert _spec is not None and _spec.loader is not None
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

STEPS = 40
BATCH = 4
CKPT_EVERY = 8
KILL_AT = 21


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


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "samples",
    [
        # 7 batches per epoch, the last one short: checkpoints fall mid-epoch.
        26,
        # 8 batches per epoch: every checkpoint falls on an epoch boundary.
        32,
    ],
)
def test_sigkill_and_resume_is_exact(tmp_path: Path, num_workers: int, samples: int) -> None:
    args = _train_args(num_workers, samples)
    clean, crash = tmp_path / "clean", tmp_path / "crash"

    rc, _ = demo.run_train(clean, args)
    assert rc == 0
    rc, _ = demo.run_train(crash, args, kill_at=KILL_AT)
    assert rc == -signal.SIGKILL
    killed = demo.effective_stream(crash / "stream.jsonl")
    # Killed after the first checkpoint and before the end.
    assert CKPT_EVERY < len(killed) < STEPS

    rc, lines = demo.run_train(crash, args, resume=True)
    assert rc == 0
    resumed_from = next(int(m.group(1)) for ln in lines if (m := demo.RESUMED_RE.match(ln)))
    assert resumed_from % CKPT_EVERY == 0
    assert CKPT_EVERY <= resumed_from <= len(killed)

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
