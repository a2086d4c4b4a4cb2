"""Write CPython's standard library as Parquet shards, the corpus of the packed example.

The sorted ``.py`` files of the running interpreter's stdlib (``site-packages``
excluded; the list of ``examples/train_lm.py``) are cut into contiguous runs of about
equal bytes, one run per shard, so shards hold unequal numbers of rows; the last run
gets about half a share, so the final shard is short. Each row is one file: ``path``
(relative to the stdlib root, so shards made on two machines with the same Python
version are equal) and ``text`` (UTF-8, undecodable bytes replaced by U+FFFD). A
``manifest.json`` written last names the shards and their row counts;
``examples/train_lm_packed.py`` reads the shard list from it.

Example:
    python tools/make_shards.py runs/shards --shards 8
    python tools/make_shards.py runs/shards-small --shards 4 --max-files 12 --row-group-rows 2
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_lm import stdlib_files  # examples/ is not a package

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
SCHEMA = pa.schema([("path", pa.string()), ("text", pa.string())])


def shard_name(index: int, count: int) -> str:
    """``shard-00003-of-00008.parquet``: names sort in shard order."""
    return f"shard-{index:05d}-of-{count:05d}.parquet"


def make_shards(
    out_dir: str | os.PathLike[str],
    shards: int = 8,
    max_files: int | None = None,
    row_group_rows: int = 64,
) -> list[str]:
    """Write the stdlib ``.py`` files to Parquet shards under ``out_dir``.

    Args:
        out_dir: directory to write to (created). Existing shards of the same names are
            replaced.
        shards: number of shards (>= 1); ``min(shards, files)``, as no shard is empty.
        max_files: use only the first ``max_files`` files of the sorted list.
        row_group_rows: rows (files) per Parquet row group.

    Returns:
        The paths of the shards written, sorted (= row order of the corpus).

    Raises:
        ValueError: if ``shards`` or ``row_group_rows`` is < 1, or no file is selected.

    Note:
        Each shard and the manifest are written to a temporary name, then renamed, so a
        reader never sees half a file, and concurrent writers (two ranks both finding
        the directory empty) write the same bytes. A crash mid-way leaves some shards and
        no new manifest; run again.
    """
    if shards < 1 or row_group_rows < 1:
        raise ValueError(f"shards and row_group_rows must be >= 1, got {shards}, {row_group_rows}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(max_files)
    if not files:
        raise ValueError(f"no .py file selected under {stdlib} (max_files={max_files})")
    data = [p.read_bytes() for p in files]
    bounds = _cut_points([len(d) for d in data], shards)
    runs = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    for i, run in enumerate(runs):
        table = pa.table(
            {
                "path": [files[j].relative_to(stdlib).as_posix() for j in run],
                "text": [data[j].decode("utf-8", errors="replace") for j in run],
            },
            schema=SCHEMA,
        )
        path = out / shard_name(i, len(runs))
        with _atomic(path) as tmp:
            pq.write_table(table, tmp, row_group_size=row_group_rows)
        paths.append(str(path))
    manifest = {
        "version": MANIFEST_VERSION,
        "python": sysconfig.get_python_version(),
        "max_files": max_files,
        "row_group_rows": row_group_rows,
        "shards": [
            {"path": Path(p).name, "rows": len(run)} for p, run in zip(paths, runs, strict=True)
        ],
    }
    with _atomic(out / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    return paths


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a shard directory, or None if there is none (yet)."""
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(
            f"{path}: manifest version {manifest.get('version')!r}, expected "
            f"{MANIFEST_VERSION}; delete the directory and make the shards again"
        )
    return manifest


def _cut_points(sizes: list[int], shards: int) -> list[int]:
    """Boundaries ``[0, c1, ..., n]`` of ``min(shards, n)`` contiguous, non-empty runs.

    Run ``i`` starts at the first file whose byte offset in the corpus reaches
    ``i * total / (shards - 1/2)``: the runs hold about equal bytes, hence unequal
    numbers of files, and the last holds about half as many bytes as the others -- the
    short final shard a real corpus has.
    """
    n = len(sizes)
    k = min(shards, n)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    share = sum(sizes) / (k - 0.5)
    cuts = [0]
    for i in range(1, k):
        c = int(np.searchsorted(starts, i * share, side="left"))
        # Every run keeps at least one file, and leaves one for each run after it.
        cuts.append(min(max(c, cuts[-1] + 1), n - (k - i)))
    return [*cuts, n]


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """Yield a temporary name next to ``path``; rename it to ``path`` on success."""
    # pid in the name: two processes making the same shards never share a temporary.
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    yield tmp
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Example: python tools/make_shards.py runs/shards --shards 8 --max-files 200",
    )
    ap.add_argument("out_dir", type=Path, help="directory for the shards and manifest.json")
    ap.add_argument("--shards", type=int, default=8, help="number of shards (default 8)")
    ap.add_argument("--max-files", type=int, default=None, help="use the first N stdlib files")
    ap.add_argument("--row-group-rows", type=int, default=64, help="rows per row group")
    args = ap.parse_args(argv)
    try:
        paths = make_shards(args.out_dir, args.shards, args.max_files, args.row_group_rows)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for entry in read_manifest(args.out_dir)["shards"]:  # type: ignore[index]
        print(f"{args.out_dir / entry['path']}\t{entry['rows']} rows")
    print(f"{len(paths)} shards", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
