"""The audit summary on DuckDB (this process) against Spark in local mode, at growing sizes.

For each size a map-style log of ``--ranks`` ranks is written (one epoch of sample events
over a dataset of ``events`` samples, one segment per rank per commit, real markers and
manifests through :func:`ledger.commits.write_commit`). The epoch's order is a keyed
Feistel permutation evaluated per segment (:func:`permuted`), so 10^9 events need no
8 GB permutation array: memory stays at one segment's columns. Then both engines compute the
summary (:func:`ledger.audit.summarize` and :func:`ledger.audit.spark.summarize`, which
must be equal), best of ``--repeat`` after a warm-up on the smallest log. The table gives
seconds, events per second and the growth slope ``d log(seconds) / d log(events)``
between consecutive sizes (1.0: linear). The machine's load average is printed before
and after: on a shared machine, compare ratios measured in one run only; so are the peak
resident memory of this process (the DuckDB path and the log writer) and the log's bytes.
Each engine's CPU seconds (this process's for DuckDB, the driver JVM's for Spark, whose
executors run in it in local mode) are printed too: unlike seconds, they hardly depend on
the other jobs sharing the cores, and give the per-core throughput a cluster estimate needs.

Logs, Spark's scratch (``spark.local.dir``) and DuckDB's spill directory all go under
``--tmpdir`` (removed at the end). ``--spark-up-to`` leaves Spark out above a size (its
exact distinct counts hash every event into a 64-id bitmap word); Spark's driver memory
is ``--spark-memory``.

Example:
    nice -n 10 python tools/bench_spark.py --events 1e7 1e8 1e9 --master 'local[2]' \
        --tmpdir /work/tmp-bench --repeat 1
"""

from __future__ import annotations

import argparse
import math
import os
import resource
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
_ROUNDS = 4


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """SplitMix64's finaliser of ``x + key`` (uint64, wrapping): the Feistel round function."""
    z = x + key
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def permuted(positions: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The ids at ``positions`` of a seeded permutation of ``range(n)``, without the
    permutation: a balanced Feistel network on ``2^(2h) >= n`` values (a bijection for any
    round function), restricted to ``[0, n)`` by cycle walking (Black and Rogaway,
    "Ciphers with Arbitrary Finite Domains", CT-RSA 2002): values that land outside are
    encrypted again until they fall inside, which keeps the map a bijection on ``[0, n)``.

    Args:
        positions: int64 array of positions in ``[0, n)``, any shape.
        n: the permutation's length (> 0).
        seed: selects the permutation.

    Returns:
        int64 array of the same shape: distinct positions give distinct ids in ``[0, n)``.
    """
    half = max(1, (max(1, n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng(seed).integers(0, 2**63, _ROUNDS, dtype=np.uint64)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        return (left << np.uint64(half)) | right

    with np.errstate(over="ignore"):
        out = encrypt(positions.astype(np.uint64))
        outside = np.flatnonzero(out >= np.uint64(n))
        while outside.size:
            out[outside] = encrypt(out[outside])
            outside = outside[out[outside] >= np.uint64(n)]
    return out.astype(np.int64)


def make_log(root: str, events: int, ranks: int) -> None:
    """One epoch over ``events`` samples (a seeded permutation, :func:`permuted`),
    ``ranks`` ranks each taking its slice of every global batch, a commit every
    ``SEGMENT_EVENTS`` events per rank (the last one shorter)."""
    store = Store(root)
    steps = events // (ranks * BATCH)
    config = {
        "dataset_len": events, "seed": 0, "shuffle": True, "batch_size": BATCH,
        "drop_last": True, "world_size": ranks, "order": "bench", "per_sample_rng": False,
    }  # fmt: skip
    open_run(store, config)
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
                    "sample_id": permuted(positions, events, 0),
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


def _peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _jvm_cpu_s(spark) -> float:  # type: ignore[no-untyped-def]
    """CPU seconds (user + system, all threads) the driver JVM has used: in local mode the
    executors run in it. Linux only (``/proc``); NaN elsewhere."""
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spark_summary(engine, spark, root: str, checksums: bool = True):  # type: ignore[no-untyped-def]
    """One Spark summary from cold: the summary caches its per-segment counts, and Spark
    would reuse them for an equal plan (a warm-up or an earlier repeat on the same log)."""
    spark.catalog.clearCache()
    return engine.summarize(spark, root, checksums=checksums)


def _bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def _check_one_epoch(summary, n: int, ranks: int) -> None:  # type: ignore[no-untyped-def]
    """The log must hold one epoch with every id at most once (the permutation's check)."""
    (epoch,) = summary.epochs
    expected = n // (ranks * BATCH) * ranks * BATCH
    if epoch.samples != expected or epoch.distinct != expected or epoch.duplicates:
        sys.exit(f"the log of {n} events is not one epoch without duplicates: {epoch}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--tmpdir", help="where the logs and scratch go (default: the system temp dir)")
    p.add_argument(
        "--spark-up-to", type=float, default=math.inf, help="run Spark up to this many events"
    )
    p.add_argument("--spark-memory", default="6g", help="Spark's driver memory (local mode)")
    p.add_argument(
        "--unchecked",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time Spark without its SHA-256 pass",
    )
    p.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run both engines once on the first log before timing",
    )
    a = p.parse_args(argv)
    console = Console(width=120)
    console.print(f"load average before: {os.getloadavg()}, {os.cpu_count()} CPUs")
    from ledger.audit import spark as engine

    base = tempfile.mkdtemp(prefix="ledger-bench-spark-", dir=a.tmpdir)
    tempfile.tempdir = base  # DuckDB's spill directory (views.connect) goes here too
    spark = engine.session(
        a.master,
        "ledger-bench",
        {
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "8",
            "spark.driver.memory": a.spark_memory,
            "spark.local.dir": os.path.join(base, "spark"),
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    rows = []
    try:
        for i, n in enumerate(int(x) for x in a.events):
            root = os.path.join(base, f"log-{n}")
            load = os.getloadavg()[0]
            t = time.perf_counter()
            make_log(root, n, a.ranks)
            size = _bytes(root)
            console.print(
                f"{n:,} events written in {time.perf_counter() - t:.1f} s, "
                f"{size / 1e9:.2f} GB ({size / n:.2f} B/event), load {load:.1f}"
            )
            with_spark = n <= a.spark_up_to
            # About 2*10^7 events per shuffle partition (8 at least).
            spark.conf.set("spark.sql.shuffle.partitions", str(max(8, n // 20_000_000)))
            if i == 0 and a.warm_up:  # warm-up: JIT, code generation, caches
                summarize(root)
                if with_spark:
                    _spark_summary(engine, spark, root)
            load = os.getloadavg()[0]
            t, cpu = time.perf_counter(), time.process_time()
            want = summarize(root)
            t_duck, cpu_duck = time.perf_counter() - t, time.process_time() - cpu
            _check_one_epoch(want, n, a.ranks)
            if a.repeat > 1:
                t_duck = min(t_duck, best(lambda r=root: summarize(r), a.repeat - 1))
            console.print(
                f"{n:,}: duckdb {t_duck:.2f} s, {cpu_duck:.1f} CPU s "
                f"(load {load:.1f} -> {os.getloadavg()[0]:.1f}), "
                f"peak RSS {_peak_rss_gb():.2f} GB"
            )
            t_spark = t_trust = math.nan
            if with_spark:
                load = os.getloadavg()[0]
                t, cpu = time.perf_counter(), _jvm_cpu_s(spark)
                got = _spark_summary(engine, spark, root)
                t_spark, cpu_spark = time.perf_counter() - t, _jvm_cpu_s(spark) - cpu
                if got != want:
                    sys.exit(f"the engines disagree at {n} events:\n{got}\n{want}")
                if a.repeat > 1:
                    t_spark = min(
                        t_spark, best(lambda r=root: _spark_summary(engine, spark, r), a.repeat - 1)
                    )
                console.print(
                    f"{n:,}: spark {t_spark:.2f} s, {cpu_spark:.1f} JVM CPU s "
                    f"(load {load:.1f} -> {os.getloadavg()[0]:.1f})"
                )
                if a.unchecked:
                    load = os.getloadavg()[0]
                    t_trust = best(lambda r=root: _spark_summary(engine, spark, r, False), a.repeat)
                    console.print(
                        f"{n:,}: spark without SHA-256 {t_trust:.2f} s "
                        f"(load {load:.1f} -> {os.getloadavg()[0]:.1f})"
                    )
            rows.append((n, t_duck, t_spark, t_trust))
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
