"""Parquet segments: one immutable file of events per rank per commit.

Encodings keep the log near its information content: every integer column is
``DELTA_BINARY_PACKED`` (positions and batch indexes delta to ~0 bits, shuffled sample
ids to ~log2(2N) bits) then zstd; ``kind`` is dictionary-encoded. Measured by
``tools/bench.py``: about 1.08 x log2(N)/8 bytes per event for N = 10**6.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from ledger.errors import LogCorrupted
from ledger.schema import EVENT_SCHEMA
from ledger.store import Store, sha256

_DELTA = {
    name: "DELTA_BINARY_PACKED"
    for name in ("attempt", "rank", "worker", "epoch", "batch", "position", "sample_id")
}


def segment_path(attempt: int, rank: int, step: int) -> str:
    """Relative path of the segment of ``rank`` at commit ``step`` of ``attempt``."""
    return f"events/attempt={attempt}/rank={rank}/seg-{step:012d}.parquet"


def encode(table: pa.Table) -> bytes:
    """Serialise an event table to Parquet bytes with the log's encodings.

    Args:
        table: rows with :data:`ledger.schema.EVENT_SCHEMA`.

    Returns:
        The Parquet file's bytes.
    """
    sink = pa.BufferOutputStream()
    pq.write_table(
        table.cast(EVENT_SCHEMA),
        sink,
        compression="zstd",
        use_dictionary=["kind"],
        column_encoding=_DELTA,
        row_group_size=1 << 20,
        write_statistics=True,
    )
    return bytes(sink.getvalue().to_pybytes())


def read(
    store: Store,
    rel: str,
    *,
    rows: int | None = None,
    checksum: str | None = None,
    columns: list[str] | None = None,
) -> pa.Table:
    """Read a segment, checking its row count and checksum when given.

    Args:
        store: the log's store.
        rel: relative path of the segment.
        rows: expected number of rows (from the commit marker), or ``None``.
        checksum: expected hex SHA-256 of the file, or ``None`` to skip the check.
        columns: subset of columns to read, or ``None`` for all.

    Returns:
        The events, in the order they were written.

    Raises:
        LogCorrupted: if the file is missing, unreadable, or differs from the marker.
    """
    try:
        data = store.read_bytes(rel)
    except FileNotFoundError as e:
        raise LogCorrupted(f"segment {rel} named by a commit marker is missing") from e
    if checksum is not None and sha256(data) != checksum:
        raise LogCorrupted(
            f"segment {rel} has sha256 {sha256(data)}, its commit marker says {checksum}: "
            "the file was altered after commit"
        )
    try:
        table = pq.read_table(pa.BufferReader(data), columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise LogCorrupted(f"segment {rel} is not a readable Parquet file: {e}") from e
    if rows is not None and table.num_rows != rows:
        raise LogCorrupted(f"segment {rel} has {table.num_rows} rows, its marker says {rows}")
    return table
