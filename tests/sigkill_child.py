"""Child process for test_sigkill: consume a loader, checkpoint every 3 batches.

Usage: python sigkill_child.py ROOT OUT CKPT TOTAL [--resume] [--shards DIR]
With --shards: a packed, shuffled stream over the shards in DIR instead of a dataset.
Writes one line per consumed batch to OUT: "<batch index> <ids> <digest of x>"; writes
the token to CKPT (JSON, atomically) after every commit; prints progress on stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from conftest import Augmented, packed_stream

import ledger


def main() -> None:
    root, out, ckpt, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if "--shards" in sys.argv:
        shards = sys.argv[sys.argv.index("--shards") + 1]
        loader = ledger.DataLoader(
            packed_stream(shards, shuffle_buffer=5),
            batch_size=2,
            shuffle=True,
            seed=11,
            log=root,
            num_workers=2,
        )
        key = "tokens"
    else:
        loader = ledger.DataLoader(
            Augmented(37), batch_size=4, shuffle=True, seed=11, log=root, num_workers=2
        )
        key = "x"
    step = 0
    if "--resume" in sys.argv:
        with open(ckpt) as t:
            token = json.load(t)
        loader.load_state_dict(token)
        step = token["step"]
    with open(out, "a") as f:
        while step < total:
            for batch in loader:
                digest = hashlib.sha256(batch[key].numpy().tobytes()).hexdigest()[:16]
                ids = batch["id" if key == "x" else "sample_ids"].tolist()
                f.write(f"{step} {ids} {digest}\n")
                f.flush()
                step += 1
                print(f"step {step}", flush=True)
                if step % 3 == 0:
                    print("commit", flush=True)
                    token = loader.state_dict()
                    with open(ckpt + ".tmp", "w") as t:
                        json.dump(token, t)
                    os.replace(ckpt + ".tmp", ckpt)
                    print("committed", flush=True)
                if step == total:
                    break


if __name__ == "__main__":
    main()
