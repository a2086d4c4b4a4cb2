"""How ledger's costs grow with history (commits) and with ranks: the growth table.

Builds synthetic logs with ledger's own writers (segments: ``chunks_to_table`` +
``segments.encode``; markers: the rank rows of :func:`ledger.ranks.pack`, assembled by
:func:`ledger.ranks.from_rows` and written by :func:`ledger.commits.write_commit`, the
path rank 0 takes at a commit), then times, in this one process:

- **resume**: ``DataLoader.load_state_dict`` (replay and its checks) at C commits;
- **elastic resume**: one rank of W/2 ranks resuming a W-rank head (map-style);
- **elastic resume of a stream**: the same (``load_state_dict`` alone) for a stream of 8
  logical workers per rank, stopped mid-epoch with full shuffle buffers (``--buffer``
  rows each; a real :class:`ledger.stream.ShardedSource` of ``8 W`` Parquet shards for
  the largest W, shared by every size), what the old ranks left dealt in row blocks
  (``row-blocks-v1``) and, on the same log with ``run.json`` as written before ``carry``
  was recorded, round robin; with the old segments the new rank read, and the buffered
  ids it read and was dealt;
- **rank-0 commit work**: building and encoding the marker from W gathered rows,
  excluding storage I/O, map-style and stream (8 workers per rank);
- **marker bytes per rank** and the **marker parse** time at W ranks;
- **verify** and **audit** (``ledger.audit.summarize``) at C commits;
- **audit after compaction**: 10^6 events written as 10 segments, as 10,000, and the
  10,000 after ``ledger compact``; then ``verify`` of the compacted log. The 10 segments
  and the compacted log are timed alternately (:func:`alternately`).

Each row gives the time at each size and the slope of log(time) against log(size)
between the smallest and largest size (0: flat, 1: linear). Times are the best of
``--repeat`` runs; ``verify`` and the audit also give their CPU seconds (this process,
all threads), which a shared machine's load moves less than wall-clock time.

Example:
    nice -n 10 python tools/scale.py                # about 5 minutes on 2 cores
    python tools/scale.py --quick                   # smaller sizes, for a smoke run
    nice -n 10 python tools/scale.py --audit-only   # the compacted audit's rows only
    nice -n 10 python tools/scale.py --stream-only  # the streams' elastic rows (~2 minutes)
    python tools/scale.py --logs FEW COMPACTED --repeat 9   # two logs built before
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import ledger
from ledger import segments
from ledger.audit import summarize
from ledger.audit.checks import verify
from ledger.commits import (
    RUN_FILE,
    Commit,
    PipelineState,
    WorkerState,
    claim_attempt,
    commit_id,
    new_commit,
    open_run,
    read_commit,
    read_run,
    run_digest,
    write_commit,
)
from ledger.compaction import compact
from ledger.loader import TOKEN_VERSION
from ledger.order import BatchPlan, EpochOrder
from ledger.ranks import NEWS, SegmentRef, decode, final_batch_of, from_rows, pack
from ledger.schema import BUFFER, ERROR, ROLLBACK, SAMPLE, EventChunk, batch_event, chunks_to_table
from ledger.segments import encode, segment_path
from ledger.store import Store, sha256
from ledger.stream import ShardedSource, Stream
from ledger.stream.pipeline import StreamPipeline
from ledger.stream.plan import CARRY_ALGORITHM, CARRY_ROUND_ROBIN, EpochPlan

N = 10**7  # dataset length: no epoch ends in these runs
SEED = 0
# A row of the growth table: measure, sizes, values, the sizes' letter.
Row = tuple[str, list[int], list[float], str]


class Range:
    """Map-style dataset: item ``i`` is ``i`` (never read: only resumes are timed)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def loader(root: str, batch: int, rank: int = 0, world: int = 1) -> ledger.DataLoader:
    return ledger.DataLoader(
        Range(),
        batch_size=batch,
        shuffle=True,
        seed=SEED,
        log=root,
        rng="off",
        rank=rank,
        world_size=world,
    )


def build(root: str, commits: int, world: int, batch: int, batches_per_commit: int = 1) -> dict:
    """A map-style log of ``commits`` commits of ``world`` ranks, each rank consuming
    ``batches_per_commit`` batches of ``batch`` samples per commit; returns the head's
    token."""
    store = Store(root)
    run_id = open_run(store, loader(root, batch).config)
    claim_attempt(store, None, world, run_sha256=run_digest(store))  # as a loader does
    orders = EpochOrder(N, SEED, 0, True)
    plans = [BatchPlan(N, batch, False, r, world) for r in range(world)]
    parent = None
    k = 0
    for _ in range(commits):
        rows = []
        for r, plan in enumerate(plans):
            chunks = []
            for b in range(k, k + batches_per_commit):
                lo, hi = plan.batch_bounds(b)
                ids = orders.sample_ids(np.arange(lo, hi, dtype=np.int64))
                chunks.append(EventChunk(SAMPLE, 0, b, -1, lo, ids))
                chunks.append(batch_event(0, b, -1, lo, bytes(32)))
            data = encode(chunks_to_table(chunks, 0, r))
            step = k + batches_per_commit
            rel = segment_path(0, r, step)
            store.write_atomic(rel, data)
            ref = SegmentRef(r, rel, sum(ch.rows for ch in chunks), len(data), sha256(data))
            final = final_batch_of(chunks, (SAMPLE,))  # as ledger.log records it
            rows.append(pack(PipelineState(r, 0, step, step), ref, NEWS, final))
        k += batches_per_commit
        parent = commit_rows(store, parent, k, rows)
    assert parent is not None
    return token_of(store, run_id, parent)


def commit_rows(store: Store, parent: Commit | None, step: int, rows: list[np.ndarray]) -> Commit:
    """Write the commit of attempt 0 at ``step`` of the ranks' ``rows`` (:func:`pack`)
    after ``parent``, as rank 0 does (:meth:`ledger.log.Ledger` gathers the rows)."""
    header = {
        "id": commit_id(step, 0),
        "step": step,
        "attempt": 0,
        "parent": parent.id if parent else None,
        "world_size": len(rows),
        "created_at": "2026-01-01T00:00:00+00:00",
    }
    commit = new_commit(header, from_rows(np.stack(rows), parent and parent.ranks))
    write_commit(store, commit)
    return commit


def token_of(store: Store, run_id: str, head: Commit) -> dict:
    """The checkpoint token of ``head`` (as ``DataLoader.state_dict`` returns it)."""
    return {
        "version": TOKEN_VERSION,
        "root": store.uri,
        "run_id": run_id,
        "commit": head.id,
        "attempt": 0,
        "world_size": head.world_size,
        "step": head.step,
    }


WORKERS = 8  # logical workers per rank of the stream logs
STREAM_BATCH = 4  # samples per batch of the stream logs
STREAM_COMMITS = 2  # commits of the stream logs, all in epoch 0


def shards(folder: str, count: int, rows: int) -> ShardedSource:
    """``count`` Parquet shards of ``rows`` rows each (one ``int64`` column), as a source."""
    os.makedirs(folder, exist_ok=True)
    for s in range(count):
        column = np.arange(s * rows, (s + 1) * rows, dtype=np.int64)
        pq.write_table(pa.table({"x": column}), f"{folder}/part-{s:05d}.parquet")
    return ShardedSource(f"{folder}/*.parquet")


def stream_loader(root: str, stream: Stream, rank: int = 0, world: int = 1) -> ledger.DataLoader:
    return ledger.DataLoader(
        stream,
        batch_size=STREAM_BATCH,
        shuffle=True,
        seed=SEED,
        log=root,
        num_workers=WORKERS,
        rank=rank,
        world_size=world,
    )


def build_stream(root: str, stream: Stream, world: int) -> tuple[dict, np.ndarray]:
    """A stream log of ``world`` ranks of :data:`WORKERS` logical workers, stopped
    :data:`STREAM_COMMITS` commits into epoch 0, with every shuffle buffer full; returns
    the head's token and the ids in the buffers at the head.

    Each worker reads its pieces of the epoch plan (:class:`EpochPlan`) in order: it fills
    its buffer with the first ``stream.shuffle_buffer`` rows, then for each sample it
    hands on (from a seeded slot) reads the next row into that slot. Per commit a rank
    consumes one batch of :data:`STREAM_BATCH` from each worker, worker 0 first, as its
    loader takes them; its segment holds their ``sample`` events and each worker's
    ``buffer`` events at the commit's batch, as :class:`StreamPipeline` logs them, and its
    state each worker's cursor after the rows it read, with ``rows_read - emitted`` the
    buffer's size. ``run.json`` is the loader's (``carry``: ``row-blocks-v1``; see
    :func:`forget_dealing`).

    Raises:
        ValueError: if a worker's pieces hold fewer rows than it reads.
    """
    store = Store(root)
    run_id = open_run(store, stream_loader(root, stream, 0, world).config)
    claim_attempt(store, None, world, run_sha256=run_digest(store))  # as a loader does
    size = stream.shuffle_buffer
    plan = EpochPlan(stream.source, SEED, 0, True, world, WORKERS)
    rng = np.random.default_rng(world)
    read = size + STREAM_COMMITS * STREAM_BATCH
    pieces = {(r, w): plan.pieces(r, w) for r in range(world) for w in range(WORKERS)}
    rows_read = {k: first_rows(stream.source, p, read) for k, p in pieces.items()}
    buffers = {k: ids[:size].copy() for k, ids in rows_read.items()}
    parent = None
    for c in range(STREAM_COMMITS):
        step = (c + 1) * WORKERS
        emitted = (c + 1) * STREAM_BATCH
        gathered = []
        for r in range(world):
            chunks, states = [], []
            for w in range(WORKERS):
                ids, buffer = rows_read[r, w], buffers[r, w]
                taken = np.empty(STREAM_BATCH, np.int64)
                nxt = size + c * STREAM_BATCH
                for i, slot in enumerate(rng.integers(0, size, STREAM_BATCH).tolist()):
                    taken[i], buffer[slot] = buffer[slot], ids[nxt + i]
                positions = plan.positions(taken)
                chunks.append(
                    EventChunk(SAMPLE, 0, c * WORKERS + w, w, 0, taken, positions, digest=bytes(32))
                )
                shard, row = cursor(pieces[r, w], size + emitted)
                states.append(WorkerState(w, shard, row, size + emitted, emitted, emitted))
            for w in range(WORKERS):
                ids = buffers[r, w].copy()
                chunks.append(EventChunk(BUFFER, 0, step, w, 0, ids, np.arange(size)))
            data = encode(chunks_to_table(chunks, 0, r))
            rel = segment_path(0, r, step)
            store.write_atomic(rel, data)
            ref = SegmentRef(r, rel, sum(ch.rows for ch in chunks), len(data), sha256(data))
            final = final_batch_of(chunks, (SAMPLE, ERROR, ROLLBACK))  # as ledger.log does
            state = PipelineState(r, 0, step, step, tuple(states), 0)
            gathered.append(pack(state, ref, NEWS, final))
        parent = commit_rows(store, parent, step, gathered)
    assert parent is not None
    return token_of(store, run_id, parent), np.concatenate(list(buffers.values()))


def first_rows(source: ShardedSource, pieces: list[tuple[int, int, int]], n: int) -> np.ndarray:
    """Sample ids of the first ``n`` rows of ``pieces`` ``(shard, start, stop)``."""
    out, left = [], n
    for f, start, stop in pieces:
        take = min(stop - start, left)
        out.append(source.offsets[f] + np.arange(start, start + take, dtype=np.int64))
        left -= take
        if not left:
            return np.concatenate(out)
    raise ValueError(f"a worker's pieces hold fewer than {n} rows: add rows to the shards")


def cursor(pieces: list[tuple[int, int, int]], n: int) -> tuple[int, int]:
    """A worker's cursor (:class:`WorkerState` ``shard`` and ``row``) once it read the
    first ``n`` rows of ``pieces``."""
    for k, (_, start, stop) in enumerate(pieces):
        if n < stop - start:
            return k, start + n
        n -= stop - start
    return len(pieces), 0


def stream_resume(
    root: str, stream: Stream, token: dict, buffered: np.ndarray, dealing: str, repeat: int
) -> tuple[float, float, int, int, int]:
    """New rank 0 of ``W/2`` resuming the ``W``-rank stream log at ``root``, whose
    ``run.json`` deals by ``dealing``: the best wall-clock and CPU seconds of ``repeat``
    ``load_state_dict`` calls (the loader built before each), and, from a first run spied
    on, the old segments it read (:func:`ledger.segments.read`), the buffered ids it read
    (:meth:`StreamPipeline._old_buffers`) and the ``buffered`` ids dealt to its workers."""
    paths: set[str] = set()
    held = [0]
    read, old_buffers = segments.read, StreamPipeline._old_buffers

    def spy_read(store: Store, rel: str, **kwargs: Any) -> Any:
        paths.add(rel)
        return read(store, rel, **kwargs)

    def spy_buffers(self: StreamPipeline, head: Commit, states: list) -> Any:
        found = old_buffers(self, head, states)
        held[0] += sum(len(ids) for ids in found.values())
        return found

    new = token["world_size"] // 2
    first = stream_loader(root, stream, 0, new)
    segments.read = spy_read  # type: ignore[assignment]
    StreamPipeline._old_buffers = spy_buffers  # type: ignore[method-assign]
    try:
        first.load_state_dict(token)
    finally:
        segments.read = read  # type: ignore[assignment]
        StreamPipeline._old_buffers = old_buffers  # type: ignore[method-assign]
    assert first._pipeline.dealing == dealing, (first._pipeline.dealing, dealing)
    plan = first._pipeline.plan(0, token["commit"])
    offsets = stream.source.offsets
    mine = [
        offsets[f] + np.arange(a, b, dtype=np.int64)
        for w in range(WORKERS)
        for f, a, b in plan.pieces(0, w)
    ]
    dealt = int(np.isin(np.concatenate(mine), buffered).sum())
    first.close()
    walls, cpus = [], []
    for _ in range(repeat):
        lo = stream_loader(root, stream, 0, new)
        t, c = time.perf_counter(), time.process_time()
        lo.load_state_dict(token)
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
        lo.close()
    return min(walls), min(cpus), len(paths), held[0], dealt


def best(fn: Callable[[], Any], repeat: int) -> float:
    return timed(fn, repeat)[0]


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """The best wall-clock and the best CPU seconds (this process, all its threads) of
    ``repeat`` runs: on a shared machine the CPU seconds move less with the load."""
    walls, cpus = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def slope(sizes: list[int], values: list[float]) -> float:
    return math.log(values[-1] / values[0]) / math.log(sizes[-1] / sizes[0])


def gathered(world: int, workers: int) -> np.ndarray:
    """The rows rank 0 receives at a commit of ``world`` ranks (random cursors)."""
    rng = np.random.default_rng(0)
    rows = []
    for r in range(world):
        ws = tuple(
            WorkerState(
                w,
                shard=int(rng.integers(0, 64)),
                row=int(rng.integers(0, 10**5)),
                rows_read=int(rng.integers(0, 10**7)),
                draws=int(rng.integers(0, 10**7)),
                emitted=int(rng.integers(0, 10**7)),
                doc=int(rng.integers(0, 10**10)),
                doc_offset=int(rng.integers(0, 4096)),
                doc_length=int(rng.integers(4096, 8192)),
            )
            for w in range(workers)
        )
        step = 500_000
        rel = segment_path(3, r, step)
        ref = SegmentRef(r, rel, 5000, 40_000 + r, rng.bytes(32).hex())
        state = PipelineState(r, 2, 12_345, step, ws, int(rng.integers(0, max(workers, 1))))
        rows.append(pack(state, ref, NEWS))
    width = max(len(x) for x in rows)
    return np.stack([np.pad(x, (0, width - len(x))) for x in rows])


def marker_work(world: int, workers: int, repeat: int) -> tuple[float, float, float]:
    """Rank-0 commit work (s), marker bytes per rank, and marker parse (s) at ``world``."""
    rows = gathered(world, workers)
    header = {
        "id": commit_id(500_000, 3),
        "step": 500_000,
        "attempt": 3,
        "parent": None,
        "world_size": world,
        "created_at": "2026-01-01T00:00:00+00:00",
    }
    out: list[Any] = []

    def work() -> None:
        commit = new_commit(header, from_rows(rows, None))
        out[:] = [commit.table_bytes(), commit.to_json()]

    t_work = best(work, repeat)
    table, marker = out
    shape = (rows.shape[0], rows.shape[1])
    t_parse = best(lambda: decode(table, shape, 3, "x")[world // 2], repeat)
    return t_work, (len(table) + len(marker)) / world, t_parse


def forget_dealing(root: str) -> None:
    """Make the log at ``root`` one written before ``run.json`` recorded its ``carry``
    dealing (so it deals round robin, ``round-robin-v1``): the same segments and markers."""
    store = Store(root)
    run = read_run(store)
    del run["config"]["carry"]
    store.write_atomic(RUN_FILE, json.dumps(run, indent=1, sort_keys=True).encode())
    # Attempt records of then named no SHA-256 of run.json either.
    for name in store.ls("attempts"):
        record = json.loads(store.read_bytes(f"attempts/{name}"))
        record.pop("run_sha256", None)
        store.write_atomic(f"attempts/{name}", json.dumps(record).encode())


def elastic_streams(
    console: Console, base: str, sizes: list[int], buffer: int, repeat: int
) -> tuple[list[Row], str]:
    """The growth table's rows of a stream's elastic resume ``W -> W/2`` at each old world
    size in ``sizes``, row blocks and round robin (the same log, :func:`forget_dealing`),
    and a line comparing the two at the largest size. The source (built first, shared by
    every size) holds ``max(sizes) * WORKERS`` shards, so every old worker reads from
    its own; its fingerprint check is part of every resume."""
    t0 = time.perf_counter()
    rows = 2 * (buffer + STREAM_COMMITS * STREAM_BATCH)  # a worker reads half its first shard
    stream = Stream(shards(f"{base}/shards", sizes[-1] * WORKERS, rows), shuffle_buffer=buffer)
    built = time.perf_counter() - t0
    blocks, robin = [], []
    for w in sizes:
        root = f"{base}/s{w}"
        t = time.perf_counter()
        token, buffered = build_stream(root, stream, w)
        built += time.perf_counter() - t
        blocks.append(stream_resume(root, stream, token, buffered, CARRY_ALGORITHM, repeat))
        forget_dealing(root)
        robin.append(stream_resume(root, stream, token, buffered, CARRY_ROUND_ROBIN, repeat))
    console.print(
        f"built a source of {len(stream.source.files):,} shards of {rows:,} rows and "
        f"{len(sizes)} stream logs ({WORKERS} workers per rank, buffers of {buffer:,} rows) "
        f"in {built:.0f} s"
    )
    name = "elastic resume W -> W/2, stream, one rank"

    def of(measured: list[tuple[float, float, int, int, int]], k: int) -> list[float]:
        return [float(m[k]) for m in measured]

    out: list[Row] = [
        (f"{name}, row blocks (s)", sizes, of(blocks, 0), "W"),
        ("same, CPU (s)", sizes, of(blocks, 1), "W"),
        ("same, round robin (s)", sizes, of(robin, 0), "W"),
        ("same, round robin, CPU (s)", sizes, of(robin, 1), "W"),
        ("old segments it read, row blocks", sizes, of(blocks, 2), "W"),
        ("same, round robin", sizes, of(robin, 2), "W"),
        ("buffered ids it read, row blocks", sizes, of(blocks, 3), "W"),
        ("same, round robin", sizes, of(robin, 3), "W"),
        ("buffered ids dealt to it, row blocks", sizes, of(blocks, 4), "W"),
    ]
    (w_rr, c_rr, *_, dealt_rr), (w_rb, c_rb, *_, dealt_rb) = robin[-1], blocks[-1]
    line = (
        f"elastic stream resume {sizes[-1]:,} -> {sizes[-1] // 2:,} ranks, one rank, round "
        f"robin / row blocks: {w_rr:.3f} / {w_rb:.3f} s ({w_rr / w_rb:.1f}x), CPU "
        f"{c_rr:.3f} / {c_rb:.3f} s ({c_rr / c_rb:.1f}x); buffered ids dealt to it "
        f"{dealt_rr:,} / {dealt_rb:,}"
    )
    return out, line


def alternately(fns: list[Callable[[], Any]], repeat: int) -> list[tuple[float, float]]:
    """The best wall-clock and CPU seconds of each of ``fns``, each run once first (imports,
    the OS's caches), then all in turn ``repeat`` times."""
    for fn in fns:
        fn()
    best = [(math.inf, math.inf)] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            w, c = timed(fn, 1)
            best[i] = (min(best[i][0], w), min(best[i][1], c))
    return best


def audit_ratio(console: Console, few: str, compacted: str, repeat: int) -> None:
    """Time ``ledger.audit.summarize`` of two logs holding the same events (``few``
    segments; ``compacted``) alternately (:func:`alternately`); print the best CPU and
    wall-clock ms and the ratio compacted / few."""
    load = os.getloadavg()[0]
    (w_few, c_few), (w_c, c_c) = alternately(
        [lambda: summarize(few), lambda: summarize(compacted)], repeat
    )
    console.print(
        f"audit summary, best of {repeat}, CPU / wall ms: {few} {c_few * 1e3:.1f} / "
        f"{w_few * 1e3:.1f}; {compacted} {c_c * 1e3:.1f} / {w_c * 1e3:.1f}; compacted / few "
        f"{c_c / c_few:.2f}x CPU, {w_c / w_few:.2f}x wall (load average {load:.1f} at the "
        f"start, {os.getloadavg()[0]:.1f} at the end)"
    )


def growth_table(console: Console, rows: list[Row], load: float) -> None:
    """Print ``rows`` (times, with "(s)" in their names, to 4 decimals; counts whole)."""
    if not rows:
        return
    table = Table(title=f"ledger growth (load average {load:.1f} at start, {os.cpu_count()} cores)")
    table.add_column("measure")
    table.add_column("sizes")
    table.add_column("values")
    table.add_column("slope")
    for name, sizes, values, unit in rows:
        fmt = "{:.4f}" if "(s)" in name else "{:,.0f}"
        table.add_row(
            name,
            ", ".join(f"{unit}={s:,}" for s in sizes),
            ", ".join(fmt.format(v) for v in values),
            f"{slope(sizes, values):.2f}",
        )
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to build the logs (default: a temp dir)")
    ap.add_argument(
        "--audit-only",
        action="store_true",
        help="only the audit of 10^6 events after compaction (and verify of that log)",
    )
    ap.add_argument(
        "--stream-only",
        action="store_true",
        help="only the elastic resume of streams (row blocks and round robin)",
    )
    ap.add_argument(
        "--buffer",
        type=int,
        default=1000,
        help="shuffle buffer of each worker of the stream logs (rows; default 1,000)",
    )
    ap.add_argument(
        "--logs",
        nargs=2,
        metavar=("FEW", "COMPACTED"),
        help="only time the audit summary of these two logs (the same events in few "
        "segments, and compacted), alternately; builds nothing",
    )
    args = ap.parse_args()
    console = Console()
    if args.logs:
        audit_ratio(console, *args.logs, args.repeat)
        return
    # The stream loaders say num_workers=8 and never start a worker.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    base = args.dir or tempfile.mkdtemp(prefix="ledger-scale-")
    os.makedirs(base, exist_ok=True)
    # One-process gloo group: lets a loader say world_size=W without W processes (resume
    # issues no collective).
    dist.init_process_group("gloo", init_method=f"file://{base}/pg", rank=0, world_size=1)
    commits = [10, 100, 1000] if args.quick else [10, 100, 1000, 10_000]
    if args.audit_only:
        commits = commits[-1:]
    olds = [16, 64] if args.quick else [16, 64, 256]
    worlds = [100, 1000] if args.quick else [100, 1000, 10_000]
    streams = [16, 64] if args.quick else [16, 64, 256, 1024]
    rows: list[Row] = []
    load = os.getloadavg()
    if args.stream_only:
        try:
            rows, line = elastic_streams(console, base, streams, args.buffer, args.repeat)
        finally:
            dist.destroy_process_group()
        growth_table(console, rows, load[0])
        console.print(line)
        console.print(f"load average at the end: {os.getloadavg()[0]:.1f}")
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        return
    try:
        tokens = {}
        t0 = time.perf_counter()
        for c in commits:
            tokens[c] = build(f"{base}/c{c}", c, 1, 100)
        console.print(f"built {len(commits)} logs of 1 rank in {time.perf_counter() - t0:.0f} s")

        def verified(root: str) -> None:
            v = verify(root)  # a timing of a verify that finds damage would mean nothing
            assert v.ok, [r for r in v.results if not r.ok]

        def resume(c: int) -> None:
            lo = loader(f"{base}/c{c}", 100)
            lo.load_state_dict(tokens[c])

        if args.audit_only:  # verify before compacting, for the comparison printed last
            verifies = [timed(lambda: verified(f"{base}/c{commits[-1]}"), 1)]
        else:
            resumes = [best(lambda c=c: resume(c), args.repeat) for c in commits]
            rows.append(("resume (s)", commits, resumes, "C"))
            verifies = [timed(lambda c=c: verified(f"{base}/c{c}"), 1) for c in commits[1:]]
            rows.append(("verify (s)", commits[1:], [v[0] for v in verifies], "C"))
            rows.append(("verify, CPU (s)", commits[1:], [v[1] for v in verifies], "C"))
            audits = [timed(lambda c=c: summarize(f"{base}/c{c}"), 1) for c in commits[1:]]
            rows.append(("audit summary (s)", commits[1:], [a[0] for a in audits], "C"))
            rows.append(("audit summary, CPU (s)", commits[1:], [a[1] for a in audits], "C"))

        elastic = []
        for w in [] if args.audit_only else olds:
            token = build(f"{base}/w{w}", 3, w, 4)

            def again(w: int = w, token: dict = token) -> None:
                lo = loader(f"{base}/w{w}", 4, 0, w // 2)
                lo.load_state_dict(token)

            elastic.append(best(again, args.repeat))
        if not args.audit_only:
            rows.append(("elastic resume W -> W/2, one rank (s)", olds, elastic, "W"))
            measured_streams, line = elastic_streams(
                console, base, streams, args.buffer, args.repeat
            )
            rows += measured_streams

        for workers, name in (
            () if args.audit_only else ((0, "map-style"), (8, "stream, 8 workers"))
        ):
            measured = [marker_work(w, workers, args.repeat) for w in worlds]
            rows.append((f"rank-0 commit work, {name} (s)", worlds, [m[0] for m in measured], "W"))
            rows.append((f"marker bytes per rank, {name}", worlds, [m[1] for m in measured], "W"))
            rows.append((f"marker parse, {name} (s)", worlds, [m[2] for m in measured], "W"))

        # Audit of 10^6 events: 10 segments, 10,000 segments, the 10,000 compacted.
        big = commits[-1]
        few = build(f"{base}/few", 10, 1, 100, batches_per_commit=big // 10)
        assert few["step"] == big
        many = f"{base}/c{big}"
        t_many, c_many = timed(lambda: summarize(many), args.repeat)
        t = time.perf_counter()
        result = compact(many)
        t_compact = time.perf_counter() - t
        # The 10 segments and the compacted log alternately (the load moves during a run,
        # and the compaction's writes are still being flushed right after it).
        (t_few, c_few), (t_after, c_after) = alternately(
            [lambda: summarize(f"{base}/few"), lambda: summarize(many)], args.repeat + 4
        )
        v_after = timed(lambda: verified(many), 1)
        head = read_commit(Store(many), tokens[big]["commit"])
        assert head.step == big
    finally:
        dist.destroy_process_group()

    growth_table(console, rows, load[0])
    console.print(
        f"audit summary of {big * 100:,} events: 10 segments {t_few:.3f} s; "
        f"{big:,} segments {t_many:.3f} s ({t_many / t_few:.2f}x); after compacting "
        f"{result.segments:,} of them into {result.files} files ({t_compact:.1f} s): "
        f"{t_after:.3f} s ({t_after / t_few:.2f}x)"
    )
    console.print(
        f"same, CPU seconds: 10 segments {c_few:.3f}; {big:,} segments {c_many:.3f} "
        f"({c_many / c_few:.2f}x); compacted {c_after:.3f} ({c_after / c_few:.2f}x)"
    )
    console.print(
        f"verify at C={big:,} after compacting: {v_after[0]:.3f} s, {v_after[1]:.3f} CPU s "
        f"(before: {verifies[-1][0]:.3f} s, {verifies[-1][1]:.3f} CPU s)"
    )
    console.print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if not args.audit_only:
        console.print(f"resume at C={commits[-1]:,} vs C={commits[0]}: "
                      f"{rows[0][2][-1] / rows[0][2][0]:.2f}x")  # fmt: skip
        console.print(line)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
