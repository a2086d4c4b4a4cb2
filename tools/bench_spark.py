"""The audit summary on DuckDB (this process) against Spark in local mode, at growing sizes.

For each size a map-style log of ``--ranks`` ranks is written (one epoch of sample events
over a dataset of ``events`` samples, one segment per rank per commit, real markers and
manifests through :func:`ledger.commits.write_commit`); then both engines compute the
summary (:func:`ledger.audit.summarize` and :func:`ledger.audit.spark.summarize`, which
must be equal), best of ``--repeat`` after a warm-up on the smallest log. The table gives
seconds, events per second and the growth slope ``d log(seconds) / d log(events)``
between consecutive sizes (1.0: linear). The machine's load average is printed before
and after: on a shared machine, compare ratios measured in one run only.

Example:
    nice -n 10 python tools/bench_spark.py --events 1e6 1e7 1e8 --master 'local[2]'
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from ledger.audit import summarize
from ledger.commits import PipelineState, SegmentRef, commit_id, new_commit, open_run, write_commit
from ledger.ranks import build
from ledger.schema import EVENT_SCHEMA
from ledger.segments import encode, segment_path
from ledger.store import Store, sha256

BATCH = 1024
SEGMENT_EVENTS = 1 << 20  # events per rank per commit


def make_log(root: str, events: int, ranks: int) -> None:
    """One epoch over ``events`` samples (a seeded permutation), ``ranks`` ranks each
    taking its slice of every global batch, a commit every ``SEGMENT_EVENTS`` events per
    rank (the last one shorter)."""
    store = Store(root)
    steps = events // (ranks * BATCH)
    config = {
        "dataset_len": events, "seed": 0, "shuffle": True, "batch_size": BATCH,
        "drop_last": True, "world_size": ranks, "order": "bench", "per_sample_rng": False,
    }  # fmt: skip
    open_run(store, config)
    order = np.random.default_rng(0).permutation(events)
    every = max(1, SEGMENT_EVENTS // BATCH)
    parent = None
    for s0 in range(0, steps, every):
        s1 = min(steps, s0 + every)
        refs = []
        for r in range(ranks):
            b = np.repeat(np.arange(s0, s1, dtype=np.int64), BATCH)
            positions = b * ranks * BATCH + r * BATCH + np.tile(np.arange(BATCH), s1 - s0)
            n = len(positions)
            table = pa.table(
                {
                    "attempt": np.zeros(n, np.int32),
                    "rank": np.full(n, r, np.int32),
                    "worker": np.full(n, -1, np.int32),
                    "epoch": np.zeros(n, np.int32),
                    "batch": b,
                    "position": positions,
                    "sample_id": order[positions],
                    "kind": pa.DictionaryArray.from_arrays(
                        np.zeros(n, np.int8), pa.array(["sample"])
                    ),
                    **{f.name: pa.nulls(n, f.type) for f in list(EVENT_SCHEMA)[8:]},
                },
                schema=EVENT_SCHEMA,
            )
            data = encode(table)
            rel = segment_path(0, r, s1)
            store.write_atomic(rel, data)
            refs.append(SegmentRef(r, rel, n, len(data), sha256(data)))
        states = [PipelineState(r, 0, s1, s1) for r in range(ranks)]
        header = {
            "id": commit_id(s1, 0), "step": s1, "attempt": 0, "parent": parent,
            "world_size": ranks, "created_at": "2026-01-01T00:00:00+00:00",
        }  # fmt: skip
        commit = new_commit(header, build(states, refs, []))
        write_commit(store, commit)
        parent = commit.id


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--tmpdir", help="where the logs go (default: the system temp dir)")
    a = p.parse_args(argv)
    console = Console(width=120)
    console.print(f"load average before: {os.getloadavg()}, {os.cpu_count()} CPUs")
    from ledger.audit import spark as engine

    spark = engine.session(
        a.master,
        "ledger-bench",
        {"spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "8"},
    )
    spark.sparkContext.setLogLevel("ERROR")
    base = tempfile.mkdtemp(prefix="ledger-bench-spark-", dir=a.tmpdir)
    rows = []
    try:
        for i, n in enumerate(int(x) for x in a.events):
            root = os.path.join(base, f"log-{n}")
            t = time.perf_counter()
            make_log(root, n, a.ranks)
            console.print(f"{n:,} events written in {time.perf_counter() - t:.1f} s")
            if i == 0:  # warm-up: JIT, code generation, caches
                summarize(root)
                engine.summarize(spark, root)
            want = summarize(root)
            got = engine.summarize(spark, root)
            if got != want:
                sys.exit(f"the engines disagree at {n} events:\n{got}\n{want}")
            t_duck = best(lambda r=root: summarize(r), a.repeat)
            t_spark = best(lambda r=root: engine.summarize(spark, r), a.repeat)
            t_trust = best(lambda r=root: engine.summarize(spark, r, checksums=False), a.repeat)
            rows.append((n, t_duck, t_spark, t_trust))
            console.print(
                f"{n:,}: duckdb {t_duck:.2f} s, spark {t_spark:.2f} s, spark without "
                f"SHA-256 {t_trust:.2f} s (load {os.getloadavg()[0]:.1f})"
            )
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        spark.stop()
    table = Table(title=f"Audit summary, {a.ranks} ranks, Spark {a.master} (best of {a.repeat})")
    for col in ("events", "DuckDB s", "Spark s", "Spark s (no SHA-256)", "Spark/DuckDB",
                "Mev/s DuckDB", "Mev/s Spark", "slope DuckDB", "slope Spark"):  # fmt: skip
        table.add_column(col, justify="right")
    for i, (n, d, s, t) in enumerate(rows):
        slope = ("", "")
        if i:
            n0, d0, s0, _ = rows[i - 1]
            k = math.log(n / n0)
            slope = (f"{math.log(d / d0) / k:.2f}", f"{math.log(s / s0) / k:.2f}")
        table.add_row(
            f"{n:,}", f"{d:.2f}", f"{s:.2f}", f"{t:.2f}", f"{s / d:.1f}",
            f"{n / d / 1e6:.1f}", f"{n / s / 1e6:.1f}", *slope,
        )  # fmt: skip
    console.print(table)
    console.print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
