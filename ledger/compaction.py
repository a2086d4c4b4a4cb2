"""Compaction: rewrite many small segments into few large files, changing no answer.

A compaction takes the segments of the lineage of a commit (``before``) and copies them,
in lineage order, into a few files ``events/compacted/<id>/part-<k>.parquet``: each
original segment becomes its own row groups (a *piece*), with two extra columns,
``commit_id`` and ``step``, saying which commit's marker names it. It then publishes
them through a compaction commit:

    compactions/<id>.pieces.parquet   one row per piece (:data:`PIECES_SCHEMA`)
    compactions/<id>.json             the compaction marker (created exclusively): its
                                      files with sizes and SHA-256, and the pieces table's

and only then retires (deletes) the original segments. Markers are never rewritten:
they go on naming the original paths, and every reader resolves a path through the
compactions (:func:`pieces`), so ``replay``, the views, ``where``, ``show``,
``reconstruct``, ``verify`` and ``report`` answer exactly as before.

A kill at any point leaves a valid log: before the marker, the new files are unnamed
(no reader looks at them) and the originals untouched; after it, readers use the new
files and the originals still present are ignored, and running ``ledger compact`` again
finishes retiring them. Training may run meanwhile: it only appends, and compaction
never touches the newest segment of any rank at the default head or at ``before`` (what
resuming there reads), nor any segment off the lineage of ``before``.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from ledger import segments, validate
from ledger.commits import (
    Commit,
    command_cache,
    commit_from_rows,
    default_head,
    lineage,
    list_commits,
    newest_segments,
    no_cycles,
    now_iso,
    parsing_once,
    read_run,
)
from ledger.errors import CommitConflict, CommitNotFound, LogCorrupted
from ledger.history import HEAD
from ledger.manifest import manifest_path
from ledger.ranks import ENCODING_V1, HEADS, SegmentRef
from ledger.schema import EVENT_SCHEMA, SCHEMA_VERSION
from ledger.store import Store, sha256

PIECES_SCHEMA = pa.schema(
    [
        pa.field("path", pa.string(), nullable=False),
        pa.field("sha256", pa.string(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("commit_id", pa.string(), nullable=False),
        pa.field("file", pa.int32(), nullable=False),
        pa.field("first_group", pa.int32(), nullable=False),
        pa.field("groups", pa.int32(), nullable=False),
        pa.field("first_row", pa.int64(), nullable=False),
    ]
)
"""Columns of ``compactions/<id>.pieces.parquet``: the original segment's ``path``,
``sha256`` and ``rows`` (as its marker names them), the ``commit_id`` whose marker names
it, and where its rows now are: rows ``[first_row, first_row + rows)`` of file number
``file`` of the compaction, in its row groups ``[first_group, first_group + groups)``.
Compactions written before ``first_row`` existed gave each piece row groups of its own
(``first_row`` reads as -1)."""

TARGET_ROWS = 1 << 22
"""Events per compacted file (about 4 M; a file closes at the first segment past it)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Where the rows of one original segment are after a compaction.

    Attributes:
        path: the compacted file, relative to the root.
        first_group: its first row group holding the segment's rows.
        groups: how many row groups hold them.
        rows: the segment's rows.
        sha256: the original segment's SHA-256 (as its marker names it).
        commit_id: the commit whose marker names the segment.
        first_row: its first row in the file (-1: a compaction of the old layout, where
            the piece is exactly its row groups).
    """

    path: str
    first_group: int
    groups: int
    rows: int
    sha256: str
    commit_id: str
    first_row: int = -1

    @property
    def row_groups(self) -> list[int]:
        return list(range(self.first_group, self.first_group + self.groups))

    def rows_of(self, read: pa.Table, start: int) -> pa.Table:
        """The piece's rows out of its row groups read as one table (``read``), whose
        first row is row ``start`` of the file; all of ``read`` for the old layout."""
        return read if self.first_row < 0 else read.slice(self.first_row - start, self.rows)


@dataclass(frozen=True, slots=True)
class CompactedFile:
    """A file a compaction wrote: path relative to the root, events, bytes, SHA-256."""

    path: str
    rows: int
    bytes: int
    sha256: str


def _compacted_file(f: Any, where: str) -> CompactedFile:
    """A ``files`` entry of a compaction marker, each field checked (LogCorrupted)."""
    f = validate.obj(f, where)
    return CompactedFile(
        validate.relative_path(f, "path", where),
        validate.require(f, "rows", int, where, minimum=0),
        validate.require(f, "bytes", int, where, minimum=0),
        validate.sha256_hex(f, "sha256", where),
    )


@dataclass(frozen=True, slots=True)
class Compaction:
    """A compaction marker and its pieces.

    Attributes:
        id: the compaction's id (the id of its ``before`` commit).
        before: the commit whose lineage it compacted.
        created_at: ISO 8601 UTC time.
        files: the files it wrote.
        placed: one row per piece (:data:`PLACED_SCHEMA`): where each original segment's
            rows are; :func:`pieces` gives them as :class:`Piece` objects.
        catalog: ``{"path", "bytes", "sha256"}`` of its catalog of commit markers
            (:data:`CATALOG_SCHEMA`), ``None`` for a compaction written before catalogs.
    """

    id: str
    before: str
    created_at: str
    files: tuple[CompactedFile, ...]
    placed: pa.Table
    catalog: dict[str, Any] | None = None


PLACED_SCHEMA = pa.schema(
    [
        pa.field("path", pa.string(), nullable=False),
        pa.field("file", pa.string(), nullable=False),
        pa.field("first_group", pa.int64(), nullable=False),
        pa.field("groups", pa.int64(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("sha256", pa.string(), nullable=False),
        pa.field("commit_id", pa.string(), nullable=False),
        pa.field("first_row", pa.int64(), nullable=False),
    ]
)
"""The pieces of compactions as columns, one row per original segment: its ``path``, the
compacted ``file`` (relative to the root) holding its rows and the other fields of
:class:`Piece` (what :func:`piece_table` gives the audit, with no object per piece)."""


# ------------------------------------------------------------------ reading


def table_bytes(table: pa.Table) -> bytes:
    """A compaction's catalog as written: an Arrow IPC file, its buffers LZ4-compressed.
    Every command on a compacted history reads it whole (10^4 rows at 10^4 commits), and
    IPC decodes it with no per-value work: 2.8 CPU ms, read and hashed, against 6.5 for
    the zstd Parquet written before (:func:`read_table` reads both). Only ledger reads a
    catalog; the pieces table, which the README's recipe for other engines joins, stays
    Parquet."""
    sink = pa.BufferOutputStream()
    options = ipc.IpcWriteOptions(compression="lz4")
    with ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def read_table(blob: bytes, columns: list[str] | None = None) -> pa.Table:
    """The table of ``blob``: an Arrow IPC file (:func:`table_bytes`) or a Parquet file (a
    pieces table, or a catalog written before); only ``columns`` (those of them it holds;
    ``None``: all), on this thread.

    Raises:
        pyarrow.ArrowException: if ``blob`` is neither, or damaged.
    """
    source = pa.BufferReader(blob)
    if blob[:6] != b"ARROW1":
        pf = pq.ParquetFile(source)
        present = pf.schema_arrow.names
        wanted = present if columns is None else [n for n in columns if n in present]
        return pf.read(columns=wanted, use_threads=False)
    names = ipc.open_file(source).schema.names
    wanted = names if columns is None else [n for n in columns if n in names]
    options = ipc.IpcReadOptions(
        use_threads=False, included_fields=[names.index(n) for n in wanted]
    )
    return ipc.open_file(pa.BufferReader(blob), options=options).read_all()


def compaction_path(cid: str) -> str:
    """Path of a compaction marker, relative to the root."""
    return f"compactions/{cid}.json"


def read_compaction(store: Store, cid: str) -> Compaction:
    """Read a compaction marker and its pieces table.

    Raises:
        LogCorrupted: if a field is missing, or the pieces table is missing, altered
            (SHA-256) or malformed.
    """
    rel = compaction_path(cid)
    try:
        name = store.full(rel)
        data = validate.obj(json.loads(store.read_bytes(rel)), name)
        files = tuple(
            _compacted_file(f, f"{name}: files[{i}]")
            for i, f in enumerate(validate.items(data, "files", name))
        )
        ref = validate.obj(validate.require(data, "pieces", dict, name), f"{name}: pieces")
        ref = {
            "path": validate.relative_path(ref, "path", f"{name}: pieces"),
            "sha256": validate.sha256_hex(ref, "sha256", f"{name}: pieces"),
        }
        blob = store.read_bytes(ref["path"])
        before = validate.require(data, "before", str, name)
        created = validate.require(data, "created_at", str, name)
        catalog = validate.require(data, "catalog", dict, name, default=None, nullable=True)
        if catalog is not None:
            where = f"{name}: catalog"
            catalog = {
                "path": validate.relative_path(catalog, "path", where),
                "sha256": validate.sha256_hex(catalog, "sha256", where),
            }
    except FileNotFoundError as e:
        raise LogCorrupted(f"{store.full(rel)} names a missing file: {e}") from e
    except (ValueError, KeyError, TypeError) as e:
        raise LogCorrupted(f"{store.full(rel)} lacks or mangles a field: {e!r}") from e
    if sha256(blob) != ref["sha256"]:
        raise LogCorrupted(f"{store.full(ref['path'])} differs from the SHA-256 {rel} names")
    try:
        read = read_table(blob)
        if "first_row" not in read.column_names:  # the old layout: a piece per row group
            read = read.append_column("first_row", pa.array([-1] * read.num_rows, pa.int64()))
        table = read.select(PIECES_SCHEMA.names).cast(PIECES_SCHEMA)
    except (pa.ArrowException, ValueError, KeyError) as e:
        raise LogCorrupted(f"{store.full(ref['path'])} is not a pieces table: {e}") from e
    number = table["file"].to_numpy()
    if number.size and (number.min() < 0 or number.max() >= len(files)):
        raise LogCorrupted(f"{store.full(ref['path'])} names a file {rel} does not list")
    names = pa.array([f.path for f in files], pa.string())
    placed = pa.table(
        [
            table["path"],
            names.take(pa.array(number, pa.int64())),
            *(table[k].cast(pa.int64()) for k in ("first_group", "groups", "rows")),
            table["sha256"],
            table["commit_id"],
            table["first_row"],
        ],
        schema=PLACED_SCHEMA,
    )
    return Compaction(cid, before, created, files, placed, catalog)


def list_compactions(store: Store) -> list[Compaction]:
    """Every compaction marker under the root, oldest first. Read once per command
    inside :func:`ledger.commits.parse_once`."""
    cache = command_cache()
    key = ("compactions", store.uri)
    if cache is not None and key in cache:
        return list(cache[key])
    names = [n for n in store.ls("compactions", files=True) if n.endswith(".json")]
    found = [read_compaction(store, n[: -len(".json")]) for n in names]
    found.sort(key=lambda c: (c.created_at, c.id))
    if cache is not None:
        cache[key] = tuple(found)
    return found


SKIP_TYPE = pa.struct(
    [
        pa.field("start", pa.int64(), nullable=False),
        pa.field("stop", pa.int64(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
    ]
)
"""One planned skip of a catalogued commit: batches ``[start, stop)`` and the reason."""

CATALOG_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("attempt", pa.int64(), nullable=False),
        pa.field("parent", pa.string()),
        pa.field("world_size", pa.int64(), nullable=False),
        pa.field("created_at", pa.string(), nullable=False),
        pa.field("width", pa.int64(), nullable=False),
        pa.field("ranks", pa.large_list(pa.int64()), nullable=False),
        pa.field("manifest_sha256", pa.string()),
        pa.field("lineage", pa.list_(pa.int64())),
        pa.field("skips", pa.list_(SKIP_TYPE)),
        pa.field("head", pa.int64()),
    ]
)
"""Columns of ``compactions/<id>.commits.arrow``, the catalog of a compaction: one row
per version-2 commit marker present when it ran (all branches), with the marker's
header, its rank table (``world_size x width`` integers, row-major, the layout of
:mod:`ledger.ranks`), the SHA-256 of its manifest, its lineage ranges (flattened
triples), null when the marker names none, and its planned skips
(:attr:`ledger.commits.Commit.planned_skips`), null when it names none (a catalog
written before this column reads as naming none), and the leading columns of its rank
table's layout (:data:`ledger.ranks.HEADS`; null, or a catalog written before this
column: layout version 1). Markers never change once written, so a
command reads the catalog (one file) instead of one marker and one rank table per commit:
an audit of a compacted history of 10^4 commits reads 3 files, not 2·10^4."""


CATALOG_FILE_SCHEMA = CATALOG_SCHEMA.set(
    CATALOG_SCHEMA.get_field_index("ranks"), pa.field("ranks", pa.large_binary(), nullable=False)
)
"""The catalog as written: :data:`CATALOG_SCHEMA` with each commit's rank table as its
bytes (``world_size x width`` little-endian ``int64``, row-major), which Parquet decodes
about 5x faster than a list of integers. Catalogs written before hold the lists; both
read the same."""


def catalogued(store: Store) -> dict[str, Commit]:
    """The commits the compactions' catalogs hold, by id (empty when none). Read once
    per command inside :func:`ledger.commits.parse_once`.

    Raises:
        LogCorrupted: if a catalog is missing, differs from the SHA-256 its compaction
            names, or is malformed.
    """
    cache = command_cache()
    key = ("catalog", store.uri)
    if cache is not None and key in cache:
        return dict(cache[key])
    out: dict[str, Commit] = {}
    for comp in list_compactions(store):
        if comp.catalog is not None:
            out.update(_read_catalog(store, comp.catalog["path"], comp.catalog["sha256"]))
    if cache is not None:
        cache[key] = dict(out)
    return out


HISTORY_COLUMNS = ("id", "step", "attempt", "parent", "world_size", "created_at", "width", "ranks")
"""The catalog's columns that :func:`ledger.history.read_history` reads."""


def catalog_tables(store: Store, columns: tuple[str, ...] | None = None) -> list[pa.Table]:
    """The catalogs of the root's compactions as checked Arrow tables
    (:data:`CATALOG_SCHEMA`), newest compaction first (a commit is looked up in the first
    that holds it). Read once per command inside :func:`ledger.commits.parse_once`.

    Args:
        store: the log root.
        columns: only these columns (which must include those of :data:`HISTORY_COLUMNS`),
            each checked; ``None``: all of them. The SHA-256 is checked either way.

    Raises:
        LogCorrupted: as :func:`catalogued`.
    """
    cache = command_cache()
    key = ("catalog_tables", store.uri, columns)
    if cache is not None and key in cache:
        return list(cache[key])
    out = [
        _catalog_table(store, comp.catalog["path"], comp.catalog["sha256"], columns)
        for comp in reversed(list_compactions(store))
        if comp.catalog is not None
    ]
    if cache is not None:
        cache[key] = tuple(out)
    return out


def _catalog_table(
    store: Store, rel: str, digest: str, columns: tuple[str, ...] | None = None
) -> pa.Table:
    """A catalog's ``columns`` (``None``: all), checked: the SHA-256 its compaction names,
    each rank table's size (``world_size x width``, at least the leading columns of a
    rank row), lineage ranges in triples and planned skips with ``0 <= start < stop``
    (those of them that are read).

    Raises:
        LogCorrupted: naming the catalog and the commit, if a check fails.
    """
    where = store.full(rel)
    try:
        blob = store.read_bytes(rel)
    except FileNotFoundError as e:
        raise LogCorrupted(f"{where}, the catalog of a compaction, is missing") from e
    if sha256(blob) != digest:
        raise LogCorrupted(f"{where} differs from the SHA-256 its compaction names")
    names = CATALOG_SCHEMA.names if columns is None else list(columns)
    schema = pa.schema([CATALOG_SCHEMA.field(n) for n in names])
    try:
        read = read_table(blob, names)
        # A catalog written before skips were catalogued lacks them.
        if "skips" in names and "skips" not in read.column_names:
            read = read.append_column("skips", pa.nulls(read.num_rows, pa.list_(SKIP_TYPE)))
        if "head" in names and "head" not in read.column_names:  # before layout version 2
            read = read.append_column("head", pa.nulls(read.num_rows, pa.int64()))
        read = _ranks_as_lists(read)
        table = read.select(names).cast(schema).combine_chunks()
        offsets = table["ranks"].combine_chunks().offsets.to_numpy()
    except (pa.ArrowException, ValueError, KeyError) as e:
        raise LogCorrupted(f"{where} is not a catalog of commits: {e}") from e
    world = table["world_size"].to_numpy()
    width = table["width"].to_numpy()
    if not np.array_equal(np.diff(offsets), world * width) or np.any(width < HEAD):
        raise LogCorrupted(f"{where}: a commit has a rank table of another shape")
    if "lineage" in names:
        _check_lineage(where, table)
    if "skips" in names:
        _check_skips(where, table)
    return table


def _check_lineage(where: str, table: pa.Table) -> None:
    try:
        lineage = table["lineage"].combine_chunks()
        bounds = lineage.offsets.to_numpy().astype(np.int64)
        has_lineage = lineage.is_valid().to_numpy(zero_copy_only=False)
    except (pa.ArrowException, ValueError, KeyError) as e:
        raise LogCorrupted(f"{where} is not a catalog of commits: {e}") from e
    odd = np.flatnonzero((np.diff(bounds) % 3 != 0) & has_lineage)
    if odd.size:
        k = int(odd[0])
        raise LogCorrupted(
            f"{where}: commit {table['id'][k].as_py()} has lineage ranges of "
            f"{bounds[k + 1] - bounds[k]} values"
        )


def _check_skips(where: str, table: pa.Table) -> None:
    try:
        skips = table["skips"].combine_chunks()
        start = pc.struct_field(skips.values, "start").to_numpy()
        stop = pc.struct_field(skips.values, "stop").to_numpy()
        skip_of = np.repeat(np.arange(len(skips)), np.diff(skips.offsets.to_numpy()))
    except (pa.ArrowException, ValueError, KeyError) as e:
        raise LogCorrupted(f"{where} is not a catalog of commits: {e}") from e
    wrong = np.flatnonzero((start < 0) | (start >= stop))
    if wrong.size:
        k = int(skip_of[wrong[0]])
        _skips(where, table["id"][k].as_py(), table["skips"][k].as_py())  # raises


def _ranks_as_lists(read: pa.Table) -> pa.Table:
    """``read`` with its ``ranks`` column as lists of integers: as they are on disk in a
    catalog written before they were stored as bytes, or, from their bytes (row-major
    little-endian ``int64``, :data:`CATALOG_FILE_SCHEMA`), without a copy.

    Raises:
        ValueError: if a commit's bytes are null or not whole integers.
    """
    at = read.schema.get_field_index("ranks")
    if at < 0 or not pa.types.is_large_binary(read.schema.field(at).type):
        return read
    raw = read.column(at).combine_chunks()
    offsets = np.frombuffer(raw.buffers()[1], np.int64)[raw.offset : raw.offset + len(raw) + 1]
    if raw.null_count or np.any(offsets % 8):
        raise ValueError("a commit's rank table is null or not whole 64-bit integers")
    first = int(offsets[0]) // 8
    values = pa.Array.from_buffers(
        pa.int64(), int(offsets[-1]) // 8 - first, [None, raw.buffers()[2]], offset=first
    )
    lists = pa.LargeListArray.from_arrays(pa.array(offsets // 8 - first, pa.int64()), values)
    return read.set_column(at, pa.field("ranks", lists.type, nullable=False), lists)


def _read_catalog(store: Store, rel: str, digest: str) -> dict[str, Commit]:
    where = store.full(rel)
    table = _catalog_table(store, rel, digest)
    try:
        ranks = table["ranks"].combine_chunks()
        values = ranks.values.to_numpy()
        offsets = ranks.offsets.to_numpy()
        lineage = table["lineage"].combine_chunks()
        # Flattened ranges and their offsets (null: the marker names no lineage).
        flat = lineage.values.to_numpy(zero_copy_only=False).tolist()
        starts = lineage.offsets.to_numpy().tolist()
        has_lineage = lineage.is_valid().to_numpy(zero_copy_only=False).tolist()
        cols = {
            name: table[name].to_pylist()
            for name in CATALOG_SCHEMA.names
            if name not in ("ranks", "lineage", "skips")
        }
        cols["head"] = [HEADS[ENCODING_V1] if h is None else h for h in cols["head"]]
        cols["skips"] = table["skips"].to_pylist()
    except (pa.ArrowException, ValueError, KeyError) as e:
        raise LogCorrupted(f"{where} is not a catalog of commits: {e}") from e
    # One loop of plain values per commit (10^4 commits of a long history): no Arrow or
    # dict access inside it.
    with no_cycles():
        return _catalog_commits(where, cols, offsets, values, flat, starts, has_lineage)


def _catalog_commits(
    where: str,
    cols: dict[str, list[Any]],
    offsets: np.ndarray,
    values: np.ndarray,
    flat: list[int],
    starts: list[int],
    has_lineage: list[bool],
) -> dict[str, Commit]:
    n = len(cols["id"])
    # Each commit's rank table as a view of ``values``: one reshape when every commit has
    # the same shape (a run of one world size), else a slice each.
    shapes = set(zip(cols["world_size"], cols["width"], strict=True))
    if len(shapes) == 1:
        ((world, width),) = shapes
        tables = list(values.reshape(n, world, width))
    else:
        tables = [
            values[lo:hi].reshape(world, width)
            for lo, hi, world, width in zip(
                offsets[:-1].tolist(),
                offsets[1:].tolist(),
                cols["world_size"],
                cols["width"],
                strict=True,
            )
        ]
    # The lineage ranges as triples, once; a commit's are a slice of them.
    bounds = np.asarray(starts, np.int64)
    odd = np.flatnonzero((np.diff(bounds) % 3 != 0) & np.asarray(has_lineage, bool))
    if odd.size:
        k = int(odd[0])
        raise LogCorrupted(
            f"{where}: commit {cols['id'][k]} has lineage ranges of "
            f"{starts[k + 1] - starts[k]} values"
        )
    aligned = not np.any(np.diff(bounds) % 3)  # null rows of no values, as written
    triples = list(zip(flat[0::3], flat[1::3], flat[2::3], strict=True)) if aligned else []
    out = {}
    for k, (cid, step, attempt, parent, world, created, rows, digest, skips, head) in enumerate(
        zip(
            cols["id"],
            cols["step"],
            cols["attempt"],
            cols["parent"],
            cols["world_size"],
            cols["created_at"],
            tables,
            cols["manifest_sha256"],
            cols["skips"],
            cols["head"],
            strict=True,
        )
    ):
        extra: dict[str, Any] = {}
        if skips:
            extra["skips"] = _skips(where, cid, skips)
        if digest is not None:
            extra["manifest"] = (manifest_path(cid), digest)
        if has_lineage[k] and aligned:
            extra["lineage"] = tuple(triples[starts[k] // 3 : starts[k + 1] // 3])
        elif has_lineage[k]:
            r = flat[starts[k] : starts[k + 1]]
            extra["lineage"] = tuple(zip(r[0::3], r[1::3], r[2::3], strict=True))
        if head not in HEADS.values() or rows.shape[1] < head:
            raise LogCorrupted(f"{where}: commit {cid} has a rank table of an unknown layout")
        out[cid] = commit_from_rows(cid, step, attempt, parent, world, created, rows, extra, head)
    return out


def _skips(where: str, cid: str, skips: list[dict[str, Any]]) -> tuple[tuple[int, int, str], ...]:
    """A catalogued commit's planned skips, checked as its marker's are."""
    out = tuple((s["start"], s["stop"], s["reason"]) for s in skips)
    if not all(0 <= start < stop for start, stop, _ in out):
        raise LogCorrupted(f"{where}: commit {cid} plans skips {out!r}, not 0 <= start < stop")
    return out


def _catalog(commits: list[Commit]) -> bytes:
    """The catalog (Parquet bytes) of the version-2 commits among ``commits``."""
    kept = [c for c in commits if c.ranks is not None and c.version == 2]
    rows = [c.ranks.rows for c in kept if c.ranks is not None]
    sizes = np.array([r.size for r in rows], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    values = np.concatenate([r.ravel() for r in rows]) if rows else np.zeros(0, np.int64)
    table = pa.table(
        {
            "id": [c.id for c in kept],
            "step": [c.step for c in kept],
            "attempt": [c.attempt for c in kept],
            "parent": [c.parent for c in kept],
            "world_size": [c.world_size for c in kept],
            "created_at": [c.created_at for c in kept],
            "width": [r.shape[1] for r in rows],
            "ranks": pa.LargeBinaryArray.from_buffers(
                pa.large_binary(),
                len(rows),
                [None, pa.py_buffer(offsets * 8), pa.py_buffer(values.astype("<i8").tobytes())],
            ),
            "manifest_sha256": [c.manifest[1] if c.manifest else None for c in kept],
            "lineage": [
                [x for r in c.lineage_ranges for x in r] if c.lineage_ranges else None for c in kept
            ],
            "skips": [
                [{"start": a, "stop": b, "reason": why} for a, b, why in c.planned_skips]
                if c.planned_skips
                else None
                for c in kept
            ],
            "head": [c.ranks.head for c in kept if c.ranks is not None],
        },
        schema=CATALOG_FILE_SCHEMA,
    )
    return table_bytes(table)


def pieces(store: Store) -> dict[str, Piece]:
    """Original segment path -> its piece, over every compaction of the root (empty when
    none). Read once per command inside :func:`ledger.commits.parse_once`."""
    cache = command_cache()
    key = ("pieces", store.uri)
    if cache is not None and key in cache:
        return cache[key]
    table = piece_table(store)
    rows = list(zip(*(table[k].to_pylist() for k in PLACED_SCHEMA.names), strict=True))
    with no_cycles():
        # Oldest compaction first, so that a newer one's piece of a path wins.
        out = {
            path: Piece(file, first_group, groups, n, digest, commit, first_row)
            for path, file, first_group, groups, n, digest, commit, first_row in reversed(rows)
        }
    if cache is not None:
        cache[key] = out
    return out


def piece_table(store: Store) -> pa.Table:
    """The pieces of every compaction of the root as columns (:data:`PLACED_SCHEMA`),
    newest compaction first (a path is looked up at its first row), with no object per
    piece: what the audit's views and scan use. Read once per command inside
    :func:`ledger.commits.parse_once`."""
    cache = command_cache()
    key = ("piece_table", store.uri)
    if cache is not None and key in cache:
        return cache[key]
    found = [c.placed for c in reversed(list_compactions(store))]
    out = pa.concat_tables(found).combine_chunks() if found else PLACED_SCHEMA.empty_table()
    if cache is not None:
        cache[key] = out
    return out


def piece_events(
    store: Store, piece: Piece, rel: str, rows: int | None, checksum: str | None
) -> pa.Table:
    """The rows of a compacted segment with exactly the columns of :data:`EVENT_SCHEMA`,
    checked against its marker's row count and SHA-256. Inside
    :func:`ledger.commits.parse_once` (one command, one thread) the compacted file is
    read once for all its pieces, and the row groups last decoded (with the event
    columns' types) are kept, so a command that reads the pieces of a file in a row
    decodes and casts each group once.

    Raises:
        LogCorrupted: if the compacted file is missing, differs from the size and SHA-256
            its compaction names, or holds other rows.
    """
    cache = command_cache()
    key = ("compacted", store.uri, piece.path)
    whole = cache.get(key) if cache is not None else None
    if whole is None:
        try:
            data = store.read_bytes(piece.path)
        except FileNotFoundError as e:
            raise LogCorrupted(
                f"{store.full(piece.path)}, which holds segment {rel} since a compaction, "
                "is missing"
            ) from e
        # Checked as the scan checks it (``ledger where``, ``audit``): whole, once per
        # command, so that show and reconstruct never answer from altered bytes.
        named = [f for c in list_compactions(store) for f in c.files if f.path == piece.path]
        if not named or any(len(data) != f.bytes or sha256(data) != f.sha256 for f in named):
            raise LogCorrupted(
                f"compacted file {store.full(piece.path)} differs from the size or SHA-256 "
                "its compaction names: it was altered"
            )
        try:
            whole = pq.ParquetFile(pa.BufferReader(data))
        except (pa.ArrowException, OSError, ValueError) as e:
            raise LogCorrupted(
                f"{store.full(piece.path)} is not a readable Parquet file: {e}"
            ) from e
        if cache is not None:  # one command reads the pieces of a file in a row
            for k in [k for k in cache if k[0] in ("compacted", "compacted groups")]:
                del cache[k]
            cache[key] = whole
    meta = whole.metadata
    start = sum(meta.row_group(g).num_rows for g in range(piece.first_group))
    # Pieces share row groups (64K rows, a segment is ~10^2).
    groups_key = ("compacted groups", store.uri, piece.path)
    held = cache.get(groups_key) if cache is not None else None
    if held is not None and held[0] == piece.row_groups:
        read = held[1]
    else:
        read = _unify(whole.read_row_groups(piece.row_groups))
        if cache is not None:
            cache[groups_key] = (piece.row_groups, read)
    table = piece.rows_of(read, start)
    if (rows is not None and table.num_rows != rows) or table.num_rows != piece.rows:
        raise LogCorrupted(
            f"{store.full(piece.path)} holds {table.num_rows} rows of segment {rel}, "
            f"its marker says {rows}"
        )
    if checksum is not None and piece.sha256 != checksum:
        raise LogCorrupted(
            f"segment {rel} was compacted with SHA-256 {piece.sha256}, its marker says "
            f"{checksum}: the marker or the compaction was altered"
        )
    return table


def _unify(table: pa.Table) -> pa.Table:
    """``table`` with exactly the columns of :data:`EVENT_SCHEMA`: missing ones (a
    segment written before a column was added) as nulls, extra ones dropped."""
    cols = []
    for f in EVENT_SCHEMA:
        if f.name in table.column_names:
            cols.append(table[f.name].cast(f.type))
        else:
            cols.append(pa.nulls(table.num_rows, f.type))
    return pa.table(cols, schema=EVENT_SCHEMA)


# ------------------------------------------------------------------ writing

COMPACTED_SCHEMA = pa.schema(
    [*EVENT_SCHEMA, pa.field("commit_id", pa.string()), pa.field("step", pa.int64())]
)
"""Columns of a compacted file: the event columns, then the commit naming each row."""


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What :func:`compact` did.

    Attributes:
        id: the compaction's id (``""``: nothing to compact).
        segments: segments compacted.
        files: files written.
        rows: events copied.
        retired: original segments deleted (by this run, including those an earlier,
            killed run had compacted but not yet retired).
    """

    id: str
    segments: int
    files: int
    rows: int
    retired: int


Hook = Callable[[str], None]
"""``hook(point)``: called at ``"files"`` (compacted files written), ``"pieces"`` (pieces
table written) and ``"marker"`` (compaction committed), and after each retired segment
(``"retire"``); tests kill the process there."""


@parsing_once
def compact(
    root: str,
    before: str | None = None,
    *,
    target_rows: int = TARGET_ROWS,
    hook: Hook | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CompactionResult:
    """Compact the segments of the lineage of ``before`` into few files.

    Args:
        root: the log root (local or object store).
        before: id of the commit whose lineage is compacted (default: the default
            head). Segments off that lineage, already compacted, or the newest of a rank
            at ``before`` or at the default head are left as they are.
        target_rows: events per compacted file (a file closes past it).
        hook: called at the kill points (tests).
        storage_options: fsspec options of a remote root.

    Returns:
        What was compacted and retired.

    Raises:
        CommitNotFound: if the root holds no run or ``before`` names no commit.
        LogCorrupted: if a segment to compact is missing or differs from its marker
            (nothing is written then).
        CommitConflict: if another compaction of the same ``before`` committed first
            with other contents (run again: it finds nothing left to compact).

    Note:
        A failure before the compaction marker leaves files under
        ``events/compacted/<id>/`` that nothing names (no reader sees them; the next
        run overwrites them); after it, originals not yet deleted, which the next run
        deletes.
    """
    store = Store(root, storage_options)
    read_run(store)
    return _compact(store, before, target_rows, hook or (lambda _: None))


def _compact(store: Store, before: str | None, target_rows: int, hook: Hook) -> CompactionResult:
    commits = list_commits(store)
    known = {c.id: c for c in commits}
    head = default_head(commits)
    if head is None:
        return CompactionResult("", 0, 0, 0, 0)
    if before is not None and before not in known:
        raise CommitNotFound(f"commit {before} does not exist under {store.uri}")
    target = known[before] if before is not None else head
    retired = _retire_leftovers(store, known, hook)
    done = pieces(store)
    keep = {
        ref.path
        for c in (head, target)
        for ref in newest_segments(store, c, max(c.world_size, len(c.states)))
        if ref is not None
    }
    todo: list[tuple[Commit, SegmentRef]] = [
        (c, ref)
        for c in lineage(store, target.id, known=known)
        for ref in sorted(c.segments, key=lambda s: s.rank)
        if ref.rows > 0 and ref.path not in keep and ref.path not in done
    ]
    if len(todo) < 2:
        return CompactionResult("", 0, 0, 0, retired)
    cid = target.id
    if store.exists(compaction_path(cid)):
        cid = f"{target.id}-{len(list_compactions(store))}"
    files, rows = _write_files(store, cid, todo, target_rows)
    hook("files")
    table = pa.table(
        {
            "path": [ref.path for _, ref in todo],
            "sha256": [ref.sha256 for _, ref in todo],
            "rows": [ref.rows for _, ref in todo],
            "commit_id": [c.id for c, _ in todo],
            "file": [r[0] for r in rows],
            "first_group": [r[1] for r in rows],
            "groups": [r[2] for r in rows],
            "first_row": [r[3] for r in rows],
        },
        schema=PIECES_SCHEMA,
    )
    # Parquet, which any engine reads (the README's recipe for Spark, Trino, Athena joins it).
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", use_dictionary=False)  # distinct values
    blob = bytes(sink.getvalue().to_pybytes())
    pieces_rel = f"compactions/{cid}.pieces.parquet"
    store.write_atomic(pieces_rel, blob)
    catalog = _catalog(commits)
    catalog_rel = f"compactions/{cid}.commits.arrow"
    store.write_atomic(catalog_rel, catalog)
    hook("pieces")
    marker = {
        "version": SCHEMA_VERSION,
        "kind": "compaction",
        "id": cid,
        "before": target.id,
        "created_at": now_iso(),
        "files": [
            {"path": f.path, "rows": f.rows, "bytes": f.bytes, "sha256": f.sha256} for f in files
        ],
        "pieces": {"path": pieces_rel, "bytes": len(blob), "sha256": sha256(blob)},
        "catalog": {"path": catalog_rel, "bytes": len(catalog), "sha256": sha256(catalog)},
    }
    try:
        store.create_exclusive(compaction_path(cid), json.dumps(marker, indent=1).encode())
    except CommitConflict as e:
        raise CommitConflict(
            f"another compaction {cid} committed first: {e}; run ledger compact again"
        ) from e
    hook("marker")
    cache = command_cache()
    if cache is not None:
        dropped = ("pieces", "compactions", "catalog", "piece_table", "catalog_tables", "history")
        for name in dropped:
            cache.pop((name, store.uri), None)
    for _, ref in todo:
        store.delete(ref.path)
        retired += 1
        hook("retire")
    return CompactionResult(cid, len(todo), len(files), sum(r.rows for _, r in todo), retired)


def _retire_leftovers(store: Store, known: dict[str, Commit], hook: Hook) -> int:
    """Delete originals that committed compactions hold and that a killed run left."""
    count = 0
    for path in pieces(store):
        if store.exists(path):
            store.delete(path)
            count += 1
            hook("retire")
    return count


def _write_files(
    store: Store, cid: str, todo: list[tuple[Commit, SegmentRef]], target_rows: int
) -> tuple[list[CompactedFile], list[tuple[int, int, int, int]]]:
    """Copy the segments, in order, into files of about ``target_rows`` events cut into
    row groups of :data:`ledger.segments.ROW_GROUP_ROWS` rows (the last of a file
    shorter): a piece is a range of rows, so reading a compacted file costs what reading
    few large segments costs, however small the pieces. Returns the files and, per
    segment, ``(file, first group, groups, first row)``."""
    files: list[CompactedFile] = []
    where: list[tuple[int, int, int, int]] = []
    size = segments.ROW_GROUP_ROWS
    writer: pq.ParquetWriter | None = None
    sink: pa.BufferOutputStream | None = None
    pending: list[pa.Table] = []  # rows not yet written: less than one row group
    held = rows = 0

    def flush(last: bool) -> None:
        nonlocal pending, held
        if not pending or writer is None:
            return
        table = pa.concat_tables(pending)
        whole = table.num_rows if last else table.num_rows - table.num_rows % size
        if whole:
            writer.write_table(table.slice(0, whole), row_group_size=size)
        pending = [table.slice(whole)] if whole < table.num_rows else []
        held = table.num_rows - whole

    def close() -> None:
        nonlocal writer, sink
        if writer is None or sink is None:
            return
        flush(last=True)
        writer.close()
        data = bytes(sink.getvalue().to_pybytes())
        rel = f"events/compacted/{cid}/part-{len(files):05d}.parquet"
        store.write_atomic(rel, data)
        files.append(CompactedFile(rel, rows, len(data), sha256(data)))
        writer = sink = None

    def load(job: tuple[Commit, SegmentRef]) -> pa.Table:
        c, ref = job
        table = _unify(segments.read(store, ref.path, rows=ref.rows, checksum=ref.sha256))
        return table.append_column(
            "commit_id", pa.array([c.id] * table.num_rows, pa.string())
        ).append_column("step", pa.array([c.step] * table.num_rows, pa.int64()))

    with ThreadPoolExecutor(4, thread_name_prefix="ledger-compact") as pool:
        ahead: deque[Future[pa.Table]] = deque()
        jobs = iter(todo)
        for job in itertools.islice(jobs, 8):
            ahead.append(pool.submit(load, job))
        while ahead:
            table = ahead.popleft().result()
            for job in itertools.islice(jobs, 1):
                ahead.append(pool.submit(load, job))
            if writer is None:
                sink = pa.BufferOutputStream()
                writer = pq.ParquetWriter(
                    sink,
                    COMPACTED_SCHEMA,
                    compression="zstd",
                    use_dictionary=["kind", "source", "commit_id"],
                    write_statistics=True,
                    # row groups of ROW_GROUP_ROWS rows: the byte-split ids' best case
                    **segments.writer_options(target_rows),
                )
                rows = 0
            n = table.num_rows
            first, last = rows // size, (rows + max(n, 1) - 1) // size
            where.append((len(files), first, last - first + 1, rows))
            pending.append(table)
            held += n
            rows += n
            if held >= size:
                flush(last=False)
            if rows >= target_rows:
                close()
    close()
    return files, where


__all__ = ["CompactionResult", "compact", "pieces"]
