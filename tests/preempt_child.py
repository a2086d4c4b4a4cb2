"""Child process for test_preemption: a training loop under ``ledger.preemption.handle()``.

Usage: python preempt_child.py ROOT OUT CKPT TOTAL MODE [--resume] [--shards DIR] [--spawn]

MODE ``flag``: the loop checks ``preempt.requested`` after every 4th step; ``raise``: the
loop does not look, the handler has ``stop_loaders=True`` and the loader raises
``Preempted``. Either way the child saves the token to CKPT and exits 0 with
"preempted" on stdout. Writes one line per consumed batch to OUT:
"<step> <ids> <digest>"; prints "step N" after each step, which sleeps 20 ms (the
model's work, during which the signal lands).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from conftest import Augmented, packed_stream

import ledger
from ledger.errors import Preempted


def save(loader, ckpt):
    with open(ckpt + ".tmp", "w") as t:
        json.dump(loader.state_dict(), t)
    os.replace(ckpt + ".tmp", ckpt)


def main() -> None:
    root, out, ckpt, total, mode = sys.argv[1:6]
    total = int(total)
    context = "spawn" if "--spawn" in sys.argv else None
    if "--shards" in sys.argv:
        shards = sys.argv[sys.argv.index("--shards") + 1]
        dataset, key, ids = packed_stream(shards, shuffle_buffer=5), "tokens", "sample_ids"
    else:
        dataset, key, ids = Augmented(37), "x", "id"
    loader = ledger.DataLoader(
        dataset,
        batch_size=3,
        shuffle=True,
        seed=5,
        log=root,
        num_workers=2,
        multiprocessing_context=context,
        persistent_workers=context == "spawn",  # spawn workers once, not per epoch
    )
    step = 0
    if "--resume" in sys.argv:
        with open(ckpt) as t:
            token = json.load(t)
        loader.load_state_dict(token)
        step = token["step"]
    with (
        ledger.preemption.handle(stop_loaders=mode == "raise") as preempt,
        open(out, "a") as f,
    ):
        try:
            while step < total:
                for batch in loader:
                    digest = hashlib.sha256(batch[key].numpy().tobytes()).hexdigest()[:16]
                    f.write(f"{step} {batch[ids].tolist()} {digest}\n")
                    f.flush()
                    time.sleep(0.02)
                    step += 1
                    print(f"step {step}", flush=True)
                    if step == total:
                        break
                    # Looked at every 4th step only (as a loop that all-reduces the
                    # flag every few steps): workers must survive the signal meanwhile.
                    if mode == "flag" and step % 4 == 0 and preempt.requested:
                        save(loader, ckpt)
                        print(f"preempted {preempt.signal.name}", flush=True)
                        return
        except Preempted as e:
            assert e.signal == preempt.signal
            save(loader, ckpt)
            print(f"preempted {preempt.signal.name}", flush=True)
            return
    print("done", flush=True)


if __name__ == "__main__":
    main()
