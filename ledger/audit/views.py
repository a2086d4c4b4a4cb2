"""DuckDB views over a log root: the audit's one entry point to the data.

:func:`connect` reads the small JSON files of a log (``run.json``, ``attempts/``,
``commits/``) in Python, resolves the lineage of a head commit from the parent links,
and opens an in-memory DuckDB connection with these views (DuckDB types):

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
dataset_len BIGINT, seed BIGINT, shuffle BOOLEAN, batch_size BIGINT, drop_last BOOLEAN,
world_size INTEGER, "order" VARCHAR.

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

import re
import shutil
import tempfile
import weakref
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
    read_run,
)
from ledger.compaction import Piece, pieces
from ledger.errors import LogCorrupted
from ledger.journal import uncommitted
from ledger.schema import EVENT_SCHEMA, chunks_to_table
from ledger.store import Store

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
_SEGMENTS_SCHEMA = pa.schema(
    [
        ("commit_id", pa.string()),
        ("step", pa.int64()),
        ("attempt", pa.int32()),
        ("rank", pa.int32()),
        ("path", pa.string()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("sha256", pa.string()),
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
    store = Store(root)
    run = read_run(store)
    commits = list_commits(store)
    by_id = {c.id: c for c in commits}
    if head is None:
        newest = default_head(commits)
        head = newest.id if newest is not None else None
    chain = {c.id for c in lineage(store, head, known=by_id)} if head is not None else set()
    tables = _tables(commits)
    _check_segments_exist(store, tables.segments)

    # A private spill directory: the one place DuckDB may write once access is disabled.
    scratch = tempfile.mkdtemp(prefix="ledger-audit-")
    try:
        con = duckdb.connect(":memory:", config={"temp_directory": scratch})
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    weakref.finalize(con, shutil.rmtree, scratch, True)
    in_chain = pc.is_in(tables.segments["commit_id"], pa.array(sorted(chain), pa.string()))
    con.register("events", _events_dataset(store, tables.segments))
    con.register("lineage", _events_dataset(store, tables.segments.filter(in_chain)))
    con.register("commits", _with_lineage(tables.commits, chain, head))
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
    over all their rank rows at once, no Python object per rank or segment; for logs
    holding version-1 markers, commit by commit."""
    if any(c.ranks is None for c in commits):
        return _Tables(_commit_rows(commits), _segments_table(commits), _states_table(commits))
    n = len(commits)
    tables = [c.ranks.rows for c in commits if c.ranks is not None]
    worlds = np.fromiter((t.shape[0] for t in tables), np.int64, n)
    rows = (
        np.concatenate([t[:, :_RANK_HEAD] for t in tables])
        if n
        else np.zeros((0, _RANK_HEAD), np.int64)
    )
    of = np.repeat(np.arange(n), worlds)  # the commit of each rank row
    starts = np.cumsum(worlds) - worlds
    rank = np.arange(len(rows)) - starts[of]
    ids = np.array([c.id for c in commits], dtype=object)
    steps = np.fromiter((c.step for c in commits), np.int64, n)
    attempts = np.fromiter((c.attempt for c in commits), np.int64, n)
    states = pa.table(
        [
            pa.array(ids[of], pa.string()),
            steps[of],
            attempts[of].astype(np.int32),
            rank.astype(np.int32),
            rows[:, 10].astype(np.int32),
            rows[:, 11],
            rows[:, 12],
        ],
        schema=_STATES_SCHEMA,
    )
    wrote = np.flatnonzero(rows[:, 1] == 1)
    at = of[wrote]
    paths = [
        f"events/attempt={a}/rank={r}/seg-{b:012d}.parquet"
        for a, r, b in zip(
            attempts[at].tolist(), rank[wrote].tolist(), rows[wrote, 12].tolist(), strict=True
        )
    ]
    digests = np.ascontiguousarray(rows[wrote, 4:8], dtype="<i8").tobytes().hex()
    segments = pa.table(
        [
            pa.array(ids[at], pa.string()),
            steps[at],
            attempts[at].astype(np.int32),
            rank[wrote].astype(np.int32),
            pa.array(paths, pa.string()),
            rows[wrote, 2],
            rows[wrote, 3],
            pa.array([digests[64 * i : 64 * i + 64] for i in range(len(wrote))], pa.string()),
        ],
        schema=_SEGMENTS_SCHEMA,
    )
    per = {
        "segments": np.bincount(at, minlength=n).astype(np.int32),
        "rows": _sums(at, rows[wrote, 2], n),
        "bytes": _sums(at, rows[wrote, 3], n),
    }
    first = rows[starts] if n else np.zeros((0, _RANK_HEAD), np.int64)
    table = pa.table(
        {
            "commit_id": pa.array(ids, pa.string()),
            "step": steps,
            "attempt": attempts.astype(np.int32),
            "parent": pa.array([c.parent for c in commits], pa.string()),
            "world_size": pa.array([c.world_size for c in commits], pa.int32()),
            "created_at": _timestamps(commits),
            **per,
            "epoch": first[:, 10].astype(np.int32),
            "epoch_batch": first[:, 11],
            "batch": first[:, 12],
        }
    )
    return _Tables(table.cast(_COMMITS_SCHEMA.remove(13).remove(12)), segments, states)


_RANK_HEAD = 26
"""Leading columns of a rank table row that hold the state and segment (ledger.ranks)."""


def _commit_rows(commits: list[Commit]) -> pa.Table:
    full = _commits_table(commits, set(), None)
    return full.drop_columns(["in_lineage", "is_head"])


def _with_lineage(table: pa.Table, chain: set[str], head: str | None) -> pa.Table:
    ids = table["commit_id"]
    lineage = pc.is_in(ids, pa.array(sorted(chain), pa.string()))
    is_head = pc.equal(ids, pa.scalar(head, pa.string())) if head is not None else None
    if is_head is None:
        is_head = pa.array([False] * table.num_rows, pa.bool_())
    return table.append_column("in_lineage", lineage).append_column(
        "is_head", pc.fill_null(is_head, False)
    )


def _timestamps(commits: list[Commit]) -> pa.Array:
    """The commits' ``created_at`` as naive UTC timestamps, parsed by Arrow at once when
    every one carries its offset (as ledger writes them), else one by one."""
    try:
        aware = pa.array([c.created_at for c in commits], pa.string()).cast(
            pa.timestamp("us", "UTC")
        )
        return aware.cast(_TS)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return pa.array([_timestamp(c.created_at, f"commit {c.id}") for c in commits], _TS)


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


def _events_dataset(store: Store, segments: pa.Table) -> ds.Dataset:
    """One Arrow dataset over ``segments`` (rows of the ``segments`` view), with commit_id
    and step columns.

    A segment's ``commit_id`` and ``step`` are given as its fragment's partition
    expression, which Arrow materialises as columns and uses to skip files on a filter
    over them. A segment retired by a compaction is read from the compacted file, whose
    rows carry the two columns: the whole file when every segment it holds is wanted,
    else just the row groups of the wanted ones.
    """
    placed = pieces(store)
    fmt = ds.ParquetFileFormat(
        read_options=ds.ParquetReadOptions(dictionary_columns=["kind", "commit_id"])
    )
    fs = arrow_filesystem(store)
    fragments: list[ds.Fragment] = []
    wanted: dict[str, list[Piece]] = {}
    for cid, step, path in zip(
        segments["commit_id"].to_pylist(),
        segments["step"].to_pylist(),
        segments["path"].to_pylist(),
        strict=True,
    ):
        piece = placed.get(path)
        if piece is not None:
            wanted.setdefault(piece.path, []).append(piece)
            continue
        where = (ds.field("commit_id") == cid) & (ds.field("step") == step)
        fragments.append(fmt.make_fragment(store.full(path), fs, partition_expression=where))
    held: dict[str, int] = {}
    for piece in placed.values():
        held[piece.path] = held.get(piece.path, 0) + 1
    partial: list[pa.Table] = []
    for path, parts in wanted.items():
        whole = fmt.make_fragment(store.full(path), fs)
        if len(parts) == held[path]:
            fragments.append(whole)
        elif parts[0].first_row < 0:  # the old layout: each piece is its own row groups
            whole.ensure_complete_metadata()
            fragments.extend(whole.subset(row_group_ids=p.row_groups) for p in parts)
        else:  # pieces share row groups: read the wanted rows now (a head before the end)
            partial.append(_rows_of(whole, parts))
    files = ds.FileSystemDataset(fragments, EVENTS_SCHEMA, fmt, fs)
    if not partial:
        return files
    return ds.dataset([files, ds.InMemoryDataset(pa.concat_tables(partial))])


def _rows_of(whole: ds.ParquetFileFragment, parts: list[Piece]) -> pa.Table:
    """The rows of the pieces ``parts`` of one compacted file (new layout), in order."""
    meta = whole.metadata
    bounds = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    groups = sorted({g for p in parts for g in p.row_groups})
    read = whole.subset(row_group_ids=groups).to_table(schema=EVENTS_SCHEMA)
    # Row k of the file is row offset[k] of what was read (only the groups read count).
    before = {g: int(sum(bounds[h + 1] - bounds[h] for h in groups if h < g)) for g in groups}
    taken = [
        read.slice(before[p.first_group] + p.first_row - int(bounds[p.first_group]), p.rows)
        for p in parts
    ]
    return pa.concat_tables(taken)


def _check_segments_exist(store: Store, segments: pa.Table) -> None:
    """Raise LogCorrupted if a segment named by a marker (a row of ``segments``) is
    missing (one listing per folder); a compacted segment must have its compacted file."""
    placed = pieces(store)
    listed: dict[str, set[str]] = {}
    for cid, rel in zip(
        segments["commit_id"].to_pylist(), segments["path"].to_pylist(), strict=True
    ):
        piece = placed.get(rel)
        path = piece.path if piece is not None else rel
        folder, _, name = path.rpartition("/")
        if folder not in listed:
            listed[folder] = set(store.ls(folder))
        if name not in listed[folder]:
            held = f" (holding segment {rel})" if piece is not None else ""
            raise LogCorrupted(
                f"{'file' if piece else 'segment'} {store.full(path)}{held} named by commit "
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


def _segments_table(commits: list[Commit]) -> pa.Table:
    rows = [
        {
            "commit_id": c.id,
            "step": c.step,
            "attempt": c.attempt,
            "rank": s.rank,
            "path": s.path,
            "rows": s.rows,
            "bytes": s.bytes,
            "sha256": s.sha256,
        }
        for c in commits
        for s in c.segments
    ]
    return _table(rows, _SEGMENTS_SCHEMA)


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
    for name in store.ls("attempts"):
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
