"""Write small synthetic logs, file by file, per docs/SPEC-internal.md.

Independent of the writer side (``ledger.log``): markers are plain JSON written here,
segments are ``ledger.segments.encode`` of rows given in full, so the audit tests check the
readers against a layout, not against the code that normally produces it.

:func:`example_log` builds the log the audit tests use. Dataset of 10 samples, batch
size 3, ``drop_last``, one rank, so an epoch is 3 batches and position 9 is skipped:

=============  ======  =========================  ========================================
commit         parent  events                     note
=============  ======  =========================  ========================================
2-0000         --      batches 0, 1 (epoch 0)
4-0000         2-0000  batch 2 + skip, batch 3    batch 2 closes epoch 0
5-0000         4-0000  batch 4                    abandoned: attempt 1 resumed from 4-0000
(seg 6, a0)    --      batch 5                    orphan: segment written, no marker
6-0001         4-0000  batches 4, 5 + skip        batch 5 repeats sample of position 0
7-0001         6-0001  batch 6 (epoch 2)
7-0002         7-0001  none (``segments: []``)    attempt 2 resumed and committed at once
=============  ======  =========================  ========================================

Attempt 3 has an attempt record and no commit (it crashed before its first commit), and
``commits/`` and ``events/`` hold a ``.tmp-`` file each, which readers must ignore.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from ledger.schema import EVENT_SCHEMA
from ledger.segments import encode, segment_path
from ledger.store import sha256

Row = tuple[int, int, int, int, int, int, int, str]
"""One event: (attempt, rank, worker, epoch, batch, position, sample_id, kind)."""

DATASET_LEN = 10
BATCH_SIZE = 3
RUN_ID = "00c0ffee00c0ffee"
CREATED_AT = "2025-01-02T03:04:05+00:00"

# The epoch orders of example_log: position -> sample id.
ORDERS = {
    0: [3, 7, 1, 9, 0, 5, 2, 8, 6, 4],
    1: [5, 0, 8, 2, 9, 1, 7, 4, 3, 6],
    2: [6, 2, 9, 0, 4, 8, 1, 3, 7, 5],
}


@dataclass
class LogFactory:
    """Writes a log root file by file and remembers every row it wrote.

    Attributes:
        root: the log root (created).
        committed: rows of each commit's segments, by commit id.
        orphans: rows of segments written without a marker.
    """

    root: Path
    dataset_len: int = DATASET_LEN
    batch_size: int = BATCH_SIZE
    drop_last: bool = True
    committed: dict[str, list[Row]] = field(default_factory=dict)
    orphans: list[Row] = field(default_factory=list)

    def __post_init__(self) -> None:
        config = {
            "dataset_len": self.dataset_len,
            "seed": 0,
            "shuffle": True,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "world_size": 1,
            "order": "feistel-ff1-splitmix64-r6-v1",
        }
        self._json("run.json", {"run_id": RUN_ID, "created_at": CREATED_AT, "config": config})

    def attempt(self, attempt: int, parent: str | None) -> None:
        """Write ``attempts/<A>.json``."""
        record = {
            "attempt": attempt,
            "parent": parent,
            "world_size": 1,
            "created_at": f"2025-01-02T0{attempt}:00:00+00:00",
            "host": "node-a",
            "pid": 1000 + attempt,
        }
        self._json(f"attempts/{attempt:04d}.json", record)

    def commit(
        self, attempt: int, step: int, parent: str | None, rows: list[Row], state: tuple[int, int]
    ) -> str:
        """Write the segment of ``rows`` (rank 0; none when empty), then the marker.

        Args:
            attempt: attempt of the commit.
            step: step of the commit (= rank 0's next batch index).
            parent: parent commit id, or ``None``.
            rows: the events since the parent.
            state: rank 0's ``(epoch, epoch_batch)`` after the commit.

        Returns:
            The commit id.
        """
        cid = f"{step:012d}-{attempt:04d}"
        segments = []
        if rows:
            path = segment_path(attempt, 0, step)
            data = self._segment(path, rows)
            segments.append(
                {"rank": 0, "path": path, "rows": len(rows), "bytes": len(data),
                 "sha256": sha256(data)}
            )  # fmt: skip
        marker = {
            "id": cid,
            "step": step,
            "attempt": attempt,
            "parent": parent,
            "world_size": 1,
            "created_at": f"2025-01-02T0{attempt}:{step:02d}:00+00:00",
            "segments": segments,
            "states": [{"rank": 0, "epoch": state[0], "epoch_batch": state[1], "batch": step}],
        }
        self._json(f"commits/{cid}.json", marker)
        self.committed[cid] = list(rows)
        return cid

    def orphan(self, attempt: int, step: int, rows: list[Row]) -> None:
        """Write a segment that no marker names (a crash between segment and marker)."""
        self._segment(segment_path(attempt, 0, step), rows)
        self.orphans.extend(rows)

    def _segment(self, rel: str, rows: list[Row]) -> bytes:
        table = pa.Table.from_pylist(
            [dict(zip(EVENT_SCHEMA.names[: len(r)], r, strict=True)) for r in rows],
            schema=EVENT_SCHEMA,
        )
        data = encode(table)
        self._write(rel, data)
        return data

    def _json(self, rel: str, obj: dict[str, Any]) -> None:
        self._write(rel, json.dumps({"version": 1, **obj}, indent=1).encode())

    def _write(self, rel: str, data: bytes) -> None:
        path = self.root / rel
        os.makedirs(path.parent, exist_ok=True)
        path.write_bytes(data)


def batch(attempt: int, epoch: int, b: int, first: int, ids: list[int] | None = None) -> list[Row]:
    """Sample events of batch ``b``: positions ``first .. first+2`` of ``epoch``'s order.

    Args:
        attempt: attempt that consumed it.
        epoch: epoch of the batch.
        b: batch index.
        first: first position.
        ids: sample ids to log instead of the order's (to fabricate a duplicate).
    """
    positions = range(first, first + BATCH_SIZE)
    ids = ids if ids is not None else [ORDERS[epoch][p] for p in positions]
    worker = b % 2
    return [
        (attempt, 0, worker, epoch, b, p, i, "sample") for p, i in zip(positions, ids, strict=True)
    ]


def skip(attempt: int, epoch: int, b: int) -> list[Row]:
    """The skip event of ``epoch``'s last position, closed by batch ``b``."""
    return [(attempt, 0, -1, epoch, b, 9, ORDERS[epoch][9], "skip")]


def example_log(root: Path) -> LogFactory:
    """Write the log described in this module's docstring under ``root``."""
    f = LogFactory(root)
    f.attempt(0, None)
    c2 = f.commit(0, 2, None, batch(0, 0, 0, 0) + batch(0, 0, 1, 3), (0, 2))
    c4 = f.commit(0, 4, c2, batch(0, 0, 2, 6) + skip(0, 0, 2) + batch(0, 1, 3, 0), (1, 1))
    f.commit(0, 5, c4, batch(0, 1, 4, 3), (1, 2))
    f.orphan(0, 6, batch(0, 1, 5, 6))
    f.attempt(1, c4)
    dup = [ORDERS[1][6], ORDERS[1][0], ORDERS[1][8]]  # position 7 logs position 0's sample
    c6 = f.commit(1, 6, c4, batch(1, 1, 4, 3) + batch(1, 1, 5, 6, dup) + skip(1, 1, 5), (2, 0))
    c7 = f.commit(1, 7, c6, batch(1, 2, 6, 0), (2, 1))
    f.attempt(2, c7)
    f.commit(2, 7, c7, [], (2, 1))
    f.attempt(3, "000000000007-0002")
    f._write("commits/.tmp-0123abcd", b"{not json")
    f._write(f"events/attempt=0/rank=0/.tmp-{'9' * 8}", b"PAR1 partial")
    return f
