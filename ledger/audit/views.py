"""DuckDB views over a log root: the audit's one entry point to the data.

:func:`connect` reads the small files of a log (``run.json``, ``attempts/``, the
commits as columns: :mod:`ledger.history`, which takes a compacted history's commits
from its compaction's catalog), resolves the lineage of a head commit from the parent
links, and opens an in-memory DuckDB connection with these views (DuckDB types):

``events``: every event of every segment named by a commit marker, all branches.
Parquet files that no marker names (orphans of a crash mid-commit) are not included.

    ============  =========  =====================================================
    attempt       INTEGER    attempt that consumed the event
    rank          INTEGER    ``torch.distributed`` rank
    worker        INTEGER    DataLoader worker, -1 for the main process
    epoch         INTEGER    epoch of the event
    batch         BIGINT     per-rank batch index over the lineage (training step)
    position      BIGINT     index in the epoch's global order
    sample_id     BIGINT     stable id of the sample
    kind          VARCHAR    ``'sample'`` (consumed) or ``'skip'`` (dropped by
                             ``drop_last``; ``batch`` = the batch that closed the epoch)
    commit_id     VARCHAR    the commit whose marker names the event's segment
    step          BIGINT     that commit's step
    ============  =========  =====================================================

``lineage``: the same columns, restricted to the commits in the lineage of the head
commit: exactly what the model of the head checkpoint saw.

``commits``: one row per commit marker.

    ============  =========  =====================================================
    commit_id     VARCHAR    ``f"{step:012d}-{attempt:04d}"``
    step          BIGINT     batches consumed by rank 0 along the lineage
    attempt       INTEGER    attempt that wrote the commit
    parent        VARCHAR    previous commit of its chain, NULL for the first
    world_size    INTEGER    world size of the attempt
    created_at    TIMESTAMP  marker creation time, UTC
    segments      INTEGER    segments named by the marker (0: no new events)
    rows          BIGINT     events in those segments, per the marker (rows)
    bytes         BIGINT     size of those segments, per the marker (bytes)
    epoch         INTEGER    rank 0 after the commit: epoch of the next batch
    epoch_batch   BIGINT     rank 0 after the commit: batches of that epoch consumed
    batch         BIGINT     rank 0 after the commit: index of the next batch
    in_lineage    BOOLEAN    the commit is in the lineage of the head
    is_head       BOOLEAN    the commit is the head
    ============  =========  =====================================================

``segments``: one row per segment named by a marker: commit_id VARCHAR, step BIGINT,
attempt INTEGER, rank INTEGER, path VARCHAR (relative to the root), rows BIGINT,
bytes BIGINT, sha256 VARCHAR.

``states``: one row per rank per marker, the pipeline state after the commit:
commit_id VARCHAR, step BIGINT, attempt INTEGER, rank INTEGER, epoch INTEGER,
epoch_batch BIGINT, batch BIGINT.

``attempts``: one row per ``attempts/<A>.json``: attempt INTEGER, parent VARCHAR (the
commit it resumed from, NULL for a fresh start), world_size INTEGER, created_at TIMESTAMP
(UTC), host VARCHAR, pid BIGINT.

``uncommitted``: events journaled by a rank and covered by no commit of its attempt:
batches that reached a training loop after its last commit (a crashed attempt's lost
work, or a live attempt's work in flight). Columns as ``events`` without ``commit_id``
and ``step``; only ``'sample'`` events. Read from ``ROOT/journal/`` (for object-store roots: the
journals a later attempt uploaded from local disk).

``journals``: one row per journal under ``ROOT/journal/``: attempt INTEGER, rank INTEGER,
path VARCHAR, uncommitted_batches BIGINT, unreadable BIGINT (damaged records skipped:
their checksum or fields did not check).

``run``: one row from ``run.json``: run_id VARCHAR, created_at TIMESTAMP (UTC),
dataset_len BIGINT, seed BIGINT (a seed of 2**63 or more as its int64 bits), shuffle BOOLEAN,
batch_size BIGINT, drop_last BOOLEAN, world_size INTEGER, "order" VARCHAR.

Confinement: segments are scanned through an Arrow dataset over the exact files the
markers name, registered before the connection is locked; then
``enable_external_access=false`` and ``lock_configuration=true`` are set, so user SQL
cannot read or write any file (``read_csv``, ``COPY ... TO``, ``ATTACH``, ``INSTALL``
fail) and cannot undo the settings. The only directory DuckDB may still touch is its
private spill directory (``temp_directory``), created for the connection and removed
with it. ``read_parquet`` over the file list is not used on purpose: DuckDB's
``allowed_paths`` would then also let ``COPY ... TO`` overwrite a segment.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from ledger.commits import (
    ATTEMPT_NAME,
    Commit,
    default_head,
    lineage,
    list_commits,
    parsing_once,
    read_attempt,
    read_commit,
    read_run,
)
from ledger.compaction import piece_table
from ledger.errors import LogCorrupted
from ledger.history import History, read_history, segments_table
from ledger.journal import uncommitted
from ledger.manifest import check_chain
from ledger.schema import EVENT_SCHEMA, chunks_to_table
from ledger.store import Store, background

# String columns are read as Arrow dictionaries, which DuckDB scans as VARCHAR without
# building a string per row: filtering on `kind` is ~3x faster than with plain strings.
_DICT = pa.dictionary(pa.int32(), pa.string())
EVENTS_SCHEMA = pa.schema(
    [f.with_type(_DICT) if f.name in ("kind", "source") else f for f in EVENT_SCHEMA]
    + [pa.field("commit_id", _DICT, nullable=False), pa.field("step", pa.int64(), nullable=False)]
)
"""Arrow schema of the ``events`` and ``lineage`` views."""

_TS = pa.timestamp("us")

_COMMITS_SCHEMA = pa.schema(
    [
        ("commit_id", pa.string()),
        ("step", pa.int64()),
        ("attempt", pa.int32()),
        ("parent", pa.string()),
        ("world_size", pa.int32()),
        ("created_at", _TS),
        ("segments", pa.int32()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("epoch", pa.int32()),
        ("epoch_batch", pa.int64()),
        ("batch", pa.int64()),
        ("in_lineage", pa.bool_()),
        ("is_head", pa.bool_()),
    ]
)
_STATES_SCHEMA = pa.schema(
    [
        ("commit_id", pa.string()),
        ("step", pa.int64()),
        ("attempt", pa.int32()),
        ("rank", pa.int32()),
        ("epoch", pa.int32()),
        ("epoch_batch", pa.int64()),
        ("batch", pa.int64()),
    ]
)
_ATTEMPTS_SCHEMA = pa.schema(
    [
        ("attempt", pa.int32()),
        ("parent", pa.string()),
        ("world_size", pa.int32()),
        ("created_at", _TS),
        ("host", pa.string()),
        ("pid", pa.int64()),
    ]
)
_RUN_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("created_at", _TS),
        ("dataset_len", pa.int64()),
        ("seed", pa.int64()),
        ("shuffle", pa.bool_()),
        ("batch_size", pa.int64()),
        ("drop_last", pa.bool_()),
        ("world_size", pa.int32()),
        ("order", pa.string()),
    ]
)


@parsing_once
def connect(root: str, head: str | None = None) -> duckdb.DuckDBPyConnection:
    """Open an in-memory, locked-down DuckDB connection with the audit views of a log.

    The views are described in this module's docstring. Only the JSON files are read
    here; segments are scanned lazily by each query.

    Args:
        root: the log root (a local directory, or an object-store URI such as
            ``s3://bucket/prefix``; credentials from the standard AWS environment).
        head: id of the head commit whose lineage the ``lineage`` view holds
            (``"000000000042-0001"``); ``None`` for the default head, the newest
            commit (largest step) of the newest attempt that has commits.

    Returns:
        The connection. User SQL on it cannot access files or change settings.

    Raises:
        CommitNotFound: if ``root`` holds no run, or ``head`` names no commit.
        LogCorrupted: if a parent link names a missing commit, the chain loops, or a
            segment named by a marker is missing.
    """
    # DuckDB's start (~20 ms, the GIL released) overlaps with reading the markers. A
    # private spill directory: the one place DuckDB may write once access is disabled.
    scratch = tempfile.mkdtemp(prefix="ledger-audit-")
    opening = background("duckdb").submit(
        duckdb.connect, ":memory:", config={"temp_directory": scratch}
    )
    try:
        store = Store(root)
        run, tables, in_lineage, is_head, in_chain, placed = _read_log(store, head)
        con = opening.result()
    except BaseException:
        _discard(opening, scratch)
        raise
    weakref.finalize(con, shutil.rmtree, scratch, True)
    events = _events_dataset(store, tables.segments, placed)
    con.register("events", events)
    if not in_chain.all():
        lineage_placed = (placed[0][in_chain], placed[1])
        events = _events_dataset(store, tables.segments.filter(pa.array(in_chain)), lineage_placed)
    con.register("lineage", events)  # every segment is of the lineage: the same dataset
    commits_view = tables.commits.append_column("in_lineage", pa.array(in_lineage)).append_column(
        "is_head", pa.array(is_head)
    )
    _REGISTERED[con] = _Registered(tables.segments, in_chain, commits_view, *placed)
    con.register("commits", commits_view)
    con.register("segments", tables.segments)
    con.register("states", tables.states)
    con.register("attempts", _attempts_table(store))
    con.register("run", _run_table(run))
    lost, journals = _journal_tables(store, tables.states)
    con.register("uncommitted", lost)
    con.register("journals", journals)
    for setting in (
        "autoinstall_known_extensions=false",
        "autoload_known_extensions=false",
        "enable_progress_bar=false",  # a long query would draw on the user's terminal
        "enable_external_access=false",
        "lock_configuration=true",
    ):
        con.execute(f"SET {setting}")
    return con


def _read_log(
    store: Store, head: str | None
) -> tuple[
    dict[str, Any], _Tables, np.ndarray, np.ndarray, np.ndarray, tuple[np.ndarray, pa.Table]
]:
    """What :func:`connect` reads of the log: the run record, the marker-derived tables,
    which commits are of the head's lineage and which is the head, which segments are of
    the lineage, and where each segment lies (:func:`_placed`).

    Raises:
        CommitNotFound, LogCorrupted: as :func:`connect`.
    """
    run = read_run(store)
    history = read_history(store)
    at = None if history is None or head is None else history.index(head)
    if history is not None and (head is None or at is not None):
        # The columnar path: no Python object per commit (a compacted history of 10^4).
        if at is None and len(history):
            at = len(history) - 1  # the default head: the newest of the newest attempt
        head = history.ids[at].as_py() if at is not None else None
        in_lineage = np.zeros(len(history), np.bool_)
        if at is not None:
            chain = history.lineage(at)
            recorded = read_commit(store, str(head)).lineage_ranges
            check_chain(str(head), recorded, history.attempt[chain], history.step[chain])
            in_lineage[chain] = True
        is_head = np.arange(len(history)) == (-1 if at is None else at)
        tables = _history_tables(history)
        in_chain = in_lineage[history.segment_commits()]
    else:
        commits = list_commits(store)
        by_id = {c.id: c for c in commits}
        if head is None:
            newest = default_head(commits)
            head = newest.id if newest is not None else None
        ids = sorted(c.id for c in lineage(store, head, known=by_id)) if head is not None else []
        chain = pa.array(ids, pa.string())
        tables = _tables(commits)
        in_lineage = _among(tables.commits["commit_id"], chain)
        is_head = _among(tables.commits["commit_id"], pa.array([head], pa.string()))
        in_chain = _among(tables.segments["commit_id"], chain)
    placed = _placed(store, tables.segments["path"])
    _check_segments_exist(store, tables.segments, placed)
    return run, tables, in_lineage, is_head, in_chain, placed


def _discard(opening: Future[duckdb.DuckDBPyConnection], scratch: str) -> None:
    """Close the connection :func:`connect` was opening (once it is open) and remove its
    spill directory, after reading the log failed."""
    with contextlib.suppress(Exception):  # the log's error is the one to raise
        opening.result().close()
    shutil.rmtree(scratch, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class _Registered:
    """What :func:`connect` registered on a connection, kept as Arrow and numpy.

    Attributes:
        segments: the ``segments`` table.
        in_chain: ``bool``: which of its segments are of the head's lineage.
        commits: the ``commits`` table.
        placed: ``int64``: each segment's row in ``pieces`` (-1: a file of its own).
        pieces: the :func:`ledger.compaction.piece_table` the views read.
    """

    segments: pa.Table
    in_chain: np.ndarray
    commits: pa.Table
    placed: np.ndarray
    pieces: pa.Table


_REGISTERED: weakref.WeakKeyDictionary[duckdb.DuckDBPyConnection, _Registered] = (
    weakref.WeakKeyDictionary()
)
"""What :func:`connect` registered on each open connection."""


def commits_table(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """The ``commits`` view of a connection from :func:`connect`, as the Arrow table it
    reads (no query, no copy).

    Raises:
        KeyError: if ``con`` was not opened by :func:`connect`.
    """
    return _REGISTERED[con].commits


def jobs(con: duckdb.DuckDBPyConnection) -> pa.Table:
    """The segments of the connection's log as a scan's jobs
    (:data:`ledger.audit.scan.JOBS_SCHEMA`): those of the lineage by step, attempt and
    rank, then the others; Arrow over the registered tables, no object per segment.

    Raises:
        KeyError: if ``con`` was not opened by :func:`connect`.
    """
    return scan_jobs(con)[0]


def scan_jobs(
    con: duckdb.DuckDBPyConnection,
) -> tuple[pa.Table, tuple[np.ndarray, pa.Table]]:
    """:func:`jobs`, with each job's row in the :func:`ledger.compaction.piece_table` the
    views read (``int64``, -1: a file of its own) and that table, as :func:`connect` found
    them: the ``placed`` of :func:`ledger.audit.scan.scan_segments`.

    Raises:
        KeyError: if ``con`` was not opened by :func:`connect`.
    """
    known = _REGISTERED[con]
    in_chain = known.in_chain
    table = known.segments.append_column("counted", pa.array(in_chain))
    # numpy's stable lexsort, as Arrow's sort_by, at a tenth of its cost; most often the
    # segments are in order already (one attempt, no branch).
    keys = [table[k].to_numpy() for k in ("rank", "attempt", "step")]
    order = np.lexsort((*keys, ~in_chain))
    if np.array_equal(order, np.arange(len(order))):
        return table, (known.placed, known.pieces)
    return table.take(pa.array(order, pa.int64())), (known.placed[order], known.pieces)


@dataclass(frozen=True, slots=True)
class _Tables:
    """The marker-derived tables of a set of commits, built once per connection.

    Attributes:
        commits: ``commits`` view rows without ``in_lineage`` and ``is_head``.
        segments: the ``segments`` view.
        states: the ``states`` view.
    """

    commits: pa.Table
    segments: pa.Table
    states: pa.Table


def _tables(commits: list[Commit]) -> _Tables:
    """The tables of ``commits``: for version-2 commits (a rank table each) with numpy
    over all their rank rows at once (:func:`_history_tables`); for logs holding
    version-1 markers, commit by commit."""
    history = History.of(commits)
    if history is None:
        return _Tables(_commit_rows(commits), segments_table(commits), _states_table(commits))
    return _history_tables(history)


def _history_tables(h: History) -> _Tables:
    """The tables of the commits of ``h``: numpy over all their rank rows at once, no
    Python object per commit, rank or segment."""
    n = len(h)
    rows = h.rows
    of, rank = h.rank_of_rows()
    starts = h.starts[:-1]
    ids = h.ids
    states = pa.table(
        [
            ids.take(pa.array(of, pa.int64())),
            h.step[of],
            h.attempt[of].astype(np.int32),
            rank.astype(np.int32),
            rows[:, 10].astype(np.int32),
            rows[:, 11],
            rows[:, 12],
        ],
        schema=_STATES_SCHEMA,
    )
    segments = h.segments()
    at = of[np.flatnonzero(rows[:, 1] == 1)]
    per = {
        "segments": np.bincount(at, minlength=n).astype(np.int32),
        "rows": _sums(at, segments["rows"].to_numpy(), n),
        "bytes": _sums(at, segments["bytes"].to_numpy(), n),
    }
    first = rows[starts, 10:13] if n else np.zeros((0, 3), np.int64)  # rank 0's state
    table = pa.table(
        {
            "commit_id": ids,
            "step": h.step,
            "attempt": h.attempt.astype(np.int32),
            "parent": h.parent,
            "world_size": h.world_size.astype(np.int32),
            "created_at": _timestamps(h.created_at, ids),
            **per,
            "epoch": first[:, 0].astype(np.int32),
            "epoch_batch": first[:, 1],
            "batch": first[:, 2],
        }
    )
    return _Tables(table.cast(_COMMITS_SCHEMA.remove(13).remove(12)), segments, states)


def _commit_rows(commits: list[Commit]) -> pa.Table:
    full = _commits_table(commits, set(), None)
    return full.drop_columns(["in_lineage", "is_head"])


def _among(values: pa.ChunkedArray, chosen: pa.Array) -> np.ndarray:
    """``bool``: whether each of ``values`` is one of ``chosen``."""
    return np.asarray(pc.is_in(values, value_set=chosen).to_numpy(zero_copy_only=False), np.bool_)


def _timestamps(created: pa.Array, ids: pa.Array) -> pa.Array:
    """The commits' ``created_at`` as naive UTC timestamps, parsed by Arrow at once when
    every one carries its offset (as ledger writes them), else one by one."""
    try:
        return created.cast(pa.timestamp("us", "UTC")).cast(_TS)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return pa.array(
            [
                _timestamp(t, f"commit {cid}")
                for t, cid in zip(created.to_pylist(), ids.to_pylist(), strict=True)
            ],
            _TS,
        )


def _sums(at: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Per ``k < n``, the sum of ``values`` where ``at == k`` (``at`` sorted)."""
    out = np.zeros(n, np.int64)
    if at.size:
        starts = np.flatnonzero(np.concatenate([[True], at[1:] != at[:-1]]))
        out[at[starts]] = np.add.reduceat(values, starts)
    return out


def arrow_filesystem(store: Store) -> pafs.FileSystem:
    """The Arrow filesystem that reads ``store``'s paths (fsspec-backed for a remote root)."""
    if store.is_local:
        return pafs.LocalFileSystem()
    return pafs.PyFileSystem(pafs.FSSpecHandler(store.fs))


def _placed(store: Store, paths: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, pa.Table]:
    """Per path, its row in :func:`ledger.compaction.piece_table` (-1: not compacted),
    and that table."""
    table = piece_table(store)
    if not table.num_rows:
        return np.full(len(paths), -1, np.int64), table
    at = pc.index_in(paths, value_set=table["path"]).fill_null(-1)
    return np.asarray(at.to_numpy(), np.int64), table


def _events_dataset(
    store: Store, segments: pa.Table, placed: tuple[np.ndarray, pa.Table] | None = None
) -> ds.Dataset:
    """One Arrow dataset over ``segments`` (rows of the ``segments`` view), with commit_id
    and step columns.

    A segment's ``commit_id`` and ``step`` are given as its fragment's partition
    expression, which Arrow materialises as columns and uses to skip files on a filter
    over them. A segment retired by a compaction is read from the compacted file, whose
    rows carry the two columns: the whole file when every segment it holds is wanted,
    else just the row groups of the wanted ones. The compacted segments are found with
    Arrow (no object per segment): a compacted history of 10^4 commits costs a few
    vectorised passes. ``placed``: :func:`_placed` of the segments' paths, if known.
    """
    at, table = placed if placed is not None else _placed(store, segments["path"])
    fmt = ds.ParquetFileFormat(
        read_options=ds.ParquetReadOptions(dictionary_columns=["kind", "commit_id"])
    )
    fs = arrow_filesystem(store)
    fragments: list[ds.Fragment] = []
    own = np.flatnonzero(at < 0)
    mine = segments.take(pa.array(own, pa.int64())).select(["commit_id", "step", "path"])
    for cid, step, path in zip(*(mine[k].to_pylist() for k in mine.column_names), strict=True):
        where = (ds.field("commit_id") == cid) & (ds.field("step") == step)
        fragments.append(fmt.make_fragment(store.full(path), fs, partition_expression=where))
    wanted = at[at >= 0]
    partial: list[pa.Table] = []
    if wanted.size:
        files = table["file"].combine_chunks().dictionary_encode()
        codes = files.indices.to_numpy()
        held = np.bincount(codes, minlength=len(files.dictionary))
        # The compacted files in the order their first wanted segment comes.
        by_file = codes[wanted]
        _, first = np.unique(by_file, return_index=True)
        for code in by_file[np.sort(first)].tolist():
            rows = wanted[by_file == code]
            path = files.dictionary[code].as_py()
            whole = fmt.make_fragment(store.full(path), fs)
            if len(rows) == held[code]:
                fragments.append(whole)
                continue
            parts = table.take(pa.array(rows, pa.int64()))
            if parts["first_row"][0].as_py() < 0:  # the old layout: a piece per row groups
                whole.ensure_complete_metadata()
                fragments.extend(
                    whole.subset(row_group_ids=list(range(g, g + n)))
                    for g, n in zip(
                        parts["first_group"].to_pylist(), parts["groups"].to_pylist(), strict=True
                    )
                )
            else:  # pieces share row groups: read the wanted rows now (a head before the end)
                partial.append(_rows_of(whole, parts))
    files_ds = ds.FileSystemDataset(fragments, EVENTS_SCHEMA, fmt, fs)
    if not partial:
        return files_ds
    return ds.dataset([files_ds, ds.InMemoryDataset(pa.concat_tables(partial))])


def _rows_of(whole: ds.ParquetFileFragment, parts: pa.Table) -> pa.Table:
    """The rows of the pieces ``parts`` (rows of :func:`ledger.compaction.piece_table`)
    of one compacted file (new layout), in order."""
    meta = whole.metadata
    bounds = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    first_group = parts["first_group"].to_pylist()
    groups_n = parts["groups"].to_pylist()
    spans = zip(first_group, groups_n, strict=True)
    groups = sorted({g for f, n in spans for g in range(f, f + n)})
    read = whole.subset(row_group_ids=groups).to_table(schema=EVENTS_SCHEMA)
    # Row k of the file is row offset[k] of what was read (only the groups read count).
    before = {g: int(sum(bounds[h + 1] - bounds[h] for h in groups if h < g)) for g in groups}
    taken = [
        read.slice(before[g] + first_row - int(bounds[g]), rows)
        for g, first_row, rows in zip(
            first_group, parts["first_row"].to_pylist(), parts["rows"].to_pylist(), strict=True
        )
    ]
    return pa.concat_tables(taken)


def _check_segments_exist(
    store: Store, segments: pa.Table, placed: tuple[np.ndarray, pa.Table] | None = None
) -> None:
    """Raise LogCorrupted if a segment named by a marker (a row of ``segments``) is
    missing (one listing per folder); a compacted segment must have its compacted file.
    ``placed``: :func:`_placed` of the segments' paths, if known."""
    at, table = placed if placed is not None else _placed(store, segments["path"])
    missing = np.zeros(len(at), np.bool_)
    listed: dict[str, set[str]] = {}

    def absent(path: str) -> bool:
        folder, _, name = path.rpartition("/")
        if folder not in listed:
            listed[folder] = set(store.ls(folder, files=True))
        return name not in listed[folder]

    own = np.flatnonzero(at < 0)
    for k, rel in zip(own.tolist(), segments["path"].take(pa.array(own)).to_pylist(), strict=True):
        missing[k] = absent(rel)
    held_at = np.flatnonzero(at >= 0)
    if held_at.size:
        files = table["file"].combine_chunks().dictionary_encode()
        gone = np.array([absent(f) for f in files.dictionary.to_pylist()], np.bool_)
        missing[held_at] = gone[files.indices.to_numpy()[at[held_at]]]
    if missing.any():
        k = int(np.flatnonzero(missing)[0])
        rel = segments["path"][k].as_py()
        cid = segments["commit_id"][k].as_py()
        path = table["file"][int(at[k])].as_py() if at[k] >= 0 else rel
        held = f" (holding segment {rel})" if at[k] >= 0 else ""
        raise LogCorrupted(
            f"{'file' if at[k] >= 0 else 'segment'} {store.full(path)}{held} named by commit "
            f"{cid} is missing: the log lost a committed file; restore it from a backup"
        )


def _timestamp(value: Any, where: str) -> datetime | None:
    """An ISO 8601 string as a naive UTC datetime (naive input is taken as UTC)."""
    if value is None:
        return None
    try:
        t = datetime.fromisoformat(str(value))
    except ValueError as e:
        raise LogCorrupted(f"{where}: created_at {value!r} is not an ISO 8601 time") from e
    return t.astimezone(timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def _table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def _commits_table(commits: list[Commit], chain: set[str], head: str | None) -> pa.Table:
    rows = []
    for c in commits:
        rank0 = next((s for s in c.states if s.rank == 0), None)
        rows.append(
            {
                "commit_id": c.id,
                "step": c.step,
                "attempt": c.attempt,
                "parent": c.parent,
                "world_size": c.world_size,
                "created_at": _timestamp(c.created_at, f"commit {c.id}"),
                "segments": len(c.segments),
                "rows": sum(s.rows for s in c.segments),
                "bytes": sum(s.bytes for s in c.segments),
                "epoch": rank0.epoch if rank0 else None,
                "epoch_batch": rank0.epoch_batch if rank0 else None,
                "batch": rank0.batch if rank0 else None,
                "in_lineage": c.id in chain,
                "is_head": c.id == head,
            }
        )
    return _table(rows, _COMMITS_SCHEMA)


def _states_table(commits: list[Commit]) -> pa.Table:
    rows = [
        {
            "commit_id": c.id,
            "step": c.step,
            "attempt": c.attempt,
            "rank": s.rank,
            "epoch": s.epoch,
            "epoch_batch": s.epoch_batch,
            "batch": s.batch,
        }
        for c in commits
        for s in c.states
    ]
    return _table(rows, _STATES_SCHEMA)


def _attempts_table(store: Store) -> pa.Table:
    """Attempt records; files under ``attempts/`` that are not named ``<A>.json`` are
    ignored (a stray file never breaks a command)."""
    rows = []
    for name in store.ls("attempts", files=True):
        if not ATTEMPT_NAME.match(name):
            continue
        try:
            a = read_attempt(store, name)
        except FileNotFoundError:
            continue  # removed since the listing
        when = _timestamp(a["created_at"], store.full(f"attempts/{name}"))
        rows.append({**a, "created_at": when})
    return _table(sorted(rows, key=lambda r: r["attempt"]), _ATTEMPTS_SCHEMA)


def _run_table(run: dict[str, Any]) -> pa.Table:
    config = run.get("config", {})
    row = {
        "run_id": run.get("run_id"),
        "created_at": _timestamp(run.get("created_at"), "run.json"),
        **{key: config.get(key) for key in _RUN_SCHEMA.names[2:]},
    }
    if isinstance(row["seed"], int) and row["seed"] > (1 << 63) - 1:
        row["seed"] -= 1 << 64  # BIGINT: a seed of 2**63 or more shows as its int64 bits
    return _table([row], _RUN_SCHEMA)


_JOURNAL = re.compile(r"^journal/attempt=([0-9]{1,9})/rank=([0-9]{1,9})\.msgpack$")


def _journal_tables(store: Store, states: pa.Table) -> tuple[pa.Table, pa.Table]:
    """The ``uncommitted`` view (journaled ``'sample'``/``'span'`` events that no commit
    of their attempt covers) and the ``journals`` view (per journal: its uncommitted
    batches and the damaged records skipped). Files under ``journal/`` not named
    ``attempt=A/rank=R.msgpack`` are ignored."""
    newest = states.group_by(["attempt", "rank"]).aggregate([("batch", "max")])
    committed: dict[tuple[int, int], int] = {
        (a, r): b
        for a, r, b in zip(
            newest["attempt"].to_pylist(),
            newest["rank"].to_pylist(),
            newest["batch_max"].to_pylist(),
            strict=True,
        )
    }
    journals: dict[tuple[int, int], bytes] = {}
    paths: dict[tuple[int, int], str] = {}
    for rel in store.glob("journal/attempt=*/rank=*.msgpack"):
        match = _JOURNAL.match(rel)
        if match is None:
            continue
        key = (int(match[1]), int(match[2]))
        try:
            journals[key] = store.read_bytes(rel)
        except FileNotFoundError:
            continue  # removed since the listing
        paths[key] = rel
    chunks, unreadable = uncommitted(journals, committed)
    tables = [
        chunks_to_table(found, attempt, rank)
        for (attempt, rank), found in sorted(chunks.items())
        if found
    ]
    events = (
        pa.concat_tables(tables).cast(_PLAIN_EVENT_SCHEMA)
        if tables
        else EVENT_SCHEMA.empty_table().cast(_PLAIN_EVENT_SCHEMA)
    )
    rows = [
        {
            "attempt": key[0],
            "rank": key[1],
            "path": paths[key],
            "uncommitted_batches": len({c.batch for c in chunks[key]}),
            "unreadable": unreadable[key],
        }
        for key in sorted(journals)
    ]
    return events, _table(rows, _JOURNALS_SCHEMA)


_JOURNALS_SCHEMA = pa.schema(
    [
        ("attempt", pa.int32()),
        ("rank", pa.int32()),
        ("path", pa.string()),
        ("uncommitted_batches", pa.int64()),
        ("unreadable", pa.int64()),
    ]
)


# DuckDB reads a dictionary column as VARCHAR anyway; a plain one keeps the view simple.
_PLAIN_EVENT_SCHEMA = pa.schema(
    [
        pa.field("kind", pa.string(), False)
        if f.name == "kind"
        else pa.field("source", pa.string())
        if f.name == "source"
        else f
        for f in EVENT_SCHEMA
    ]
)
