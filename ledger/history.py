"""Every commit of a log root as columns: the audit's path with no Python object per commit.

:func:`ledger.commits.list_commits` gives one :class:`~ledger.commits.Commit` per marker,
which resume and compaction need. The audit's views (:mod:`ledger.audit.views`) and its
scan (:mod:`ledger.audit.scan`) need only columns: each commit's header and the leading
26 integers of each rank row (state and segment, :mod:`ledger.ranks`). A
:class:`History` holds exactly those, as numpy and Arrow arrays. :func:`read_history`
builds it from the listing of ``commits/``, taking the commits a compaction's catalog
holds straight from the catalog's columns (:func:`ledger.compaction.catalog_tables`) and
parsing only the markers written since; so the views of a compacted history of 10^4
commits cost a few numpy passes instead of 10^4 ``Commit`` objects, their segment
references and pieces.

Logs holding a version-1 marker (segments and states inline in JSON) have no rank rows:
for them :func:`read_history` returns ``None`` and callers take the object path.
"""

from __future__ import annotations

import binascii
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ledger.commits import COMMIT_NAME, Commit, command_cache, read_commits
from ledger.errors import LogCorrupted
from ledger.store import Store, background

HEAD = 26
"""Leading columns of a rank row that hold the state and the segments (ledger.ranks)."""

SEGMENTS_SCHEMA = pa.schema(
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
"""One row per segment named by a marker (the ``segments`` view of the audit)."""


def segments_table(commits: list[Commit]) -> pa.Table:
    """One row per segment named by ``commits`` (:data:`SEGMENTS_SCHEMA`), built from
    their segment references: the path of logs holding version-1 markers, which have no
    rank table for :meth:`History.segments` to read as columns."""
    return pa.Table.from_pylist(
        [
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
        ],
        schema=SEGMENTS_SCHEMA,
    )


@dataclass(frozen=True, slots=True)
class History:
    """Commits as columns, in the order of :func:`ledger.commits.list_commits` (by
    attempt, then step) unless built from a list in another order (:meth:`of`).

    Attributes:
        ids: commit ids, ``string (C,)``.
        step: ``int64 (C,)``.
        attempt: ``int64 (C,)``.
        parent: parent ids, ``string (C,)``, null for a first commit.
        world_size: ``int64 (C,)``.
        created_at: ISO 8601 times, ``string (C,)``.
        starts: ``int64 (C + 1,)``: commit ``k``'s rank rows are
            ``rows[starts[k]:starts[k + 1]]``, rank ``r`` at ``starts[k] + r``.
        rows: ``int64 (R, 26)``: the leading columns of every rank row.
    """

    ids: pa.Array
    step: np.ndarray
    attempt: np.ndarray
    parent: pa.Array
    world_size: np.ndarray
    created_at: pa.Array
    starts: np.ndarray
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.step)

    @classmethod
    def of(cls, commits: Sequence[Commit]) -> History | None:
        """The columns of ``commits`` (in their order); ``None`` if one is a version-1
        commit (no rank table)."""
        tables = [c.ranks.rows for c in commits if c.ranks is not None]
        if len(tables) != len(commits):
            return None
        n = len(commits)
        sizes = np.fromiter((len(t) for t in tables), np.int64, n)
        rows = np.concatenate([t[:, :HEAD] for t in tables]) if n else np.zeros((0, HEAD), np.int64)
        return cls(
            pa.array([c.id for c in commits], pa.string()),
            np.fromiter((c.step for c in commits), np.int64, n),
            np.fromiter((c.attempt for c in commits), np.int64, n),
            pa.array([c.parent for c in commits], pa.string()),
            np.fromiter((c.world_size for c in commits), np.int64, n),
            pa.array([c.created_at for c in commits], pa.string()),
            np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            rows,
        )

    def take(self, order: np.ndarray) -> History:
        """The commits at the indexes ``order`` (``int64``), in that order."""
        sizes = np.diff(self.starts)[order]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        rows = self.rows[_ranges(self.starts[order], sizes)]
        indices = pa.array(order, pa.int64())
        return History(
            self.ids.take(indices),
            self.step[order],
            self.attempt[order],
            self.parent.take(indices),
            self.world_size[order],
            self.created_at.take(indices),
            starts,
            rows,
        )

    def index(self, cid: str) -> int | None:
        """Position of commit ``cid`` (``None``: not among these commits)."""
        at = pc.index(self.ids, pa.scalar(cid, pa.string())).as_py()
        return None if at < 0 else int(at)

    def lineage(self, head: int) -> np.ndarray:
        """Positions of the commits of the lineage of commit ``head``, oldest first.

        The chain is followed a run at a time: a commit whose parent is the commit just
        before it (an attempt's commits, in order) continues a run, found for all commits
        with numpy; so a chain of 10^4 commits costs a step per attempt, not per commit.

        Raises:
            LogCorrupted: if a parent is not among these commits, or the chain loops (the
                words of :func:`ledger.commits.lineage`).
        """
        n = len(self)
        named = self.parent.is_valid().to_numpy(zero_copy_only=False)
        follows = np.zeros(n, np.bool_)  # the parent is the commit before
        if n > 1:
            same = pc.equal(self.parent[1:], self.ids[:-1]).fill_null(False)
            follows[1:] = same.to_numpy(zero_copy_only=False)
        up = np.where(follows, np.arange(n) - 1, -1)
        others = np.flatnonzero(named & ~follows)
        if others.size:
            parents = self.parent.take(pa.array(others, pa.int64()))
            up[others] = pc.index_in(parents, value_set=self.ids).fill_null(-1).to_numpy()
        run = np.maximum.accumulate(np.where(follows, 0, np.arange(n)))  # each run's first
        parts: list[np.ndarray] = []
        seen: set[int] = set()
        k = head
        while True:
            first = int(run[k])
            if first in seen or (named[first] and up[first] < 0):  # a loop, a missing parent
                return self._walk(head)  # raises, naming the commit
            seen.add(first)
            parts.append(np.arange(first, k + 1, dtype=np.int64))
            if not named[first]:
                return np.concatenate(parts[::-1])
            k = int(up[first])

    def _walk(self, head: int) -> np.ndarray:
        """:meth:`lineage` one parent at a time: what names the commit where it breaks."""
        parents = pc.index_in(self.parent, value_set=self.ids).fill_null(-1).to_numpy()
        named = self.parent.is_valid().to_numpy(zero_copy_only=False).tolist()
        up = parents.tolist()
        seen = bytearray(len(self))
        chain = []
        k = head
        while True:
            if seen[k]:
                raise LogCorrupted(f"commit chain loops at {self.ids[k].as_py()}")
            seen[k] = 1
            chain.append(k)
            if not named[k]:
                break
            if up[k] < 0:
                raise LogCorrupted(
                    f"commit {self.ids[k].as_py()} names parent {self.parent[k].as_py()}, "
                    "which does not exist"
                )
            k = up[k]
        return np.asarray(chain[::-1], np.int64)

    def rank_of_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Per rank row, its commit's position and its rank (``int64 (R,)`` each)."""
        sizes = np.diff(self.starts)
        of = np.repeat(np.arange(len(self)), sizes)
        return of, np.arange(len(self.rows)) - self.starts[of]

    def segment_commits(self) -> np.ndarray:
        """Per segment of :meth:`segments`, the position of its commit (``int64``)."""
        of, _ = self.rank_of_rows()
        return of[self.rows[:, 1] == 1]

    def segments(self) -> pa.Table:
        """One row per segment written at these commits (:data:`SEGMENTS_SCHEMA`),
        commit by commit, in rank order: numpy over every rank row at once."""
        of, rank = self.rank_of_rows()
        wrote = np.flatnonzero(self.rows[:, 1] == 1)
        at = of[wrote]
        attempts = self.attempt[at]
        # ledger.segments.segment_path of each, by Arrow's string kernels.
        paths = pc.binary_join_element_wise(
            "events/attempt=",
            pa.array(attempts).cast(pa.string()),
            "/rank=",
            pa.array(rank[wrote]).cast(pa.string()),
            "/seg-",
            pc.utf8_lpad(pa.array(self.rows[wrote, 12]).cast(pa.string()), 12, "0"),
            ".parquet",
            "",
        )
        hexed = _hex(self.rows[wrote, 4:8])
        return pa.table(
            [
                self.ids.take(pa.array(at, pa.int64())),
                self.step[at],
                attempts.astype(np.int32),
                rank[wrote].astype(np.int32),
                paths,
                self.rows[wrote, 2],
                self.rows[wrote, 3],
                hexed,
            ],
            schema=SEGMENTS_SCHEMA,
        )


def _hex(values: np.ndarray) -> pa.Array:
    """Each row of ``int64 (n, 4)`` as the 64 hex digits of its 32 little-endian bytes (a
    SHA-256 as the rank table holds it): the hex digits of all rows in one call, cut into
    strings by Arrow's offsets (no string per row in Python)."""
    raw = np.ascontiguousarray(values, dtype="<i8").tobytes()
    offsets = np.arange(0, 64 * len(values) + 1, 64, dtype=np.int32)
    return pa.StringArray.from_buffers(
        len(values), pa.py_buffer(offsets), pa.py_buffer(binascii.hexlify(raw))
    )


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The indexes ``starts[k] .. starts[k] + sizes[k] - 1`` of every ``k``, in order."""
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    of = np.repeat(np.arange(len(sizes)), sizes)
    first = np.cumsum(sizes) - sizes
    return (starts[of] + np.arange(total) - first[of]).astype(np.int64)


def read_history(store: Store) -> History | None:
    """Every commit under the root as columns, by attempt then step: the commits
    :func:`ledger.commits.list_commits` gives, from the same files (the listing of
    ``commits/`` says which exist; a catalogued commit comes from its compaction's
    catalog, any other from its marker). ``None`` when a marker is of version 1. Read once
    per command inside :func:`ledger.commits.parse_once`.

    Raises:
        LogCorrupted: if a marker or a catalog is damaged (as :func:`list_commits`).
    """
    from ledger.compaction import HISTORY_COLUMNS, catalog_tables  # imports ledger.commits

    cache = command_cache()
    key = ("history", store.uri)
    if cache is not None and key in cache:
        return cache[key]
    parts: list[History] = []
    # The compactions' catalogs are read, hashed and decoded on a background thread
    # while ``commits/`` is listed (both release the GIL for most of their time): for a
    # compacted history of 10^4 commits, this function's wall-clock median 21 -> 12 ms.
    # The thread shares this command's cache (the context's variables).
    catalogs = background("catalog").submit(
        contextvars.copy_context().run, catalog_tables, store, HISTORY_COLUMNS
    )
    rest = _marker_names(store.ls("commits", ordered=False, files=True))
    for table in catalogs.result():
        if not len(rest):
            break
        at = pc.index_in(rest, value_set=table["id"]).fill_null(-1).to_numpy()
        held = at >= 0
        if held.any():
            parts.append(_from_catalog(table, np.sort(at[held])))  # in the catalog's order
            rest = rest.filter(pa.array(~held))
    # A catalog holds commit ids only (copied from checked markers); the other names are
    # checked here.
    rest = rest.filter(pc.match_substring_regex(rest, _COMMIT_ID))
    rest = rest.take(pc.sort_indices(rest))
    commits = read_commits(store, rest.to_pylist())
    own = History.of(commits)
    if own is None:
        out = None
    else:
        whole = _concat([*parts, own] if len(own) or not parts else parts)  # no copy for none
        order = np.lexsort((whole.step, whole.attempt))
        ordered = bool(np.all(order == np.arange(len(order))))  # as a catalog holds them
        out = whole if ordered else whole.take(order)
    if cache is not None:
        cache[key] = out
    return out


_COMMIT_ID = COMMIT_NAME.pattern.replace(r"\.json$", "$")
""":data:`ledger.commits.COMMIT_NAME` without ``.json``."""


def _marker_names(names: list[str]) -> pa.Array:
    """The names ending in ``.json`` among ``names``, without it, in their order, by
    Arrow's string kernels over all of them at once (10^4 commits: 10^4 names in
    ``commits/``; 2·10^4 in logs written before rank tables moved to ``ranks/``)."""
    listed = pa.array(names, pa.string())
    markers = listed.filter(pc.ends_with(listed, ".json"))
    return pc.utf8_slice_codeunits(markers, 0, -len(".json"))


def _from_catalog(table: pa.Table, at: np.ndarray) -> History:
    """The catalog's commits at rows ``at``, as columns (checked by
    :func:`ledger.compaction.catalog_tables`)."""
    picked = table.select(["id", "step", "attempt", "parent", "world_size", "created_at", "width"])
    if len(at) != len(table):  # else every commit of the catalog, in order: no copy
        picked = picked.take(pa.array(at, pa.int64()))
    ranks = table["ranks"].combine_chunks()
    values = ranks.values.to_numpy()
    offsets = ranks.offsets.to_numpy()
    world = picked["world_size"].to_numpy()
    width = picked["width"].to_numpy()
    starts = np.concatenate([[0], np.cumsum(world)]).astype(np.int64)
    widths = table["width"].to_numpy()
    if len(widths) and np.all(widths == widths[0]):  # one rank table width: a matrix
        matrix = values[: offsets[-1]].reshape(-1, int(widths[0]))
        if len(at) == len(widths):  # every commit of the catalog
            rows = matrix[:, :HEAD]
        else:
            rows = matrix[_ranges(offsets[at] // widths[0], world), :HEAD]
    else:
        # Rank row r of commit k starts at offsets[k] + r * width[k]; its HEAD columns.
        of = np.repeat(np.arange(len(at)), world)
        rank = np.arange(int(starts[-1])) - starts[of]
        first = offsets[at][of] + rank * width[of]
        rows = values[first[:, None] + np.arange(HEAD)]
    return History(
        picked["id"].combine_chunks(),
        picked["step"].to_numpy(),
        picked["attempt"].to_numpy(),
        picked["parent"].combine_chunks(),
        world,
        picked["created_at"].combine_chunks(),
        starts,
        rows.reshape(-1, HEAD),
    )


def _concat(parts: list[History]) -> History:
    if len(parts) == 1:
        return parts[0]
    sizes = np.concatenate([np.diff(p.starts) for p in parts])
    return History(
        pa.concat_arrays([p.ids for p in parts]),
        np.concatenate([p.step for p in parts]),
        np.concatenate([p.attempt for p in parts]),
        pa.concat_arrays([p.parent for p in parts]),
        np.concatenate([p.world_size for p in parts]),
        pa.concat_arrays([p.created_at for p in parts]),
        np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        np.concatenate([p.rows for p in parts]),
    )


__all__ = ["History", "read_history"]
