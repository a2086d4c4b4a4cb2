"""Sharded sources: Parquet and JSONL files as one table of rows with stable sample ids.

The sample id of a row is its global row number over the sorted file list. Rows can be
read sequentially (a shard at a time, a row group at a time) or by id (random access, a
row group or a line range per read), so a resume re-reads only what it needs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from ledger.errors import (
    CommitConflict,
    ConfigMismatch,
    DataError,
    LogCorrupted,
    UnsupportedArgument,
)
from ledger.store import Files, Store
from ledger.validate import require

_JSONL_BLOCK = 1024  # lines read per request when streaming a JSONL shard
_BLOCK_ROWS = 128
"""Rows made Python objects at a time when streaming (a Parquet row group is decoded
whole, then converted a slice at a time; a JSONL request's lines parsed a slice at a
time). A row's dict and lists are objects Python's cyclic garbage collector tracks;
made a whole row group (~10^3 rows) at once and held until the block is consumed, they
lived through collections, reached the oldest generation and set off full collections
of the process. A slice's rows are loaded (transformed) soon after they are made."""

ROW_GROUP_HASH = "xxh3-128"
"""Hash of a row group's digest (:meth:`ShardedSource.record_digests`), also the suffix
of its file: XXH3 (128 bits, the ``xxhash`` library), ~15x cheaper than SHA-256 on the
decoded rows (~25 µs against ~350 µs for a row group of 0.5 MB) and as sure to change
with any changed byte of them. The digest guards against data that changed by mistake,
not against a forger (who could rewrite the footer fingerprint as well). Runs begun
before it recorded ``sha256`` digests; those are still checked with SHA-256."""

_ROW_GROUP_HASHES: dict[str, Callable[..., Any]] = {
    ROW_GROUP_HASH: xxhash.xxh3_128,
    "sha256": hashlib.sha256,
}


def _text(raw: bytes) -> str:
    return raw.decode(errors="replace").strip()


def row_group_records(store: Store) -> tuple[int, list[str], list[str]]:
    """Check every row-group digest record of a log (:meth:`ShardedSource.record_digests`:
    ``data/rowgroups/[source=NAME/]shard=S/G.ALGORITHM``), for ``ledger verify``.

    Returns:
        ``(records, damaged, empty)``: how many records there are; one problem per record
        that holds anything but a hex digest of its algorithm's length (a damaged log
        file); and the empty ones (written without fsync, a power loss can leave one
        empty: the next read of that row group records it again).
    """
    rels = [
        rel
        for pattern in ("data/rowgroups/shard=*/*", "data/rowgroups/source=*/shard=*/*")
        for rel in store.glob(pattern)
        if rel.rpartition(".")[2] in _ROW_GROUP_HASHES
    ]
    damaged: list[str] = []
    empty: list[str] = []
    for rel, raw in zip(rels, store.read_many(rels), strict=True):
        if raw is None:
            continue  # removed since the listing
        if not raw:
            empty.append(store.full(rel))
            continue
        try:
            _recorded_digest(store, rel, raw, rel.rpartition(".")[2])
        except LogCorrupted as e:
            damaged.append(str(e))
    return len(rels), damaged, empty


def _recorded_digest(store: Store, rel: str, raw: bytes, algorithm: str) -> str:
    """The hex digest a row group's record file holds.

    Raises:
        LogCorrupted: naming the file, if it holds anything but a hex digest of
            ``algorithm``'s length (a damaged log file, not changed data).
    """
    text = _text(raw)
    width = 2 * _ROW_GROUP_HASHES[algorithm]().digest_size
    if len(text) != width or text.strip("0123456789abcdef"):
        raise LogCorrupted(
            f"{store.full(rel)} does not hold a {algorithm} digest ({width} hex digits) but "
            f"{text[:40]!r}: the log's record of that row group is damaged"
        )
    return text


@dataclass(frozen=True, slots=True)
class FileInfo:
    """What identifies one shard in the dataset fingerprint.

    Attributes:
        path: the file's path (as the filesystem names it).
        size: bytes.
        rows: rows (Parquet) or non-empty lines (JSONL).
        digest: hex SHA-256 of the Parquet footer (row group sizes and column
            statistics) or of the whole JSONL file.
    """

    path: str
    size: int
    rows: int
    digest: str


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A JSONL line that is not a JSON object, in the place of its row, where a reader
    asked for them with ``strict=False`` (a stream's workers): the sample fails to load
    when it is transformed (:func:`ledger.stream.sample.sample_loader` raises a
    :class:`~ledger.errors.DataError` with :attr:`message`), so ``on_error="skip"``
    leaves it out and logs it like any sample whose loading raised, and
    ``on_error="raise"`` stops the run with the same error.

    Attributes:
        message: the :class:`~ledger.errors.DataError`'s message, naming the file, the
            line and the sample id.
    """

    message: str


def checked_fingerprint(logged: Any, where: str = "run.json, config, source") -> list[Any]:
    """A source's fingerprint as a log recorded it (:meth:`ShardedSource.fingerprint`),
    checked: a list of objects with ``path`` (str), ``size`` and ``rows`` (integers >= 0)
    and ``digest`` (str or null).

    Raises:
        LogCorrupted: naming ``where`` and the entry, if it is anything else.
    """
    if not isinstance(logged, list):
        raise LogCorrupted(f"{where} is {logged!r}, not a list of shard fingerprints")
    for i, entry in enumerate(logged):
        at = f"{where}[{i}]"
        require(entry, "path", str, at)
        require(entry, "size", int, at, minimum=0)
        require(entry, "rows", int, at, minimum=0)
        require(entry, "digest", str, at, nullable=True)
    return logged


class ShardedSource:
    """Rows of Parquet and JSONL shards, addressed by global row number.

    Args:
        urls: a path/URI, a glob, or a list of them; files are sorted by path.
            ``.parquet`` files are read with pyarrow; ``.jsonl`` / ``.json`` files hold
            one JSON object per line.
        columns: Parquet columns to read (default: all).
        storage_options: fsspec options (credentials, endpoint) for remote URIs.

    Raises:
        FileNotFoundError: if a URI or glob matches no file.
        UnsupportedArgument: if a file is neither Parquet nor JSONL, or a ``.parquet``
            file has no readable footer.
        DataError: when rows are read, for a JSONL line that is not a JSON object (the
            message names the file, the line and the sample id); a stream's workers read
            with ``strict=False`` and get a :class:`BadRecord` there, which fails that
            sample's loading (``on_error="skip"`` skips it).

    Note:
        Construction reads every Parquet footer and every JSONL file once (to count and
        index its lines).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        columns: Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._files = Files(urls if isinstance(urls, str) else list(urls), storage_options)
        self.columns = list(columns) if columns is not None else None
        infos: list[FileInfo] = []
        self._row_groups: list[np.ndarray] = []  # Parquet: first row of each row group
        self._lines: list[np.ndarray] = []  # JSONL: byte offset of each line, plus the end
        for path in self._files.paths:
            if path.endswith(".parquet"):
                infos.append(self._index_parquet(path))
            elif path.endswith((".jsonl", ".json")):
                infos.append(self._index_jsonl(path))
            else:
                raise UnsupportedArgument(f"{path} is neither .parquet nor .jsonl")
        self.infos = tuple(infos)
        rows = np.array([i.rows for i in infos], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self._cache: tuple[int, int, list[dict[str, Any]]] | None = None
        self._digests: Store | None = None  # see record_digests
        self._digests_under = "data/rowgroups"
        self._known: dict[tuple[int, int], tuple[str, str]] = {}  # (algorithm, digest)

    # -------------------------------------------------------------- metadata

    @property
    def files(self) -> tuple[str, ...]:
        """Paths of the shards, sorted."""
        return tuple(self._files.paths)

    @property
    def num_rows(self) -> int:
        """Rows over all shards (= the number of sample ids)."""
        return int(self.offsets[-1])

    def __len__(self) -> int:
        return self.num_rows

    def shard_rows(self, shard: int) -> int:
        """Rows of shard ``shard``."""
        return int(self.offsets[shard + 1] - self.offsets[shard])

    def locate(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard index and row within the shard of each id (``int64`` arrays)."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        shards = np.searchsorted(self.offsets, ids, side="right") - 1
        return shards, ids - self.offsets[shards]

    def fingerprint(self) -> list[dict[str, Any]]:
        """JSON form of the shards' :class:`FileInfo`, stored in ``run.json``."""
        return [
            {"path": i.path, "size": i.size, "rows": i.rows, "digest": i.digest} for i in self.infos
        ]

    def check(self, logged: list[dict[str, Any]]) -> None:
        """Compare this source with the fingerprint a log recorded.

        Raises:
            ConfigMismatch: naming the first differing file and what differs.
            LogCorrupted: if ``logged`` is not a list of fingerprints (a damaged
                ``run.json``).
        """
        logged = checked_fingerprint(logged)
        mine = self.fingerprint()
        for i in range(max(len(mine), len(logged))):
            want = logged[i] if i < len(logged) else None
            got = mine[i] if i < len(mine) else None
            if want == got:
                continue
            if want is None or got is None or want["path"] != got["path"]:
                raise ConfigMismatch(
                    f"shard {i}",
                    want["path"] if want else None,
                    got["path"] if got else None,
                    "The file list changed since the run started: resume with the original "
                    "files, or start a new run under a new log root.",
                )
            what = next(k for k in ("size", "rows", "digest") if want[k] != got[k])
            raise ConfigMismatch(
                f"{want['path']} {what}",
                want[what],
                got[what],
                f"The contents of {want['path']} changed since the run started: restore "
                "the original file, or start a new run under a new log root.",
            )

    # -------------------------------------------------------------- reading

    def iter_shard(self, shard: int, start_row: int = 0) -> Iterator[dict[str, Any]]:
        """Rows of shard ``shard`` from ``start_row`` on, as dicts, read block by block.

        Raises:
            ConfigMismatch: if a row group's content differs from when the run first
                read it (with :meth:`record_digests`).
        """
        for block in self.iter_blocks(shard, start_row):
            yield from block

    def iter_blocks(
        self, shard: int, start_row: int = 0, *, strict: bool = True
    ) -> Iterator[list[Any]]:
        """:meth:`iter_shard` a block at a time: lists of at most :data:`_BLOCK_ROWS`
        consecutive rows (of one Parquet row group, decoded whole, or of one request of
        up to 1,024 JSONL lines), the first from ``start_row``; no block is empty. What
        the workers read, so per-row work stays out of the reading.

        Args:
            shard: index of the shard in :attr:`files`.
            start_row: the shard's row to start from.
            strict: ``False``: a JSONL line that is not a JSON object is a
                :class:`BadRecord` in its row's place instead of an error.

        Raises:
            ConfigMismatch: if a row group's content differs from when the run first
                read it (with :meth:`record_digests`).
            DataError: (``strict``) for a JSONL line that is not a JSON object.
        """
        path = self._files.paths[shard]
        if path.endswith(".parquet"):
            starts = self._row_groups[shard]
            first = int(np.searchsorted(starts, start_row, side="right") - 1)
            with self._files.open(path) as f:
                pf = pq.ParquetFile(f)
                for g in range(max(first, 0), pf.num_row_groups):
                    table = pf.read_row_group(g, columns=self.columns)
                    self._check_table(shard, g, table)
                    skip = start_row - int(starts[g]) if g == first else 0
                    for lo in range(skip, table.num_rows, _BLOCK_ROWS):
                        # Hold no block while the next one is made: the garbage collector
                        # runs while its rows are made, and would find the last block
                        # alive and move its rows to an older generation.
                        yield table.slice(lo, _BLOCK_ROWS).to_pylist()
        else:
            lines = self._lines[shard]
            for lo in range(start_row, len(lines) - 1, _JSONL_BLOCK):
                hi = min(lo + _JSONL_BLOCK, len(lines) - 1)
                data = self._files.read_range(path, int(lines[lo]), int(lines[hi]))
                for a in range(lo, hi, _BLOCK_ROWS):
                    yield self._jsonl_parse(
                        shard, data, lo, a, min(a + _BLOCK_ROWS, hi), strict=strict
                    )

    def worker_blocks(self, shard: int, row: int, stop: int) -> Iterator[list[Any]]:
        """What a stream's worker reads of ``shard`` from ``row`` (its piece ends at row
        ``stop``): one row by random access (a carried buffer slot), else
        :meth:`iter_blocks`; leniently (``strict=False``: a damaged JSONL line is a
        :class:`BadRecord`, a bad sample)."""
        if stop - row == 1:
            return iter([self.read([int(self.offsets[shard]) + row], strict=False)])
        return self.iter_blocks(shard, row, strict=False)

    def read(self, sample_ids: Sequence[int] | np.ndarray, *, strict: bool = True) -> list[Any]:
        """Rows by sample id, in the order given (random access).

        Reads one Parquet row group (or one JSONL line range) per group of ids that
        share it; the last row group read is cached.

        Args:
            sample_ids: the rows' global numbers.
            strict: ``False``: a JSONL line that is not a JSON object is a
                :class:`BadRecord` in its row's place instead of an error.

        Raises:
            IndexError: if an id is outside ``[0, num_rows)``.
            DataError: (``strict``) for a JSONL line that is not a JSON object.
        """
        ids = np.asarray(sample_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            raise IndexError(f"sample ids must be in [0, {self.num_rows})")
        shards, rows = self.locate(ids)
        out: list[dict[str, Any]] = []
        for shard, row in zip(shards.tolist(), rows.tolist(), strict=True):
            out.append(self._row(shard, row, strict))
        return out

    def _row(self, shard: int, row: int, strict: bool = True) -> Any:
        path = self._files.paths[shard]
        if path.endswith(".parquet"):
            starts = self._row_groups[shard]
            g = int(np.searchsorted(starts, row, side="right") - 1)
            if self._cache is None or self._cache[:2] != (shard, g):
                with self._files.open(path) as f:
                    table = pq.ParquetFile(f).read_row_group(g, columns=self.columns)
                self._cache = (shard, g, self._checked(shard, g, table))
            return self._cache[2][row - int(starts[g])]
        return self._jsonl_rows(shard, row, row + 1, strict)[0]

    def record_digests(self, store: Store | None, under: str = "data/rowgroups") -> None:
        """Record each Parquet row group's digest (:data:`ROW_GROUP_HASH` of its decoded
        rows' Arrow IPC stream) in ``store`` the first time it is read, and check it on
        every later read (a resume re-reading buffered rows, a later epoch): a same-size
        edit inside a data page, which the footer fingerprint of :meth:`check` cannot
        see, then raises :class:`ConfigMismatch` naming the shard and
        row group. JSONL shards are hashed whole by the fingerprint already.

        Args:
            store: the log root (digests go to ``under``), or ``None`` to stop.
            under: the folder of this source's digests (a mixture gives each source its
                own).
        """
        self._digests = store
        self._digests_under = under
        self._known = {}

    def _checked(self, shard: int, g: int, table: pa.Table) -> list[dict[str, Any]]:
        self._check_table(shard, g, table)
        return table.to_pylist()

    def _check_table(self, shard: int, g: int, table: pa.Table) -> None:
        store = self._digests
        if store is not None:
            self._check_digest(store, shard, g, table)

    def _check_digest(self, store: Store, shard: int, g: int, table: pa.Table) -> None:
        # The Arrow IPC stream of the decoded rows: deterministic for equal content.
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        ipc = sink.getvalue()
        found = _ROW_GROUP_HASHES[ROW_GROUP_HASH](ipc).hexdigest()
        key = (shard, g)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = self._recorded(store, shard, g, found)
        algorithm, recorded = known
        if algorithm != ROW_GROUP_HASH:  # a run begun before ROW_GROUP_HASH
            found = _ROW_GROUP_HASHES[algorithm](ipc).hexdigest()
        if recorded != found:
            path = self._files.paths[shard]
            raise ConfigMismatch(
                f"{path} row group {g}",
                recorded,
                found,
                f"Row group {g} of shard {shard} ({path}) holds other rows than when this run "
                "first read it: the data changed under the same footer. Restore the original "
                "file, or start a new run under a new log root.",
            )

    def _recorded(self, store: Store, shard: int, g: int, found: str) -> tuple[str, str]:
        """``(algorithm, hex digest)`` the run recorded for a row group; records ``found``
        (its :data:`ROW_GROUP_HASH` digest) if this is the run's first read of it."""
        base = f"{self._digests_under}/shard={shard}/{g}"
        for algorithm in _ROW_GROUP_HASHES:  # the current one, then the older one
            rel = f"{base}.{algorithm}"
            try:
                raw = store.read_bytes(rel)
            except FileNotFoundError:
                continue
            if not raw:
                # Written without fsync (cheap to write again): a power loss can leave the
                # file empty. This read's digest is then the record, as on a first read.
                store.write_atomic(f"{base}.{ROW_GROUP_HASH}", found.encode())
                return ROW_GROUP_HASH, found
            return algorithm, _recorded_digest(store, rel, raw, algorithm)
        try:
            store.create_exclusive(f"{base}.{ROW_GROUP_HASH}", found.encode(), durable=False)
            return ROW_GROUP_HASH, found
        except CommitConflict:  # another worker or rank recorded it first
            return ROW_GROUP_HASH, _text(store.read_bytes(f"{base}.{ROW_GROUP_HASH}"))

    def _jsonl_rows(self, shard: int, lo: int, hi: int, strict: bool = True) -> list[Any]:
        lines = self._lines[shard]
        data = self._files.read_range(self._files.paths[shard], int(lines[lo]), int(lines[hi]))
        return self._jsonl_parse(shard, data, lo, lo, hi, strict=strict)

    def _jsonl_parse(
        self, shard: int, data: bytes, at: int, lo: int, hi: int, *, strict: bool = True
    ) -> list[Any]:
        """Lines ``lo <= i < hi`` of JSONL shard ``shard`` as rows, from ``data``: the
        shard's bytes from the start of line ``at`` on; a line that is not a JSON object
        raises its :class:`DataError` (``strict``) or is a :class:`BadRecord`."""
        lines = self._lines[shard]
        base = int(lines[at])
        rows: list[Any] = []
        for i in range(lo, hi):
            try:
                row = json.loads(data[int(lines[i]) - base : int(lines[i + 1]) - base])
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                why = getattr(e, "msg", e)  # JSONDecodeError's position is the slice's
                if strict:
                    raise DataError(self._bad_line(shard, i, f"is not JSON ({why})")) from e
                row = BadRecord(self._bad_line(shard, i, f"is not JSON ({why})"))
            if not isinstance(row, (dict, BadRecord)):
                what = self._bad_line(shard, i, f"is a JSON {type(row).__name__}, not an object")
                if strict:
                    raise DataError(what)
                row = BadRecord(what)
            rows.append(row)
        return rows

    def _bad_line(self, shard: int, row: int, what: str) -> str:
        """The error's message for row ``row`` of JSONL shard ``shard``, naming its line
        number."""
        path = self._files.paths[shard]
        start = int(self._lines[shard][row])
        line = self._files.read_range(path, 0, start).count(b"\n") + 1 if start else 1
        return (
            f"{path}, line {line} (sample id {int(self.offsets[shard]) + row}) {what}: "
            "a JSONL shard holds one JSON object per line"
        )

    # -------------------------------------------------------------- indexing

    def _index_parquet(self, path: str) -> FileInfo:
        size = self._files.size(path)
        try:
            with self._files.open(path) as f:
                meta = pq.ParquetFile(f).metadata
        except pa.ArrowInvalid as e:  # no footer, a bad magic: not Parquet
            raise UnsupportedArgument(f"{path} is not a readable Parquet file: {e}") from e
        counts = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._row_groups.append(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
        self._lines.append(np.zeros(0, np.int64))
        tail = self._files.read_range(path, size - 8, size)
        footer_len = int.from_bytes(tail[:4], "little")
        footer = self._files.read_range(path, size - 8 - footer_len, size - 8)
        return FileInfo(path, size, int(meta.num_rows), hashlib.sha256(footer).hexdigest())

    def _index_jsonl(self, path: str) -> FileInfo:
        data = self._files.read(path)
        buf = np.frombuffer(data, dtype=np.uint8)
        ends = np.flatnonzero(buf == ord("\n")) + 1
        if len(data) and data[-1:] != b"\n":
            ends = np.append(ends, len(data))
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)[: ends.size]  # 0 B: none
        # Blank lines are not rows.
        keep = np.array(
            [data[s:e].strip() != b"" for s, e in zip(starts, ends, strict=True)], dtype=bool
        )
        offsets = np.append(starts[keep], 0)
        # A row's bytes run to the start of the next row; the last one to the file end.
        offsets[-1] = len(data)
        self._lines.append(offsets.astype(np.int64))
        self._row_groups.append(np.zeros(1, np.int64))
        return FileInfo(path, len(data), int(keep.sum()), hashlib.sha256(data).hexdigest())

    def __getstate__(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in ("_files", "columns", "infos", "offsets")}
        state["_row_groups"] = self._row_groups
        state["_lines"] = self._lines
        state["_digests"] = self._digests
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._cache = None
        self._known = {}
