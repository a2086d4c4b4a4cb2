"""Only the 0-worker rows of ``tools/bench.py``'s throughput table, with CPU clocks too.

Times torch's DataLoader and ``ledger.DataLoader`` (default arguments, and
``rng="off", digest=False``) over the trivial map-style dataset as ``tools/bench.py``
does (construct, one epoch, ``state_dict()``; repeats interleaved, order rotated, best
of R), and prints per batch: wall-clock, the process's CPU (which adds the segment's
background encoding) and the main thread's CPU (what the training loop waits for on an
idle machine), each as a ratio to torch's. On a loaded, shared machine the CPU columns
are the ones that mean something; the quiet run of ``tools/bench.py`` decides the
README's table.

Example:
    python tools/bench_zero_workers.py            # N = 200,000, best of 5 (under a minute)
    python tools/bench_zero_workers.py --n 1000000 --repeats 3
    python tools/bench_zero_workers.py --encode-at-commit  # + a diagnostic row
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data as tud
from bench import Trivial
from rich.console import Console
from rich.table import Table

import ledger


def _makers(
    n: int, batch_size: int, encode_at_commit: bool = False
) -> dict[str, Callable[[str], Any]]:
    def torch_loader(_root: str) -> tud.DataLoader:
        g = torch.Generator()
        g.manual_seed(0)
        return tud.DataLoader(Trivial(n), batch_size=batch_size, shuffle=True, generator=g)

    def ledger_loader(**options: Any) -> Callable[[str], Any]:
        def make(root: str) -> ledger.DataLoader:
            return ledger.DataLoader(
                Trivial(n), batch_size=batch_size, shuffle=True, seed=0, log=root, **options
            )

        return make

    makers = {
        "torch DataLoader": torch_loader,
        "ledger (default: rng='batch', digest)": ledger_loader(),
        "ledger (rng='off', digest=False)": ledger_loader(rng="off", digest=False),
    }
    if encode_at_commit:
        makers["ledger (default), segment encoded at the commit"] = _at_commit(ledger_loader())
    return makers


def _at_commit(make: Callable[[str], Any]) -> Callable[[str], Any]:
    """``make``'s loader whose segment builder keeps the epoch's events and encodes them
    all at the commit (``state_dict()``, on the training loop's thread) instead of a row
    group at a time on its background thread: a diagnostic of what the background
    encoding costs the loop's thread while the epoch runs (the GIL, the second core)."""
    import ledger.log
    from ledger.segments import SegmentBuilder

    class KeepAll(SegmentBuilder):
        def add(self, chunk: Any) -> None:
            self._chunks.append(chunk)
            self._rows += chunk.rows

    class Loader:
        def __init__(self, loader: Any) -> None:
            self.loader = loader

        def __iter__(self) -> Any:
            ledger.log.SegmentBuilder = KeepAll  # type: ignore[misc]  # the epoch's builder
            try:
                yield from self.loader
            finally:
                ledger.log.SegmentBuilder = SegmentBuilder  # type: ignore[misc]

        def state_dict(self) -> Any:
            return self.loader.state_dict()

    return lambda root: Loader(make(root))


def _run(make: Callable[[str], Any]) -> tuple[float, float, float, int]:
    """Seconds of wall-clock, process CPU and thread CPU to build, iterate, checkpoint."""
    root = tempfile.mkdtemp(prefix="ledger-bench-w0-")
    try:
        w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
        loader = make(root)
        batches = sum(1 for _ in loader)
        if hasattr(loader, "state_dict"):
            loader.state_dict()
        return (
            time.perf_counter() - w, time.process_time() - p, time.thread_time() - t, batches
        )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200_000, help="dataset length")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--encode-at-commit",
        action="store_true",
        help="add a row whose segment is encoded at the commit, not on the background "
        "thread during the epoch (what that thread costs the loop)",
    )
    a = parser.parse_args(argv)
    makers = _makers(a.n, a.batch_size, a.encode_at_commit)
    for make in _makers(8 * a.batch_size, a.batch_size).values():
        _run(make)  # warm-up: lazy imports and first calls
    names = list(makers)
    best = {name: [float("inf")] * 3 for name in names}
    for r in range(a.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            *secs, batches = _run(makers[name])
            best[name] = [min(b, s / batches * 1e6) for b, s in zip(best[name], secs, strict=True)]
    table = Table(
        title=f"0 workers, trivial map-style dataset, N={a.n:,}, batch {a.batch_size}, "
        f"best of {a.repeats}: µs per batch (ratio: torch / this)"
    )
    for col in ("loader", "wall", "process CPU", "main-thread CPU"):
        table.add_column(col, justify="left" if col == "loader" else "right")
    base = best[names[0]]
    for name in names:
        table.add_row(
            name,
            *(f"{v:.1f} ({b / v:.3f}×)" for v, b in zip(best[name], base, strict=True)),
        )
    console = Console(width=120)
    console.print(table)
    console.print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
