"""Benchmark a ledger Stream against the same reading done by a plain IterableDataset.

Three measurements, printed as tables of ratios measured in one run (no assertions):

1. Throughput, default arguments: one epoch of a ``ledger.stream.Stream`` over Parquet
   shards (shuffle buffer 1,000; without and with packing) under ``ledger.DataLoader``,
   against :class:`PlainStream`, an ``IterableDataset`` that reads the same shards row
   group by row group, applies the same transform, shuffles through a buffer of the same
   size (``random.Random``) and packs the same way, under torch's DataLoader. R epochs of
   both in lockstep (``tools/lockstep.py``: both alive at once, taking turns of 0.1 s,
   0.5 s with workers), their batches over their seconds; ``--sequential``: best of R
   epochs each timed alone, repeats interleaved.
2. CPU seconds per epoch at 0 workers (``time.process_time``), plain against ledger:
   what the reading costs, less sensitive to other load than throughput.
3. Main-process work per batch: the batches a stream's workers produce are collected
   first, then the loader's per-batch work on them is timed alone (the replica fold that
   checks the batch, the events, the journal write): what the training loop pays, as CPU
   time of the main thread (and of the whole process, which adds the segment encoding
   on a background thread). Packed batches are measured at two sizes: the throughput
   rows' 32 sequences (~186 samples of these shards) and :data:`PACKED_256` sequences,
   which hold ~256 samples: issue 11's goal is per batch of 256 samples, and most of a
   batch's work is per batch, not per sample (scaling the smaller batch's time by
   256 / 186 would overstate it).

Example:
    python tools/bench_stream.py            # about 2 minutes on 2 cores
    python tools/bench_stream.py --quick
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import lockstep
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.utils.data as tud
from rich.console import Console
from rich.table import Table

import ledger
from ledger.stream import Packer, ShardedSource, Stream
from ledger.stream.pipeline import StreamPipeline

SEQ_LEN = 512
BUFFER = 1000
PACKED_256 = 44
"""Sequences of :data:`SEQ_LEN` tokens in a packed batch of ~256 samples of these shards."""


def make_shards(out: str, shards: int, rows: int, seed: int = 0) -> list[str]:
    """Parquet shards of ``rows`` rows each: ``x`` (16 float32), ``tokens`` (10-200 ints)."""
    rng = np.random.default_rng(seed)
    paths = []
    for s in range(shards):
        lengths = rng.integers(10, 200, rows)
        tokens = [rng.integers(1, 30000, n).tolist() for n in lengths]
        x = rng.random((rows, 16), dtype=np.float32)
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 16),
                "tokens": pa.array(tokens, pa.list_(pa.int32())),
            }
        )
        path = os.path.join(out, f"shard-{s:03d}.parquet")
        pq.write_table(table, path, row_group_size=1024)
        paths.append(path)
    return paths


def features(record: dict[str, Any], ctx: Any = None) -> np.ndarray:
    return np.asarray(record["x"], np.float32)


def tokens(record: dict[str, Any], ctx: Any = None) -> list[int]:
    return record["tokens"]  # type: ignore[no-any-return]


class PlainStream(tud.IterableDataset):
    """The same reading without ledger: shards dealt to workers, row groups read in order,
    a shuffle buffer, optional packing into ``SEQ_LEN``-token sequences."""

    def __init__(self, paths: list[str], batch_size: int, packed: bool, seed: int) -> None:
        self.paths = paths
        self.batch_size = batch_size
        self.packed = packed
        self.seed = seed

    def _rows(self, paths: list[str]) -> Iterator[Any]:
        for path in paths:
            pf = pq.ParquetFile(path)
            for g in range(pf.num_row_groups):
                for record in pf.read_row_group(g).to_pylist():
                    yield tokens(record) if self.packed else features(record)

    def _shuffled(self, items: Iterator[Any], rng: random.Random) -> Iterator[Any]:
        buf: list[Any] = []
        for item in items:
            if len(buf) < BUFFER:
                buf.append(item)
                continue
            j = rng.randrange(len(buf))
            yield buf[j]
            buf[j] = item
        while buf:
            j = rng.randrange(len(buf))
            buf[j], buf[-1] = buf[-1], buf[j]
            yield buf.pop()

    def __iter__(self) -> Iterator[Any]:
        info = tud.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = random.Random(self.seed + wid)
        items = self._shuffled(self._rows(self.paths[wid::nw]), rng)
        if not self.packed:
            batch: list[Any] = []
            for item in items:
                batch.append(item)
                if len(batch) == self.batch_size:
                    yield tud.default_collate(batch)
                    batch = []
            if batch:
                yield tud.default_collate(batch)
            return
        seqs: list[np.ndarray] = []
        seq = np.zeros(SEQ_LEN, np.int64)
        n = 0
        for item in items:
            doc = np.append(np.asarray(item, np.int64), 0)
            off = 0
            while off < doc.size:
                take = min(SEQ_LEN - n, doc.size - off)
                seq[n : n + take] = doc[off : off + take]
                n += take
                off += take
                if n == SEQ_LEN:
                    seqs.append(seq)
                    seq, n = np.zeros(SEQ_LEN, np.int64), 0
                    if len(seqs) == self.batch_size:
                        yield {"tokens": torch.from_numpy(np.stack(seqs))}
                        seqs = []
        if n:
            seqs.append(seq)
        if seqs:
            yield {"tokens": torch.from_numpy(np.stack(seqs))}


def _stream(paths: list[str], packed: bool) -> Stream:
    source = ShardedSource(paths)
    if packed:
        return Stream(source, tokens, shuffle_buffer=BUFFER, packer=Packer(SEQ_LEN))
    return Stream(source, features, shuffle_buffer=BUFFER)


def _batch_size(packed: bool) -> int:
    return 32 if packed else 256  # packed: 32 sequences of 512 tokens hold ~160 samples


def _epoch(make: Any) -> tuple[float, int]:
    t0 = time.perf_counter()
    loader = make()
    n = sum(1 for _ in loader)
    if hasattr(loader, "state_dict"):
        loader.state_dict()
    return time.perf_counter() - t0, n


def throughput(
    paths: list[str],
    workers: list[int],
    repeats: int,
    tmp: str,
    con: Console,
    sequential: bool = False,
) -> tuple[Table, dict[tuple[bool, int], float]]:
    """The table, and ledger's ratio to the plain stream by (packing, workers): R epochs of
    both run in lockstep (``tools/lockstep.py``), batches over seconds; with
    ``sequential``, best of R epochs each timed alone, repeats interleaved."""
    how = (
        f"best of {repeats}"
        if sequential
        else f"{repeats} lockstep epochs ({lockstep.turns_said()})"
    )
    t = Table(title=f"Stream throughput, default arguments, shuffle buffer {BUFFER}, {how}")
    cols = ("packing", "workers", "plain IterableDataset b/s", "ledger Stream b/s", "ratio",
            "ledger, torch's transport b/s", "ratio ")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="left" if col == "packing" else "right")
    count = 0
    ratios: dict[tuple[bool, int], float] = {}
    for packed in (False, True):
        bs = _batch_size(packed)
        for nw in workers:

            def plain(nw: int = nw, packed: bool = packed, bs: int = bs) -> tud.DataLoader:
                return tud.DataLoader(
                    PlainStream(paths, bs, packed, 0), batch_size=None, num_workers=nw
                )

            def ours(
                nw: int = nw, packed: bool = packed, bs: int = bs, **options: Any
            ) -> ledger.DataLoader:
                nonlocal count
                count += 1
                root = os.path.join(tmp, f"root-{count}")
                return ledger.DataLoader(
                    _stream(paths, packed), batch_size=bs, shuffle=True, log=root,
                    num_workers=nw, **options,
                )  # fmt: skip

            # With workers, also the defaults but every tensor through shared memory, as
            # the plain stream's are (ledger.transport): ledger's own cost next to it.
            loaders: list[tuple[str, Any]] = [("plain", plain), ("ledger", ours)]
            if nw > 0:
                loaders.append(("shm", partial(ours, copy_below_bytes=0)))
            rate = {name: 0.0 for name, _ in loaders}
            totals = {name: lockstep.Timed() for name, _ in loaders}
            for r in range(repeats):
                turn = loaders[r % len(loaders) :] + loaders[: r % len(loaders)]
                if not sequential:
                    lockstep.add_epoch(
                        totals,
                        dict(turn),
                        nw,
                        lambda name, t, r=r, nw=nw, packed=packed: con.print(
                            f"stream packed={packed} nw={nw} lockstep {r + 1} {name}: "
                            f"{t.rate:,.0f} b/s ({t.turns} turns)"
                        ),
                    )
                    continue
                for name, make in turn:
                    secs, n = _epoch(make)
                    rate[name] = max(rate[name], n / secs)
                    con.print(
                        f"stream packed={packed} nw={nw} rep {r + 1} {name}: {n / secs:,.0f} b/s"
                    )
            if not sequential:
                rate = {name: timed.rate for name, timed in totals.items()}
            ratios[packed, nw] = rate["ledger"] / rate["plain"]
            shm = rate.get("shm")
            t.add_row(
                "on" if packed else "off",
                str(nw),
                f"{rate['plain']:,.1f}",
                f"{rate['ledger']:,.1f}",
                f"{rate['ledger'] / rate['plain']:.3f}",
                f"{shm:,.1f}" if shm else "-",
                f"{shm / rate['plain']:.3f}" if shm else "-",
            )
    return t, ratios


def cpu_per_epoch(paths: list[str], repeats: int, tmp: str) -> tuple[Table, dict[bool, float]]:
    """CPU seconds (``time.process_time``: all threads of this process) of one epoch at 0
    workers, plain stream against ledger's, best of ``repeats`` interleaved: less
    sensitive than throughput to other load on the machine. The table, and ledger's
    ratio (plain CPU / ledger CPU) by packing."""
    t = Table(title=f"CPU seconds per epoch, 0 workers, buffer {BUFFER}, best of {repeats}")
    for col in ("packing", "rows", "plain IterableDataset CPU s", "ledger Stream CPU s", "ratio"):
        t.add_column(col, justify="left" if col == "packing" else "right")
    ratios: dict[bool, float] = {}
    for packed in (False, True):
        bs = _batch_size(packed)
        best = {"plain": float("inf"), "ledger": float("inf")}
        for r in range(repeats):
            for name in ("plain", "ledger") if r % 2 == 0 else ("ledger", "plain"):
                loader: Any = (
                    tud.DataLoader(PlainStream(paths, bs, packed, 0), batch_size=None)
                    if name == "plain"
                    else ledger.DataLoader(
                        _stream(paths, packed),
                        batch_size=bs,
                        shuffle=True,
                        log=os.path.join(tmp, f"cpu-{packed}-{r}"),
                    )
                )
                p0 = time.process_time()
                for _ in loader:
                    pass
                best[name] = min(best[name], time.process_time() - p0)
                if name == "ledger":
                    loader.close()
        ratios[packed] = best["plain"] / best["ledger"]
        t.add_row(
            "on" if packed else "off",
            f"{len(ShardedSource(paths)):,}",
            f"{best['plain']:.3f}",
            f"{best['ledger']:.3f}",
            f"{ratios[packed]:.3f}",
        )
    return t, ratios


def main_thread_goal(packed: bool) -> str:
    """The name of issue 11's goal row for :func:`main_process_work`'s figure."""
    if packed:
        return f"Stream main-thread CPU µs per 256 samples, packing on ({PACKED_256} sequences)"
    return "Stream main-thread CPU µs per 256 samples, packing off"


def main_process_work(
    paths: list[str], tmp: str, workers: int, repeats: int = 3
) -> tuple[Table, dict[bool, float]]:
    """CPU µs of the loader's per-batch work in the main process, on pre-produced batches;
    the table, and the main thread's µs per 256 samples by packing (packed: measured on
    batches of :data:`PACKED_256` sequences, ~256 samples, and scaled by 256 over their
    mean samples; the throughput rows' 32 sequences are in the table too).

    CPU time, not wall time: the machine may be shared. The main thread's CPU time
    (``time.thread_time``) is what the training loop pays per batch; the process's
    (``time.process_time``) adds the segment's Parquet encoding, which runs on a
    background thread (:class:`ledger.segments.SegmentBuilder`). Best of ``repeats``
    passes over the same batches, each through fresh replicas.
    """
    per256: dict[bool, float] = {}
    t = Table(
        title=f"Main-process CPU per batch ({workers} logical workers, buffer {BUFFER}, "
        f"best of {repeats})"
    )
    for col in (
        "packing",
        "batch",
        "batches",
        "samples/batch",
        "main thread µs/batch",
        "main thread µs per 256 samples",
        "process µs per 256 samples (+ segment encoding)",
    ):
        t.add_column(col, justify="left" if col == "packing" else "right")
    cases = ((False, _batch_size(False)), (True, _batch_size(True)), (True, PACKED_256))
    for packed, batch_size in cases:
        loader = ledger.DataLoader(
            _stream(paths, packed),
            batch_size=batch_size,
            shuffle=True,
            seed=0,
            log=os.path.join(tmp, f"main-{packed}-{batch_size}"),
            num_workers=workers,
        )
        loader._ensure_started()
        driver = loader._pipeline
        assert isinstance(driver, StreamPipeline)
        # Produce the epoch's batches as the workers would, in the order torch serves them.
        start = loader.state
        driver.begin(start)
        ds = driver.torch_dataset
        worker = tud._utils.worker  # the generators read their worker id on their first next()
        infos = [type("Info", (), {"id": w, "num_workers": workers})() for w in range(workers)]
        runs = [iter(ds) for _ in range(workers)]
        metas = []
        live = list(range(workers))
        while live:
            for w in list(live):
                worker._worker_info = infos[w]
                item = next(runs[w], None)
                worker._worker_info = None
                if item is None:
                    live.remove(w)
                else:
                    metas.append(item[0])
        append = loader.log.append
        thread = process = float("inf")
        for _ in range(repeats):
            driver.begin(start)  # fresh replicas at the epoch's start
            state = start
            t0, p0 = time.thread_time(), time.process_time()
            for meta in metas:
                state, events = driver.record(state, meta)
                for chunk in events:
                    append(chunk)
            thread = min(thread, time.thread_time() - t0)
            process = min(process, time.process_time() - p0)
        samples = sum(m.sample_ids.size for m in metas) / len(metas)
        us256 = thread / len(metas) * 1e6 * 256 / samples
        if not packed or batch_size == PACKED_256:
            per256[packed] = us256
        t.add_row(
            "on" if packed else "off",
            f"{batch_size} {'sequences' if packed else 'samples'}",
            str(len(metas)),
            f"{samples:.0f}",
            f"{thread / len(metas) * 1e6:.1f}",
            f"{us256:.1f}",
            f"{process / len(metas) * 1e6 * 256 / samples:.1f}",
        )
        loader.close()
    return t, per256


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 shards of 5,000 rows, 2 repeats")
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--rows", type=int, default=10_000, help="rows per shard")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument(
        "--sequential",
        action="store_true",
        help="throughput as best of R epochs each timed alone instead of in lockstep",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.shards, a.rows, a.repeats = 8, 5000, 2
    con = Console(width=max(Console().width, 120))
    tmp = tempfile.mkdtemp(prefix="ledger-bench-stream-")
    try:
        paths = make_shards(tmp, a.shards, a.rows)
        con.print(main_process_work(paths, tmp, 8)[0])
        con.print(cpu_per_epoch(paths, a.repeats, tmp)[0])
        con.print(throughput(paths, a.workers, a.repeats, tmp, con, a.sequential)[0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    con.print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    sys.exit(main())
