"""Resume a streaming shuffle mid-epoch: Hugging Face ``datasets`` vs ``ledger.stream``.

Both libraries read the same Parquet shards (the CPython stdlib's ``.py`` files, one row
per file, columns ``path`` and ``text``, written by ``tools/make_shards.py``) through a
shuffle buffer of B rows, in batches of 8 rows. For each library and worker count the
protocol is:

1. one uninterrupted epoch, recording the ``path`` of every sample;
2. a second run stopped after S batches, whose checkpoint is taken with ``state_dict()``;
3. a fresh dataset and loader that ``load_state_dict()`` the checkpoint and consume the
   rest of the epoch.

The interrupted and resumed streams, concatenated, are compared with the set of all rows
(duplicates: samples served more than once; missing: rows never served) and, position by
position, with the uninterrupted epoch (a position past the end of either stream differs).
The Hugging Face side is ``datasets.IterableDataset.shuffle`` under
``torchdata.stateful_dataloader.StatefulDataLoader``, which saves the dataset's position
through ``IterableDataset.state_dict`` (datasets PR #6658); an exception there is reported
as text in place of the numbers.

Example:
    python tools/compare_hf.py                        # 8 shards, buffer 256, workers 0 and 2
    python tools/compare_hf.py --max-files 200 --workers 0
"""

from __future__ import annotations

import argparse
import gc
import math
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

import ledger

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_shards import make_shards  # tools/ is not a package

# torchdata 0.11 calls a deprecated torch API on every iter(); the warning is noise here.
warnings.filterwarnings("ignore", message=".*set_vital.*")

HF = "HF datasets"  # IterableDataset.shuffle under torchdata's StatefulDataLoader
LEDGER = "ledger"  # ledger.stream.Stream under ledger.DataLoader
LIBRARIES = {"hf": HF, "ledger": LEDGER}


# ---------------------------------------------------------------------------- shards


def shard_paths_column(shards: Sequence[str]) -> list[str]:
    """Every row's ``path``, in shard order."""
    return [p for s in shards for p in pq.read_table(s, columns=["path"])["path"].to_pylist()]


# ---------------------------------------------------------------------------- counting


@dataclass(frozen=True, slots=True)
class Counts:
    """How a resumed epoch compares with the rows and with the uninterrupted epoch.

    ``seen`` is the length of the interrupted stream plus the resumed one;
    ``seen == unique + duplicates`` and ``missing == rows - unique`` when every served
    sample is a row.
    """

    rows: int
    uninterrupted: int  # samples in the uninterrupted epoch
    seen: int
    unique: int
    duplicates: int
    missing: int
    differing: int  # positions where resumed and uninterrupted streams differ
    prefix_differing: int  # of those, positions before the interruption (should be 0)


def count(
    rows: Iterable[str], uninterrupted: Sequence[str], resumed: Sequence[str], cut: int
) -> Counts:
    """Compare ``resumed`` (interrupted + resumed streams) with ``rows`` and ``uninterrupted``.

    Args:
        rows: every row's key; keys must be unique.
        uninterrupted: keys served by the uninterrupted epoch, in order.
        resumed: keys served by the interrupted run followed by the resumed run.
        cut: samples the interrupted run served before its checkpoint.
    """
    all_rows = set(rows)
    served = set(resumed)
    n = max(len(uninterrupted), len(resumed))
    a = list(uninterrupted) + [None] * (n - len(uninterrupted))
    b = list(resumed) + [None] * (n - len(resumed))
    diff = [x != y for x, y in zip(a, b, strict=True)]
    return Counts(
        rows=len(all_rows),
        uninterrupted=len(uninterrupted),
        seen=len(resumed),
        unique=len(served),
        duplicates=len(resumed) - len(served),
        missing=len(all_rows - served),
        differing=sum(diff),
        prefix_differing=sum(diff[:cut]),
    )


# ---------------------------------------------------------------------------- loaders


def collate_paths(rows: list[dict[str, Any]]) -> list[str]:
    """A batch of records -> their ``path`` values (module level: picklable for workers)."""
    return [r["path"] for r in rows]


Loader = Any  # iterable of list[str] batches with state_dict() / load_state_dict()


def hf_loader(shards: Sequence[str], buffer: int, workers: int, batch_size: int) -> Loader:
    """A fresh streaming HF dataset, shuffled with a buffer, under a StatefulDataLoader."""
    import datasets
    from torchdata.stateful_dataloader import StatefulDataLoader

    # "Loading a state dict of a shuffle buffer ... without the buffer content" is logged
    # on every resume; the counts say what it means.
    datasets.logging.set_verbosity_error()
    ds = datasets.load_dataset("parquet", data_files=sorted(shards), split="train", streaming=True)
    ds = ds.shuffle(seed=0, buffer_size=buffer)
    return StatefulDataLoader(
        ds, batch_size=batch_size, num_workers=workers, collate_fn=collate_paths
    )


def ledger_loader(
    shards: Sequence[str], buffer: int, workers: int, batch_size: int, log: str
) -> Loader:
    """A fresh ``ledger.stream`` pipeline (records as items) under ``ledger.DataLoader``."""
    from ledger.stream import ShardedSource, Stream

    stream = Stream(ShardedSource(list(shards)), shuffle_buffer=buffer)
    return ledger.DataLoader(
        stream, batch_size=batch_size, seed=0, log=log, num_workers=workers,
        collate_fn=collate_paths,
    )  # fmt: skip


class ProtocolError(Exception):
    """A run of the protocol raised; ``phase`` says which of its three runs."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"{phase}: {cause}")
        self.phase = phase
        self.cause = cause


def run_protocol(make: Callable[[str], Loader], stop_step: int) -> tuple[list[str], list[str]]:
    """Uninterrupted epoch; then an epoch interrupted after ``stop_step`` batches and resumed.

    Args:
        make: builds a fresh loader; its argument names the run (``"full"`` for the
            uninterrupted one, ``"cut"`` for both the interrupted and the resumed loader,
            so that a log-backed loader can find the interrupted run's log).
        stop_step: batches the interrupted run consumes before ``state_dict()``.

    Returns:
        ``(uninterrupted, interrupted + resumed)`` sample keys, in order.

    Raises:
        ProtocolError: wrapping what a run raised, with the phase: ``"uninterrupted
            epoch"``, ``"interrupted run"`` or ``"resume"``.
    """
    phase = "uninterrupted epoch"
    try:
        full = [x for batch in make("full") for x in batch]
        phase = "interrupted run"
        loader = make("cut")
        resumed: list[str] = []
        for step, batch in enumerate(loader, start=1):
            resumed += batch
            if step == stop_step:
                break
        token = loader.state_dict()
        del loader  # the interrupted process is gone; its workers with it
        phase = "resume"
        loader = make("cut")
        loader.load_state_dict(token)
        resumed += [x for batch in loader for x in batch]
    except Exception as exc:
        raise ProtocolError(phase, exc) from exc
    return full, resumed


# ---------------------------------------------------------------------------- comparison


@dataclass(frozen=True, slots=True)
class Result:
    library: str
    workers: int
    counts: Counts | None
    error: str | None
    seconds: float


def _error_text(err: ProtocolError) -> str:
    # A worker's exception arrives wrapped: "Caught X in DataLoader worker process 0.
    # Original Traceback ..."; its first and last lines are what a reader needs.
    exc = err.cause
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = "" if not lines else lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"
    return f"during the {err.phase}: {type(exc).__name__}: {text}"


def compare(
    shards: Sequence[str],
    workdir: Path,
    *,
    workers: Sequence[int] = (0, 2),
    buffer: int = 256,
    batch_size: int = 8,
    stop_step: int | None = None,
    libraries: Sequence[str] = ("hf", "ledger"),
) -> list[Result]:
    """Run the protocol of :func:`run_protocol` for each library and worker count.

    Args:
        shards: Parquet files with a unique ``path`` column.
        workdir: scratch directory; ledger logs go to a new ``workdir/logs-*`` directory.
        workers: ``num_workers`` values to run.
        buffer: shuffle buffer, rows.
        batch_size: rows per batch.
        stop_step: batches before the interruption (default: half the epoch's batches).
        libraries: keys of :data:`LIBRARIES`.

    Returns:
        One :class:`Result` per (library, workers); an exception in a run is caught and
        reported in ``error``, with ``counts=None``.
    """
    rows = shard_paths_column(shards)
    if stop_step is None:
        stop_step = math.ceil(len(rows) / batch_size) // 2
    logs = Path(tempfile.mkdtemp(prefix="logs-", dir=workdir))  # never an old run's log
    results = []
    for lib in libraries:
        for w in workers:

            def make(run: str, lib: str = lib, w: int = w) -> Loader:
                if lib == "hf":
                    return hf_loader(shards, buffer, w, batch_size)
                return ledger_loader(shards, buffer, w, batch_size, str(logs / f"w{w}-{run}"))

            t0 = time.perf_counter()
            try:
                full, resumed = run_protocol(make, stop_step)
            except ProtocolError as exc:
                seconds = time.perf_counter() - t0
                results.append(Result(LIBRARIES[lib], w, None, _error_text(exc), seconds))
            else:
                seconds = time.perf_counter() - t0
                counts = count(rows, full, resumed, stop_step * batch_size)
                results.append(Result(LIBRARIES[lib], w, counts, None, seconds))
            # A failed run's loader lives on in its traceback's frames; its workers would
            # shut down in the middle of the next run, and be timed there.
            gc.collect()
    return results


# ---------------------------------------------------------------------------- CLI


def render(results: Sequence[Result], title: str) -> Table:
    table = Table(title=title)
    for name in ("library", "workers", "samples in epoch", "duplicates", "missing"):
        table.add_column(name, justify="left" if name == "library" else "right")
    table.add_column("differing positions", justify="right")
    table.add_column("seconds", justify="right")
    for r in results:
        if r.counts is None:
            table.add_row(r.library, str(r.workers), "[red]error[/red]", "", "", "", "")
            continue
        c = r.counts
        table.add_row(
            r.library, str(r.workers), f"{c.seen} / {c.rows}", str(c.duplicates),
            str(c.missing), str(c.differing), f"{r.seconds:.1f}",
        )  # fmt: skip
    return table


def _hf_shutdown_sleep() -> str:
    try:
        import datasets

        return f"{datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN:g}"
    except (ImportError, AttributeError):
        return "?"


def _command(args: argparse.Namespace, stop_step: int) -> str:
    parts = ["python", "tools/compare_hf.py", "--shards", str(args.shards)]
    parts += ["--buffer", str(args.buffer), "--batch-size", str(args.batch_size)]
    parts += ["--stop-step", str(stop_step), "--workers", *map(str, args.workers)]
    if args.max_files is not None:
        parts += ["--max-files", str(args.max_files)]
    for lib in args.only or ():
        parts += ["--only", lib]
    return shlex.join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Example: python tools/compare_hf.py"
    )
    parser.add_argument("--shards", type=int, default=8, help="Parquet shards (default 8)")
    parser.add_argument("--buffer", type=int, default=256, help="shuffle buffer, rows")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per batch")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers")
    parser.add_argument(
        "--stop-step", type=int, default=None, help="batches before the interruption "
        "(default: half the epoch)"
    )  # fmt: skip
    parser.add_argument("--max-files", type=int, default=None, help="first N stdlib files")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="shards and logs (default: a temp dir)"
    )
    parser.add_argument(
        "--only", choices=sorted(LIBRARIES), action="append", help="run one library only"
    )
    args = parser.parse_args(argv)
    console = Console()
    if console.width < 100:  # piped output defaults to 80 columns: too narrow for the table
        console = Console(width=100)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compare_hf-") as tmp:
        workdir = args.workdir or Path(tmp)
        try:
            shards = make_shards(workdir / "shards", args.shards, args.max_files)
        except ValueError as exc:
            console.print(f"[red]error:[/red] {exc}")
            return 2
        rows = sum(pq.read_metadata(s).num_rows for s in shards)
        stop_step = args.stop_step
        if stop_step is None:
            stop_step = math.ceil(rows / args.batch_size) // 2
        results = compare(
            shards, workdir, workers=args.workers, buffer=args.buffer,
            batch_size=args.batch_size, stop_step=stop_step,
            libraries=args.only or ("hf", "ledger"),
        )  # fmt: skip
    title = (
        f"Resume after {stop_step} of {math.ceil(rows / args.batch_size)} batches: "
        f"{rows} rows in {args.shards} shards, shuffle buffer {args.buffer}, "
        f"batch {args.batch_size}"
    )
    console.print(render(results, title))
    for r in results:
        if r.error is not None:
            console.print(f"[red]{r.library}, workers={r.workers}:[/red] {r.error}")
        if r.counts is not None and r.counts.prefix_differing:
            console.print(
                f"[yellow]note:[/yellow] {r.library}, workers={r.workers}: "
                f"{r.counts.prefix_differing} positions differ before the interruption "
                "(the two runs are not deterministic)"
            )
    console.print(
        "samples in epoch: interrupted + resumed samples / rows. differing positions: vs the "
        "uninterrupted epoch. seconds: all three runs (HF's include the "
        f"{_hf_shutdown_sleep()} s datasets sleeps at the end of each shuffled stream)."
    )
    console.print(f"stdlib of Python {sys.version.split()[0]}; {time.perf_counter() - t0:.0f} s")
    console.print(f"reproduce: [bold]{_command(args, stop_step)}[/bold]", soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
