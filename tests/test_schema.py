"""chunks_to_table against a row-by-row reference definition of the event rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.schema import BATCH, EVENT_SCHEMA, KINDS, SAMPLE, SPAN, EventChunk, chunks_to_table
from ledger.segments import encode


def reference_rows(chunks: list[EventChunk], attempt: int, rank: int) -> list[dict]:
    """The rows of ``chunks``, one Python dict per row: the definition the vectorised
    ``chunks_to_table`` must equal (a digest on a sample/span chunk is one ``batch`` row
    after the chunk's rows, at its last sample's position)."""
    rows = []
    for chunk in chunks:
        bare, batch_row = chunk.split_digest()
        for c in (bare, batch_row):
            if c is None:
                continue
            k = c.sample_ids.shape[0]
            for i in range(k):
                rows.append(
                    {
                        "attempt": attempt,
                        "rank": rank,
                        "worker": c.worker,
                        "epoch": c.epoch,
                        "batch": c.batch,
                        "position": int(c.positions[i])
                        if c.positions is not None
                        else c.position + i,
                        "sample_id": int(c.sample_ids[i]),
                        "kind": c.kind,
                        "token_start": None if c.token_start is None else int(c.token_start[i]),
                        "token_end": None if c.token_end is None else int(c.token_end[i]),
                        "length": None if c.length is None else int(c.length[i]),
                        "value": None if c.values is None else c.values[i],
                        "digest": c.digest if c.kind == BATCH else None,
                        "source": None
                        if c.sources is None or c.source_names is None
                        else c.source_names[int(c.sources[i])],
                        "source_epoch": None
                        if c.source_epochs is None
                        else int(c.source_epochs[i]),
                    }
                )
    return rows


def _arrays(n: int, draw: st.DrawFn, present: bool) -> np.ndarray | None:
    if not present:
        return None
    return np.array(draw(st.lists(st.integers(-5, 10**12), min_size=n, max_size=n)), np.int64)


@st.composite
def chunk_lists(draw: st.DrawFn) -> list[EventChunk]:
    chunks = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from([SAMPLE, SPAN, "skip", "buffer", BATCH]))
        digest = bytes(draw(st.binary(min_size=32, max_size=32))) if draw(st.booleans()) else None
        if kind == BATCH:
            n = 1
            ids = np.array([-1], np.int64)
            digest = digest or bytes(32)
        else:
            n = draw(st.integers(0, 5))
            ids = np.array(draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n)), np.int64)
        span = kind == SPAN
        values = None
        if draw(st.booleans()):
            values = draw(st.lists(st.none() | st.text(max_size=4), min_size=n, max_size=n))
        names = sources = source_epochs = None
        if kind != BATCH and draw(st.booleans()):  # a mixture's chunk names its sources
            names = tuple(draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3)))
            sources = np.array(
                draw(st.lists(st.integers(0, len(names) - 1), min_size=n, max_size=n)), np.int16
            )
            if draw(st.booleans()):  # a mixture of streams': each row's source epoch
                source_epochs = np.array(
                    draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), np.int64
                )
        chunks.append(
            EventChunk(
                kind,
                draw(st.integers(0, 3)),
                draw(st.integers(0, 100)),
                draw(st.integers(-1, 3)),
                draw(st.integers(0, 1000)),
                ids,
                positions=_arrays(n, draw, draw(st.booleans())),
                token_start=_arrays(n, draw, span),
                token_end=_arrays(n, draw, span),
                length=_arrays(n, draw, span),
                values=values,
                digest=digest,
                sources=sources,
                source_names=names,
                source_epochs=source_epochs,
            )
        )
    return chunks


@settings(max_examples=300, deadline=None)
@given(chunk_lists(), st.integers(0, 5), st.integers(0, 7))
def test_chunks_to_table_equals_reference(chunks: list[EventChunk], attempt: int, rank: int):
    table = chunks_to_table(chunks, attempt, rank)
    assert table.schema == EVENT_SCHEMA
    assert table.num_rows == sum(c.rows for c in chunks)
    assert table.to_pylist() == reference_rows(chunks, attempt, rank)


def test_batch_row_follows_its_samples():
    ids = np.array([7, 3, 9], np.int64)
    chunk = EventChunk(SAMPLE, 1, 4, 0, 256, ids, digest=b"\x01" * 32)
    rows = chunks_to_table([chunk], 0, 0).to_pylist()
    assert [r["kind"] for r in rows] == [SAMPLE, SAMPLE, SAMPLE, BATCH]
    assert [r["position"] for r in rows] == [256, 257, 258, 258]
    assert [r["sample_id"] for r in rows] == [7, 3, 9, -1]
    assert [r["digest"] for r in rows] == [None, None, None, b"\x01" * 32]
    assert set(KINDS) >= {r["kind"] for r in rows}


def test_map_style_row_group_equals_reference():
    # Every chunk the same size with a digest: the layout a map-style segment's row groups
    # take (a grid of rows, not a scatter), with a batch that changes epoch and worker.
    rng = np.random.default_rng(5)
    chunks = [
        EventChunk(SAMPLE, b // 3, b, b % 2, 4 * b, rng.integers(0, 100, 4), digest=bytes([b]) * 32)
        for b in range(7)
    ]
    table = chunks_to_table(chunks, 2, 1)
    assert table.schema == EVENT_SCHEMA
    assert table.to_pylist() == reference_rows(chunks, 2, 1)


def test_digest_column_ignores_null_slots():
    # chunks_to_table leaves the bytes of the digest column's null slots as allocated:
    # the segment's bytes must not depend on them (Parquet's writer skips null slots).
    chunks = [
        EventChunk(SAMPLE, 0, b, -1, 3 * b, np.arange(3 * b, 3 * b + 3), digest=bytes([b]) * 32)
        for b in range(5)
    ]
    table = chunks_to_table(chunks, 0, 0)
    column = table["digest"].combine_chunks()
    validity, data = column.buffers()
    encoded = []
    for fill in (0x00, 0xAB):
        raw = np.frombuffer(data, np.uint8).reshape(len(column), 32).copy()
        raw[np.array(column.is_null())] = fill
        filled = pa.Array.from_buffers(
            column.type, len(column), [validity, pa.py_buffer(raw)], column.null_count
        )
        assert filled.to_pylist() == column.to_pylist()
        i = table.schema.get_field_index("digest")
        encoded.append(encode(table.set_column(i, table.schema.field(i), filled)))
    assert encoded[0] == encoded[1]
