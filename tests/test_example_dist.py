"""examples/train_lm.py under torchrun (gloo): SIGKILL, same-shape and elastic resume.

A small version of ``tools/demo_elastic.py`` (whose helpers it uses). 200 windows of the
first 40 stdlib files, 8 per batch per rank: an epoch is 13 steps on 2 ranks (the last
one split 4 + 4) and 25 on 1 rank, so the kills and resumes fall mid-epoch and the runs
cross epochs. Every kill SIGKILLs the whole torchrun job (agent, ranks,
DataLoader workers) a few steps after a checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
from pathlib import Path

import pytest
import torch

# One worker runs this module whole (pytest-xdist --dist loadgroup): its module-scoped
# fixture is built once.
pytestmark = pytest.mark.xdist_group("test_example_dist")

REPO = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


elastic = _load("demo_elastic", REPO / "tools" / "demo_elastic.py")
demo = sys.modules["demo"]  # tools/demo.py, imported by demo_elastic

sys.path.insert(0, str(Path(__file__).parent))
from logfactory import example_log  # noqa: E402

STEPS = 40
CKPT_EVERY = 6
SAMPLES = 200
BATCH = 8
ARGS = [
    "--steps", str(STEPS),
    "--batch-size", str(BATCH),
    "--seq-len", "32",
    "--num-workers", "1",
    "--ckpt-every", str(CKPT_EVERY),
    "--seed", "3",
    "--max-files", "40",
    "--max-samples", str(SAMPLES),
]  # fmt: skip
KILLED = -signal.SIGKILL


def rank_stream(root: Path, rank: int) -> list[dict[str, object]]:
    return demo.effective_stream(root / f"stream.jsonl.rank{rank}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank run."""
    root = tmp_path_factory.mktemp("reference")
    rc, _ = elastic.run_torchrun(root, 2, ARGS, timeout=120)
    assert rc == 0
    return root


@pytest.mark.slow
def test_same_shape_sigkill_and_resume_is_exact_per_rank(tmp_path: Path, reference: Path) -> None:
    root = tmp_path / "run"
    rc, _ = elastic.run_torchrun(root, 2, ARGS, kill_at=13, timeout=120)
    assert rc == KILLED
    rc, lines = elastic.run_torchrun(root, 2, ARGS, resume=True, timeout=120)
    assert rc == 0
    # Step 12 is mid-epoch: the short final step of epoch 0 is still to come.
    assert "resumed from step-00000012.pt at step 12" in lines

    saved = torch.load(root / "ckpt" / "step-00000018.pt", weights_only=True)
    assert saved["world_size"] == 2
    # The token names the commit; it is the same on every rank.
    assert saved["data"] == saved["ranks"][0]["data"] == saved["ranks"][1]["data"]
    assert saved["data"]["commit"] == "000000000018-0001"

    ref = [rank_stream(reference, r) for r in (0, 1)]
    assert [len(s) for s in ref] == [STEPS, STEPS]
    assert ref[0] != ref[1]  # the ranks take different samples
    per_epoch = -(-SAMPLES // (2 * BATCH))
    assert [r["epoch"] for r in ref[1]] == [s // per_epoch for s in range(STEPS)]
    for rank in (0, 1):
        assert demo.count_differences(ref[rank], rank_stream(root, rank)) == 0
    assert demo.weights_diff(reference / "final.pt", root / "final.pt") == []


@pytest.mark.slow
def test_elastic_two_one_two_ranks_consume_each_epoch_once(tmp_path: Path, reference: Path) -> None:
    root = tmp_path / "run"
    rc, _ = elastic.run_torchrun(root, 2, ARGS, kill_at=7, timeout=120)
    assert rc == KILLED
    # Until the kill, the ranks received what the uninterrupted run's did.
    for rank in (0, 1):
        got = rank_stream(root, rank)
        assert 7 <= len(got) < 2 * CKPT_EVERY
        assert got == rank_stream(reference, rank)[: len(got)]

    rc, lines = elastic.run_torchrun(root, 1, ARGS, resume=True, kill_at=25, timeout=120)
    assert rc == KILLED
    assert "resumed from step-00000006.pt at step 6 (world size 2 -> 1)" in lines
    rc, lines = elastic.run_torchrun(root, 2, ARGS, resume=True, timeout=120)
    assert rc == 0
    assert "resumed from step-00000024.pt at step 24 (world size 1 -> 2)" in lines

    attempts = [json.loads(p.read_text()) for p in sorted((root / "log/attempts").glob("*.json"))]
    assert [(a["parent"], a["world_size"]) for a in attempts] == [
        (None, 2),
        ("000000000006-0000", 1),
        ("000000000024-0001", 2),
    ]
    # Samples per step: 16 on 2 ranks, 8 on 1. Steps 0-5 on 2 ranks (96 samples of
    # epoch 0), 6-23 on 1 rank (104 to end epoch 0 at step 18, then 40), 24-39 on 2
    # ranks (160 to end epoch 1, then 96).
    checks = elastic.check_exactly_once(root / "log")
    assert [(c.epoch, c.samples, c.distinct, c.complete, c.violation) for c in checks] == [
        (0, 200, 200, True, None),
        (1, 200, 200, True, None),
        (2, 96, 96, False, None),
    ]
    assert [c.served_by for c in checks] == [
        ((0, 2, 96), (1, 1, 104)),
        ((1, 1, 40), (2, 2, 160)),
        ((2, 2, 96),),
    ]
    assert demo.ledger_cli("audit", str(root / "log"))[0] == 0


def test_check_exactly_once_reports_duplicates_and_partial_epochs(tmp_path: Path) -> None:
    # The audit tests' log: 10 samples, drop_last skips one position per epoch, and
    # attempt 1 logged position 0's sample of epoch 1 again at position 7.
    example_log(tmp_path)
    checks = elastic.check_exactly_once(tmp_path)
    assert [(c.epoch, c.samples, c.distinct, c.skipped, c.violation) for c in checks] == [
        (0, 9, 9, 1, None),
        (1, 9, 8, 1, "1 duplicate sample(s)"),
        (2, 3, 3, 0, None),
    ]
    assert [c.served_by for c in checks] == [((0, 1, 9),), ((0, 1, 3), (1, 1, 6)), ((1, 1, 3),)]
    assert not checks[2].complete
