"""Audit at scale: coverage and duplicates over a log of 10^8 events, timed in one run.

Writes (once; reused when it exists) a synthetic log shaped like a real run: 8 ranks,
batch size 128 per rank, a dataset of 10^7 samples, 10 epochs with ``drop_last``, a
commit every 500 steps, the batch digests: 100,781,200 events in 1,568 segments, written
with ledger's own segment encoder and commit markers. Then it times, in one process:

1. the scan behind coverage and duplicates (:func:`ledger.audit.scan.scan`): per-epoch
   distinct ids over the lineage;
   (best of 3 in one process, and the first of them);
2. the whole summary (:func:`ledger.audit.summarize`), and the CLI
   ``ledger audit ROOT --check coverage --check duplicates`` as a subprocess (imports
   included);
3. the same distinct counts as naive SQL, DuckDB ``COUNT(DISTINCT sample_id)`` per
   epoch over the same Parquet files (DuckDB's own reader), for the ratio.

Example:
    python tools/bench.py --audit            # this benchmark (about 2 minutes the first time)
    python tools/bench_audit.py --root /tmp/ledger-audit-100m
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import duckdb
import numpy as np
from rich.console import Console
from rich.table import Table

from ledger.audit import summarize
from ledger.audit.scan import scan
from ledger.commits import (
    Commit,
    PipelineState,
    SegmentRef,
    commit_id,
    default_head,
    lineage,
    list_commits,
    open_run,
    write_commit,
)
from ledger.order import EpochOrder
from ledger.schema import SAMPLE, SKIP, EventChunk, batch_event, chunks_to_table
from ledger.segments import encode, segment_path
from ledger.store import Store, sha256

N, EPOCHS, WORLD, BATCH, EVERY = 10_000_000, 10, 8, 128, 500


def _segment(args: tuple[str, int, int, int, int]) -> tuple[int, SegmentRef]:
    """Write rank ``rank``'s segment for global steps ``[s0, s1)``; returns its ref."""
    root, rank, s0, s1, seed = args
    store = Store(root)
    steps = N // (WORLD * BATCH)
    rng = np.random.default_rng([seed, rank, s0])
    g = np.arange(s0, s1)
    epochs, ks = np.divmod(g, steps)
    starts = ks * WORLD * BATCH + rank * BATCH
    ids = np.empty((len(g), BATCH), np.int64)
    for epoch in np.unique(epochs).tolist():  # one vectorised order call per epoch
        mine = epochs == epoch
        positions = starts[mine, None] + np.arange(BATCH)
        ids[mine] = (
            EpochOrder(N, seed, epoch, True).sample_ids(positions.reshape(-1)).reshape(-1, BATCH)
        )
    chunks: list[EventChunk] = []
    for i, step in enumerate(g.tolist()):
        epoch, k = int(epochs[i]), int(ks[i])
        chunks.append(EventChunk(SAMPLE, epoch, step, rank % 2, int(starts[i]), ids[i]))
        chunks.append(batch_event(epoch, step, rank % 2, int(starts[i]), rng.bytes(32)))
        if rank == 0 and k == steps - 1:
            tail = np.arange(steps * WORLD * BATCH, N, dtype=np.int64)
            order = EpochOrder(N, seed, epoch, True)
            chunks.append(EventChunk(SKIP, epoch, step, -1, int(tail[0]), order.sample_ids(tail)))
    data = encode(chunks_to_table(chunks, 0, rank))
    rel = segment_path(0, rank, s1)
    store.write_atomic(rel, data)
    return rank, SegmentRef(rank, rel, sum(c.rows for c in chunks), len(data), sha256(data))


def make_log(root: str, seed: int = 0) -> None:
    """Write the benchmark's log under ``root`` (a new directory)."""
    store = Store(root)
    steps = N // (WORLD * BATCH)
    config = {
        "dataset_len": N, "seed": seed, "shuffle": True, "batch_size": BATCH,
        "drop_last": True, "world_size": WORLD, "order": "bench", "per_sample_rng": False,
    }  # fmt: skip
    open_run(store, config)
    bounds = [*range(0, EPOCHS * steps, EVERY), EPOCHS * steps]
    parent = None
    with Pool(os.cpu_count() or 1) as pool:
        for s0, s1 in itertools.pairwise(bounds):
            refs = sorted(pool.map(_segment, [(root, r, s0, s1, seed) for r in range(WORLD)]))
            epoch, k = divmod(s1, steps)
            states = tuple(PipelineState(r, epoch, k, s1) for r in range(WORLD))
            commit = Commit(
                commit_id(s1, 0), s1, 0, parent, WORLD, "2026-01-01T00:00:00+00:00",
                tuple(ref for _, ref in refs), states,
            )  # fmt: skip
            write_commit(store, commit)
            parent = commit.id


def measure(root: str, console: Console) -> Table:
    store = Store(root)
    commits = list_commits(store)
    head = default_head(commits)
    assert head is not None
    chain = lineage(store, head.id, known={c.id: c for c in commits})
    events = sum(s.rows for c in chain for s in c.segments)
    paths = [store.full(s.path) for c in chain for s in c.segments]

    times = []
    for _ in range(3):  # the first pass in a process also faults in the bitmaps' pages
        t = time.perf_counter()
        counted = scan(store, chain, dataset_len=N)
        times.append(time.perf_counter() - t)
    t_first, t_scan = times[0], min(times)
    t = time.perf_counter()
    summary = summarize(root)
    t_summary = time.perf_counter() - t
    t = time.perf_counter()
    cli = subprocess.run(
        [sys.executable, "-m", "ledger.cli", "audit", root, "--check", "coverage",
         "--check", "duplicates"],
        capture_output=True, text=True,
    )  # fmt: skip
    t_cli = time.perf_counter() - t
    console.print("naive SQL: DuckDB COUNT(DISTINCT sample_id) per epoch (about 15 s)...")
    t = time.perf_counter()
    naive = duckdb.sql(
        "SELECT epoch, count(*) FILTER (WHERE kind = 'sample'), "
        "count(DISTINCT sample_id) FILTER (WHERE kind = 'sample') "
        "FROM read_parquet($paths) GROUP BY 1 ORDER BY 1",
        params={"paths": paths},
    ).fetchall()
    t_naive = time.perf_counter() - t

    ours = [(e.epoch, e.samples, e.distinct) for e in counted.epochs.values()]
    agree = ours == [tuple(int(v) for v in row) for row in naive]
    same_summary = [(e.epoch, e.samples, e.distinct) for e in summary.epochs] == ours
    table = Table(title=f"Audit of {events:,} events in {len(paths):,} segments ({root})")
    for col in ("measurement", "seconds", "vs naive SQL"):
        table.add_column(col)
    table.add_row(
        "coverage + duplicates: ledger scan, best of 3", f"{t_scan:.2f}", f"{t_naive / t_scan:.1f}x"
    )
    table.add_row(
        "coverage + duplicates: ledger scan, first in the process",
        f"{t_first:.2f}",
        f"{t_naive / t_first:.1f}x",
    )
    table.add_row("whole summary (summarize)", f"{t_summary:.2f}", f"{t_naive / t_summary:.1f}x")
    table.add_row(
        "`ledger audit --check coverage --check duplicates` (process)",
        f"{t_cli:.2f} (exit {cli.returncode})",
        f"{t_naive / t_cli:.1f}x",
    )
    table.add_row("naive: DuckDB COUNT(DISTINCT) per epoch", f"{t_naive:.2f}", "1.0x")
    table.caption = (
        f"counts agree with the naive query: {agree}; summary agrees: {same_summary}; "
        f"goal: coverage + duplicates <= 2 s: {'met' if t_scan <= 2 else 'NOT met'}"
    )
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--root",
        default=os.path.join(tempfile.gettempdir(), "ledger-bench-audit-1e8"),
        help="where the log is (written if missing; about 370 MB)",
    )
    a = p.parse_args(argv)
    console = Console(width=max(Console().width, 120))
    if not Path(a.root, "commits").exists():
        console.print(f"writing the 10^8-event log to {a.root} (once, about a minute)...")
        t = time.perf_counter()
        make_log(a.root)
        console.print(f"written in {time.perf_counter() - t:.0f} s")
    console.print(measure(a.root, console))


if __name__ == "__main__":
    main()
