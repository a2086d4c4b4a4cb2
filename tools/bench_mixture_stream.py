"""Benchmark a ledger.Mixture of two streams against one ledger Stream over the same rows.

Prints a table of ratios measured in one run (no assertions): one epoch of a
``ledger.stream.Stream`` over all the shards against one mixture epoch (as many
positions as rows) of a ``ledger.Mixture`` of two streams over the two halves of the
shards (weights 0.5/0.5, shuffle buffer 1,000 in each lane), without and with packing,
under ``ledger.DataLoader``, ``num_workers`` 0 and 2. Both serve the same number of
samples; best of R, repeats interleaved. The gap is what mixing costs: the per-position
source lookup, one shuffle buffer per source in each worker, and the main process's
vectorised check of each batch against its lanes.

``--map`` adds a third run: the same mixture with its second source a map-style
dataset of the same rows held in memory (``ledger.stream.indexed``: read through lanes
over its seeded order, ``dataset[i]`` seeded per sample), against the two-stream mixture:
what the map-style lane costs against a stream's lane (no Parquet reading, no shuffle
buffer; one ``seed_globals`` and one ``__getitem__`` per sample).

Example:
    python tools/bench_mixture_stream.py            # about 3 minutes on 2 cores
    python tools/bench_mixture_stream.py --quick
    python tools/bench_mixture_stream.py --quick --map
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(__file__))
from bench_stream import BUFFER, SEQ_LEN, _batch_size, features, make_shards, tokens

import ledger
from ledger.stream import Packer, ShardedSource, Stream


def _stream(paths: list[str], packed: bool) -> Stream:
    source = ShardedSource(paths)
    if packed:
        return Stream(source, tokens, shuffle_buffer=BUFFER, packer=Packer(SEQ_LEN))
    return Stream(source, features, shuffle_buffer=BUFFER)


class Rows:
    """The rows of Parquet shards as a map-style dataset in memory: ``x`` (``float32
    (16,)``), or ``tokens`` (a list of ints) when ``packed``."""

    def __init__(self, paths: list[str], packed: bool) -> None:
        import pyarrow.parquet as pq

        table = pq.read_table(paths, columns=["tokens" if packed else "x"])
        if packed:
            self.items: Any = table["tokens"].to_pylist()
        else:
            flat = table["x"].combine_chunks().flatten().to_numpy()
            self.items = flat.reshape(-1, 16)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def _epoch(loader: ledger.DataLoader) -> float:
    t0 = time.perf_counter()
    for _ in loader:
        pass
    loader.state_dict()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--rows", type=int, default=10_000, help="rows per shard")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4 shards of 2,500 rows, 1 repeat")
    ap.add_argument("--map", action="store_true", help="also a mixture with a map-style source")
    args = ap.parse_args()
    if args.quick:
        args.shards, args.rows, args.repeats = 4, 2500, 1
    con = Console()
    tmp = tempfile.mkdtemp(prefix="bench-mixture-")
    try:
        paths = make_shards(tmp, args.shards, args.rows)
        half = len(paths) // 2
        con.print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        t = Table(title=f"Mixture of 2 streams vs one Stream, same rows, best of {args.repeats}")
        cols = ["packing", "workers", "Stream samples/s", "Mixture samples/s", "ratio"]
        if args.map:
            cols += ["with map-style samples/s", "vs 2 streams"]
        for col in cols:
            t.add_column(col, justify="left" if col == "packing" else "right")
        samples = args.shards * args.rows
        count = 0
        for packed in (False, True):
            for nw in (0, 2):
                bs = _batch_size(packed)

                def one(packed: bool = packed, nw: int = nw, bs: int = bs) -> Any:
                    return _stream(paths, packed)

                def two(packed: bool = packed) -> Any:
                    return ledger.Mixture(
                        {"a": _stream(paths[:half], packed), "b": _stream(paths[half:], packed)},
                        weights={"a": 0.5, "b": 0.5},
                    )

                def mapped(packed: bool = packed) -> Any:
                    return ledger.Mixture(
                        {"a": _stream(paths[:half], packed), "b": Rows(paths[half:], packed)},
                        weights={"a": 0.5, "b": 0.5},
                    )

                best = {"stream": 0.0, "mixture": 0.0, "map": 0.0}
                for r in range(args.repeats):
                    pair = [("stream", one), ("mixture", two)]
                    if args.map:
                        pair.append(("map", mapped))
                    for name, make in pair if r % 2 == 0 else pair[::-1]:
                        count += 1
                        loader = ledger.DataLoader(
                            make(),
                            batch_size=bs,
                            shuffle=True,
                            num_workers=nw,
                            log=os.path.join(tmp, f"root-{count}"),
                        )
                        rate = samples / _epoch(loader)
                        best[name] = max(best[name], rate)
                        con.print(f"packed={packed} nw={nw} rep {r + 1} {name}: {rate:,.0f}/s")
                row = [
                    "yes" if packed else "no",
                    str(nw),
                    f"{best['stream']:,.0f}",
                    f"{best['mixture']:,.0f}",
                    f"{best['mixture'] / best['stream']:.2f}",
                ]
                if args.map:
                    row += [f"{best['map']:,.0f}", f"{best['map'] / best['mixture']:.2f}"]
                t.add_row(*row)
        con.print(t)
        con.print(f"load average after: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
