"""examples/train_lm_mixture.py at a tiny size: a run stopped at a checkpoint and resumed
sees the batches, and ends with the weights, of a run that never stopped; its annealing
schedule is on the record and the mixture audit passes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from click.testing import CliRunner

from ledger.cli import main as cli

REPO = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location(
    "train_lm_mixture", REPO / "examples" / "train_lm_mixture.py"
)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

# 20 steps of 100 windows: 2,000 samples, the annealing weights from sample 1,000 (step 10).
ARGS = [
    "--steps", "20", "--batch-size", "100", "--seq-len", "8", "--num-workers", "0",
    "--ckpt-every", "5", "--max-samples", "300", "--max-files", "30", "--anneal-from", "0.5",
    "--seed", "1",
]  # fmt: skip


def _run(root: Path, *extra: str) -> None:
    assert (
        example.main(["--root", str(root), "--stream-out", str(root / "s.jsonl"), *ARGS, *extra])
        == 0
    )


def test_a_stopped_and_resumed_run_equals_one_that_never_stopped(tmp_path):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    _run(whole)
    _run(stopped, "--stop-after", "5")
    _run(stopped, "--resume")

    def lines(root):
        return [json.loads(x) for x in (root / "s.jsonl").read_text().splitlines()]

    assert [x["step"] for x in lines(stopped)] == list(range(20))
    assert lines(stopped) == lines(whole)
    a = torch.load(whole / "final.pt", weights_only=True)
    b = torch.load(stopped / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = CliRunner().invoke(cli, ["audit", str(stopped / "log"), "--check", "mixture"])
    assert out.exit_code == 0, out.output
    summary = CliRunner().invoke(cli, ["audit", str(stopped / "log")])
    assert summary.exit_code == 0 and "docs" in summary.output, summary.output
    config = json.loads((stopped / "log" / "run.json").read_text())["config"]["mixture"]
    assert [start for start, _ in config["schedule"]] == [0, 1000]
