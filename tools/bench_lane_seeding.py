"""Benchmark the per-sample seeding of a map-style source in a mixture's lanes.

Prints the CPU time (``time.process_time``, 0 workers: everything runs in this process)
of one mixture epoch of a ``ledger.Mixture`` of an in-memory map-style source (``N``
rows of 16 floats) beside a ``Stream`` of ``N`` Parquet rows (weights 0.5/0.5, shuffle
buffer 1,000), batches of 256, default ``rng="batch"``, in three modes interleaved, best
of ``R``: ``eager`` seeds torch, numpy and ``random`` before every map-style sample (what
a process does once one of its samples drew from numpy or ``random``: the flag of
:func:`ledger.fetch.seeded_lazily` set beforehand), ``lazy`` (the default: numpy and
``random`` only watched, the dataset draws nothing from them) and ``off``. The seeding
cost per map-style sample is ``(mode - off) / N``. No assertions: ratios of one run.

Example:
    python tools/bench_lane_seeding.py               # R = 3, N = 20,000: about 40 s
    python tools/bench_lane_seeding.py --rows 5000 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import ledger
from ledger import fetch
from ledger.stream import ShardedSource, Stream


class Rows:
    """``n`` rows of 16 ``float32`` in memory (draws no random numbers)."""

    def __init__(self, n: int) -> None:
        self.x = np.random.default_rng(0).random((n, 16), dtype=np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.x[i]


def features(record: dict[str, Any], ctx: Any) -> np.ndarray:
    return np.asarray(record["x"], np.float32)


def epoch(folder: str, n: int, mode: str) -> float:
    """CPU seconds of one mixture epoch in ``mode`` (eager, lazy or off)."""
    fetch._globals_drawn = mode == "eager"
    mix = ledger.Mixture(
        {
            "map": Rows(n),
            "stream": Stream(ShardedSource(f"{folder}/*.parquet"), features, shuffle_buffer=1000),
        },
        weights={"map": 0.5, "stream": 0.5},
    )
    loader = ledger.DataLoader(
        mix, batch_size=256, shuffle=True, seed=3, num_workers=0,
        log=tempfile.mkdtemp(dir=folder), rng="off" if mode == "off" else "batch",
    )  # fmt: skip
    t0 = time.process_time()
    for _ in loader:
        pass
    loader.state_dict()
    return time.process_time() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000, help="rows of each source")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.rows
    folder = tempfile.mkdtemp()
    try:
        x = np.random.default_rng(1).random((n, 16), dtype=np.float32)
        for s, part in enumerate(np.array_split(x, 4)):
            column = pa.FixedSizeListArray.from_arrays(pa.array(part.ravel()), 16)
            pq.write_table(pa.table({"x": column}), f"{folder}/part-{s}.parquet")
        best = {"eager": float("inf"), "lazy": float("inf"), "off": float("inf")}
        for _ in range(args.repeats):
            for mode in best:
                best[mode] = min(best[mode], epoch(folder, n, mode))
    finally:
        shutil.rmtree(folder)
        fetch._globals_drawn = False
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"one mixture epoch, {n} map-style + {n} stream rows, 0 workers (load {load})")
    for mode, t in best.items():
        per = "" if mode == "off" else f"  seeding {(t - best['off']) / n * 1e6:.1f} us/sample"
        print(f"  {mode:5s} {t:.3f} s CPU{per}")
    ratio = (best["lazy"] - best["off"]) / (best["eager"] - best["off"])
    print(f"  lazy / eager seeding cost: {ratio:.2f}")


if __name__ == "__main__":
    main()
