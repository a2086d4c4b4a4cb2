"""Child for test_dist: torch.distributed.checkpoint saves and restores every rank's loader.

Usage: torchrun --nproc_per_node W dcp_child.py ROOT CHECKPOINT_DIR OUT_DIR
Each rank writes OUT_DIR/rank<R>.txt: "ok" when the restored loader continues exactly like the
saved one, "differs" otherwise. (A file per rank: the ranks share one stdout, where their lines
can interleave.)
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from conftest import Augmented

import ledger
from ledger.testing import batches_equal, take


def main() -> None:
    root, checkpoint, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")

    def make() -> ledger.DataLoader:
        return ledger.DataLoader(Augmented(40), batch_size=2, shuffle=True, seed=1, log=root)

    saved = make()
    list(take(saved, 3))
    dcp.save({"loader": saved}, checkpoint_id=checkpoint)
    reference = list(take(saved, 4))
    restored = make()
    dcp.load({"loader": restored}, checkpoint_id=checkpoint)
    same = all(batches_equal(a, b) for a, b in zip(take(restored, 4), reference, strict=True))
    with open(os.path.join(out, f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write("ok" if same else "differs")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
