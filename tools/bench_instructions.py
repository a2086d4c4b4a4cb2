"""Instructions per batch, ledger's default loader against torch's: the CPU cost of leaving
ledger on, counted by valgrind's callgrind instead of timed.

On a shared 2-core machine the wall-clock ratios of ``tools/bench.py`` move by 10-30%
between runs, and the processes' CPU seconds by as much (the machine's speed moves within
the hour). The instructions an epoch executes barely do: three runs of one script (a packed
epoch of 65 batches in process) counted 8,179.5, 8,180.7 and 8,182.8 M instructions,
within 0.2% of the epoch's own ~1,592 M. Each case runs one epoch of each loader under
callgrind at two sizes (N and 2N samples, or 2 and 4 shards); per batch is the
difference of the totals divided by the difference of the batches, for the main process
and for its workers (summed), so the imports, the loader's construction and the workers'
start-up (a worker's count includes its parent's before the fork) drop out.

Cases (``--cases``, default all):

- ``map-2w``: the trivial map-style dataset of ``tools/bench.py`` (sample = index), batch
  256, 2 workers: torch's ``DataLoader`` (``shuffle=True``) against ``ledger.DataLoader``
  with the default arguments.
- ``hf-0w``: a HF ``datasets.Dataset`` (16 float32 and a label per row, torch format),
  batch 256, 0 workers (needs ``datasets``).
- ``stream-0w`` / ``packed-0w``: ``tools/bench_stream.py``'s Parquet shards, shuffle
  buffer 1,000, batch 256 (packing: 32 sequences of 512 tokens), 0 workers: a plain
  ``IterableDataset`` doing the same reading under torch's ``DataLoader`` against a
  ``ledger.Stream``.

What the counts leave out: the kernel's work (system calls, page faults, the resource
sharer's sockets that carry a worker's tensors), waiting, and cache misses. And valgrind
presents a CPU without the SHA extensions, so OpenSSL's SHA-256 (ledger's batch digest)
runs its generic code there, ~55 instructions per byte; the column "without libcrypto"
leaves those out (on the real CPU the digest of a packed batch of 128 KiB takes ~0.1 ms).

Needs ``valgrind`` on the PATH (Debian: ``apt-get install valgrind``). Each epoch runs
~50x slower under it: all four cases took 27 minutes on 2 cores (two at a time).

Example:
    python tools/bench_instructions.py --cases map-2w packed-0w
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

CASES = {
    # case: (sizes, workers, label of the size)
    "map-2w": ((25_600, 51_200), 2, "samples"),
    "hf-0w": ((12_800, 25_600), 0, "rows"),
    "stream-0w": ((2, 4), 0, "shards of 2,500 rows"),
    "packed-0w": ((2, 4), 0, "shards of 2,500 rows"),
}
LOADERS = ("torch", "ledger")


# ---------------------------------------------------------------------- the child


def _child(case: str, who: str, size: int, work: str) -> None:
    """One epoch (and, for ledger, the checkpoint after it) of ``who``'s loader; prints
    the number of batches."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench
    import bench_stream
    import torch
    import torch.utils.data as tud

    import ledger

    root = os.path.join(tempfile.mkdtemp(dir=work), "log")
    if case in ("map-2w", "hf-0w"):
        cfg = bench.Config(
            n=size, batch_size=256, repeats=1, ttfb_repeats=1, workers=(0,), bytes_n=0,
            commit_every=0, seed=0, hf=case == "hf-0w",
        )  # fmt: skip
        workers = CASES[case][1]
        make = bench._torch_loader if who == "torch" else bench._ledger_loader()
        loader = make(cfg, workers, root)
    else:
        packed = case == "packed-0w"
        folder = os.path.join(work, f"shards-{size}")
        if not os.path.isdir(folder):  # made by the parent, before any child runs
            raise SystemExit(f"missing {folder}")
        paths = sorted(str(p) for p in Path(folder).glob("*.parquet"))
        batch = bench_stream._batch_size(packed)
        if who == "torch":
            plain = bench_stream.PlainStream(paths, batch, packed, 0)
            loader = tud.DataLoader(plain, batch_size=None)
        else:
            stream = bench_stream._stream(paths, packed)
            loader = ledger.DataLoader(stream, batch_size=batch, shuffle=True, seed=0, log=root)
    torch.manual_seed(0)
    batches = sum(1 for _ in loader)
    if hasattr(loader, "state_dict"):
        loader.state_dict()
    print(f"batches={batches}")


# ---------------------------------------------------------------------- the parent


@dataclass(frozen=True)
class Count:
    """One run's instructions: the main process's, its workers' (summed), and of those
    the ones in libcrypto (OpenSSL), and the epoch's batches."""

    main: int
    workers: int
    crypto: int
    batches: int


def _summary(path: Path) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"{path}: no totals (did valgrind finish?)")


def _crypto(path: Path) -> int:
    """Instructions executed inside libcrypto (exclusive cost, every function of it)."""
    out = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    total = 0
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(", line)
        if m and "libcrypto" in line and "PROGRAM TOTALS" not in line:
            total += int(m.group(1).replace(",", ""))
    return total


def _run(case: str, who: str, size: int, work: str) -> Count:
    """One epoch of ``who`` under callgrind (children traced)."""
    out = Path(work) / f"cg-{case}-{who}-{size}"
    out.mkdir()
    cmd = [
        "valgrind", "--tool=callgrind", "--trace-children=yes",
        f"--callgrind-out-file={out}/%p.out",
        sys.executable, os.path.abspath(__file__), "--child", case, who, str(size), work,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
    batches = int(re.findall(r"batches=(\d+)", stdout)[-1])
    main = workers = crypto = 0
    for path in out.glob("*.out"):
        count = _summary(path)
        crypto += _crypto(path)
        if path.stem == str(proc.pid):  # valgrind runs the program in its own process
            main = count
        else:
            workers += count
    if main == 0:
        raise RuntimeError(f"no callgrind output for the main process in {out}")
    return Count(main, workers, crypto, batches)


def _per_batch(small: Count, large: Count) -> tuple[float, float, float]:
    """(main, workers, libcrypto) instructions per batch between two epoch sizes."""
    d = large.batches - small.batches
    if d <= 0:
        raise RuntimeError(
            f"the larger epoch has {large.batches} batches, the smaller {small.batches}"
        )
    return (
        (large.main - small.main) / d,
        (large.workers - small.workers) / d,
        (large.crypto - small.crypto) / d,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        case, who, size, work = a.child
        _child(case, who, int(size), work)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        raise SystemExit("needs valgrind (Debian: apt-get install valgrind)")
    console = Console(width=max(Console().width, 120))
    work = tempfile.mkdtemp(prefix="ledger-bench-instructions-")
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_stream import make_shards

        for case in a.cases:
            if case.endswith("-0w") and case != "hf-0w":
                for shards in CASES[case][0]:
                    folder = os.path.join(work, f"shards-{shards}")
                    if not os.path.isdir(folder):
                        os.makedirs(folder)
                        make_shards(folder, shards, 2500)
        jobs = [(c, w, s) for c in a.cases for w in LOADERS for s in CASES[c][0]]
        with ThreadPoolExecutor(a.jobs) as pool:
            counts = dict(zip(jobs, pool.map(lambda j: _run(*j, work), jobs), strict=True))
        table = Table(
            title="Instructions per batch (callgrind; between two epoch sizes), "
            "main process + workers"
        )
        for col in ("case", "sizes", "loader", "main", "workers", "total", "of it libcrypto",
                    "ledger / torch", "without libcrypto"):  # fmt: skip
            table.add_column(col, justify="left" if col in ("case", "loader") else "right")
        for case in a.cases:
            sizes, _, unit = CASES[case]
            per = {w: _per_batch(counts[case, w, sizes[0]], counts[case, w, sizes[1]])
                   for w in LOADERS}  # fmt: skip
            base = sum(per["torch"][:2])
            base_plain = base - per["torch"][2]
            for who in LOADERS:
                m, wk, cr = per[who]
                table.add_row(
                    case, f"{sizes[0]:,} / {sizes[1]:,} {unit}", who,
                    f"{m / 1e3:,.0f} k", f"{wk / 1e3:,.0f} k", f"{(m + wk) / 1e3:,.0f} k",
                    f"{cr / 1e3:,.0f} k",
                    f"{(m + wk) / base:.3f}" if who == "ledger" else "",
                    f"{(m + wk - cr) / base_plain:.3f}" if who == "ledger" else "",
                )  # fmt: skip
        console.print(table)
        console.print(
            "A ratio above 1: ledger executes more instructions per batch than torch. "
            "Kernel time and waiting are not counted (see the module docstring)."
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
