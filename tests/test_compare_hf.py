"""tools/compare_hf.py: resuming a streaming shuffle mid-epoch, ledger vs HF datasets.

A small version of the comparison (60 stdlib files in 4 shards, buffer 32, batches of 8,
interrupted after 3 of 8 batches), run in-process with ``num_workers=0``. ledger must
resume exactly; for HF only the bookkeeping is asserted, since what its resume loses or
repeats is what the tool measures, not a contract.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# One worker runs this module whole (pytest-xdist --dist loadgroup): its module-scoped
# fixture is built once.
pytestmark = pytest.mark.xdist_group("test_compare_hf")

REPO = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("compare_hf", REPO / "tools" / "compare_hf.py")
assert _spec is not None and _spec.loader is not None
compare_hf = importlib.util.module_from_spec(_spec)
sys.modules["compare_hf"] = compare_hf  # dataclasses look their module up by name
_spec.loader.exec_module(compare_hf)

FILES = 60
BATCH = 8
STOP = 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return compare_hf.make_shards(tmp_path_factory.mktemp("shards"), 4, FILES)


def _compare(shards, workdir, library):
    (result,) = compare_hf.compare(
        shards, workdir, workers=[0], buffer=32, batch_size=BATCH, stop_step=STOP,
        libraries=[library],
    )  # fmt: skip
    assert result.error is None, result.error
    return result.counts


def test_count_exact():
    rows = ["a", "b", "c", "d"]
    full = ["b", "a", "d", "c"]
    # Interrupted after 2: b a; the resume repeats a, loses c, then serves d.
    c = compare_hf.count(rows, full, ["b", "a", "a", "d"], cut=2)
    assert c == compare_hf.Counts(
        rows=4, uninterrupted=4, seen=4, unique=3, duplicates=1, missing=1, differing=2,
        prefix_differing=0,
    )  # fmt: skip
    # A shorter resumed stream: the position past its end differs.
    c = compare_hf.count(rows, full, ["b", "a", "d"], cut=2)
    assert (c.seen, c.duplicates, c.missing, c.differing) == (3, 0, 1, 1)


def test_ledger_resumes_exactly(shards, tmp_path):
    c = _compare(shards, tmp_path, "ledger")
    assert c == compare_hf.Counts(
        rows=FILES, uninterrupted=FILES, seen=FILES, unique=FILES, duplicates=0, missing=0,
        differing=0, prefix_differing=0,
    )  # fmt: skip


@pytest.mark.slow  # datasets sleeps 5 s each time a shuffled stream ends
@pytest.mark.filterwarnings("ignore:.*set_vital")  # torchdata 0.11 on torch 2.13
def test_hf_counts_are_consistent(shards, tmp_path):
    # Both are dev dependencies (pyproject.toml): CI never skips this comparison.
    import datasets  # noqa: F401
    import torchdata.stateful_dataloader  # noqa: F401

    c = _compare(shards, tmp_path, "hf")
    # The uninterrupted epoch serves every row once; the counts of the resumed one add up.
    assert (c.rows, c.uninterrupted) == (FILES, FILES)
    assert c.seen == c.unique + c.duplicates
    assert c.missing == c.rows - c.unique
    assert c.seen >= STOP * BATCH
    assert c.prefix_differing == 0


def test_cli_prints_table_and_command(shards, tmp_path, capsys):
    code = compare_hf.main(
        ["--max-files", str(FILES), "--shards", "4", "--buffer", "32", "--stop-step",
         str(STOP), "--workers", "0", "--only", "ledger", "--workdir", str(tmp_path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "│ ledger  │       0 │          60 / 60 │          0 │       0 │" in out
    assert (
        "reproduce: python tools/compare_hf.py --shards 4 --buffer 32 --batch-size 8 "
        "--stop-step 3 --workers 0 --max-files 60 --only ledger"
    ) in out
