"""Child for test_dist: one rank of a torchrun job consuming a ledger.DataLoader.

Usage: torchrun --nproc_per_node W dist_child.py ROOT OUTDIR TOTAL [--resume]
       [--die-after-segment STEP]  (rank 1 SIGKILLs itself after writing that segment)
       [--resume-from FILE]  (every rank loads that token: elastic resume)
       [--drop-last]
       [--shards DIR]  (a packed, shuffled stream over DIR/* instead of a dataset)
       [--mixture]  (a ledger.Mixture of two datasets; ids of "b" start at 1000)
       [--stream-mixture DIR]  (a ledger.Mixture of packed streams over DIR/a/* and DIR/b/*)
       [--map-a N]  (with --stream-mixture: "a" is a map-style source of N token documents)
       [--skip-steps A:B]  (a fresh run plans skip(steps=range(A, B)) on every rank, a
                            resumed one does not; steps are then batch indexes)
Each rank appends "<step> <ids> <digest>" per batch to OUTDIR/stream-<rank>.txt and keeps
its token in OUTDIR/ckpt-<rank>.json (written after every commit, every 3 steps, then a
barrier).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from conftest import Augmented, Based, MapTokens, packed_stream

import ledger
from ledger.store import Store


def main() -> None:
    root, out, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if "--die-after-segment" in sys.argv and rank == 1:
        die_at = int(sys.argv[sys.argv.index("--die-after-segment") + 1])
        real = Store.write_atomic

        def write_then_die(self, rel, data):
            real(self, rel, data)
            if rel.endswith(f"seg-{die_at:012d}.parquet"):
                os.kill(os.getpid(), signal.SIGKILL)

        Store.write_atomic = write_then_die
    key = "x"
    if "--shards" in sys.argv:
        shards = sys.argv[sys.argv.index("--shards") + 1]
        loader = ledger.DataLoader(
            packed_stream(shards, shuffle_buffer=3),
            batch_size=2,
            shuffle=True,
            seed=5,
            log=root,
            num_workers=2,
        )
        key = "tokens"
    elif "--stream-mixture" in sys.argv:
        shards = sys.argv[sys.argv.index("--stream-mixture") + 1]
        a = (
            MapTokens(int(sys.argv[sys.argv.index("--map-a") + 1]))
            if "--map-a" in sys.argv
            else packed_stream(os.path.join(shards, "a"), shuffle_buffer=3)
        )
        loader = ledger.DataLoader(
            ledger.Mixture(
                {
                    "a": a,
                    "b": packed_stream(os.path.join(shards, "b"), shuffle_buffer=2),
                },
                weights={"a": 0.7, "b": 0.3},
            ),
            batch_size=2,
            shuffle=True,
            seed=5,
            log=root,
            num_workers=2,
        )
        key = "tokens"
    elif "--mixture" in sys.argv:
        loader = ledger.DataLoader(
            ledger.Mixture(
                {"a": Based(13, 0), "b": Based(40, 1000)},
                weights={"a": 0.6, "b": 0.4},
                epoch_size=61,
            ),
            batch_size=4,
            shuffle=True,
            seed=5,
            log=root,
            num_workers=1,
        )
    else:
        loader = ledger.DataLoader(
            Augmented(61),
            batch_size=4,
            shuffle=True,
            seed=5,
            log=root,
            num_workers=1,
            drop_last="--drop-last" in sys.argv,
        )
    ckpt = os.path.join(out, f"ckpt-{rank}.json")
    step = 0
    planned = "--skip-steps" in sys.argv
    if "--resume-from" in sys.argv:
        with open(sys.argv[sys.argv.index("--resume-from") + 1]) as f:
            token = json.load(f)
        loader.load_state_dict(token)
        step = token["step"]
    elif "--resume" in sys.argv:
        with open(ckpt) as f:
            token = json.load(f)
        loader.load_state_dict(token)
        step = token["step"]
    elif planned:
        a, b = map(int, sys.argv[sys.argv.index("--skip-steps") + 1].split(":"))
        loader.skip(steps=range(a, b), reason="loss spike")
    with open(os.path.join(out, f"stream-{rank}.txt"), "a") as f:
        while step < total:
            for batch in loader:
                digest = hashlib.sha256(batch[key].numpy().tobytes()).hexdigest()[:16]
                ids = batch["id" if key == "x" else "sample_ids"].tolist()
                # With a planned skip, a batch's step is its batch index (the token's).
                label = loader.state.batch - 1 if planned else step
                f.write(f"{label} {ids} {digest}\n")
                f.flush()
                step = loader.state.batch if planned else step + 1
                if step % 3 == 0:
                    token = loader.state_dict()
                    with open(ckpt + ".tmp", "w") as t:
                        json.dump(token, t)
                    os.replace(ckpt + ".tmp", ckpt)
                    # A checkpoint is complete once every rank has saved its part (as with
                    # torch.distributed.checkpoint.save): without this barrier, a rank could
                    # run ahead to a later kill point while another has yet to save.
                    dist.barrier()
                if step == total:
                    break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
