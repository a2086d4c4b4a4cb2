"""Streams: sharded sources, shuffle buffers and packing, exact on resume."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ledger
from ledger.audit import connect
from ledger.errors import ConfigMismatch
from ledger.stream import Packer, SampleContext, ShardedSource, Stream
from ledger.stream.source import ShardedSource as _Source
from ledger.testing import assert_resume_exact, take

SHARD_ROWS = (7, 5, 3)  # unequal, with a short final shard; plus a JSONL shard of 4
TOTAL = sum(SHARD_ROWS) + 4


def _text(i: int) -> str:
    return f"doc {i} " + "abcdefghij"[: i % 11]


@pytest.fixture
def shards(tmp_path):
    """Three Parquet shards (row groups of 2 rows) and one JSONL shard; 19 rows."""
    d = tmp_path / "shards"
    d.mkdir()
    k = 0
    for s, n in enumerate(SHARD_ROWS):
        table = pa.table({"text": [_text(k + i) for i in range(n)], "id": list(range(k, k + n))})
        pq.write_table(table, d / f"part-{s}.parquet", row_group_size=2)
        k += n
    with open(d / "part-3.jsonl", "w") as f:
        for i in range(k, k + 4):
            f.write(json.dumps({"text": _text(i), "id": i}) + "\n")
    return str(d)


def tokenize(record, ctx: SampleContext):
    ctx.record(flip=int(ctx.rng.integers(0, 2)))
    return np.frombuffer(record["text"].encode(), np.uint8).astype(np.int64) + 1


def texts(rows):
    return [r["text"] for r in rows]


def test_source_ids_are_global_row_numbers(shards):
    source = ShardedSource(os.path.join(shards, "*"))
    assert [os.path.basename(f) for f in source.files] == [
        "part-0.parquet",
        "part-1.parquet",
        "part-2.parquet",
        "part-3.jsonl",
    ]
    assert source.num_rows == TOTAL
    ids = [18, 0, 7, 14, 15, 3]
    assert [r["id"] for r in source.read(ids)] == ids
    assert [r["id"] for r in source.iter_shard(1, 2)] == [9, 10, 11]
    assert [r["id"] for r in source.iter_shard(3, 1)] == [16, 17, 18]


def test_a_shard_is_streamed_in_small_blocks_of_its_rows_in_order(tmp_path, monkeypatch):
    """Rows become Python objects a block of at most _BLOCK_ROWS at a time (rows made a
    whole row group at once outlived collections and set off full ones), the same rows
    in the same order from any start, across row groups and JSONL requests."""
    import ledger.stream.source as source_module

    monkeypatch.setattr(source_module, "_JSONL_BLOCK", 300)  # a request of 300 lines
    rows = [{"id": i, "text": f"row {i}", "v": [i, -i]} for i in range(1000)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=300)
    with open(tmp_path / "b.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    limit = source_module._BLOCK_ROWS
    for name in ("a.parquet", "b.jsonl"):
        source = ShardedSource(str(tmp_path / name))
        for start in (0, 1, limit - 1, limit, 299, 300, 301, 999):
            blocks = list(source.iter_blocks(0, start))
            assert all(0 < len(b) <= limit for b in blocks), (name, start)
            assert [r for b in blocks for r in b] == rows[start:], (name, start)
        assert source.read([999, 0, 300]) == [rows[999], rows[0], rows[300]]


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("buffer", [0, 5])
@pytest.mark.parametrize("packing", [False, True])
def test_resume_exact_from_every_batch(shards, tmp_path, num_workers, buffer, packing):
    source = ShardedSource(os.path.join(shards, "*"))
    stream = Stream(
        source,
        transform=tokenize if packing else None,
        shuffle_buffer=buffer,
        packer=Packer(seq_len=8, eos_id=0, pad_id=0) if packing else None,
    )
    root = str(tmp_path / "log")

    def make():
        return ledger.DataLoader(
            stream,
            batch_size=3,
            shuffle=True,
            seed=4,
            log=root,
            num_workers=num_workers,
            collate_fn=None if packing else texts,
        )

    loader = make()
    per_epoch = [sum(1 for _ in loader) for _ in range(2)]
    assert per_epoch[0] > 0
    assert assert_resume_exact(make, batches=per_epoch[0] + per_epoch[1] // 2) > 0


def test_every_sample_once_per_epoch_and_shuffled(shards, root):
    source = ShardedSource(os.path.join(shards, "*"))
    loader = ledger.DataLoader(
        Stream(source, shuffle_buffer=4),
        batch_size=4,
        shuffle=True,
        seed=0,
        log=root,
        collate_fn=lambda rows: [r["id"] for r in rows],
    )
    epochs = [[i for b in loader for i in b] for _ in range(2)]
    for ids in epochs:
        assert sorted(ids) == list(range(TOTAL))
    assert epochs[0] != sorted(epochs[0]) and epochs[0] != epochs[1]
    assert loader.epoch == 2


def test_packing_serves_every_token_once_and_spans_say_so(shards, root):
    source = ShardedSource(os.path.join(shards, "*"))
    stream = Stream(source, transform=tokenize, shuffle_buffer=3, packer=Packer(seq_len=8))
    loader = ledger.DataLoader(stream, batch_size=2, shuffle=True, seed=1, log=root, num_workers=2)
    served = {}
    for batch in loader:
        tokens, owners = batch["tokens"].numpy(), batch["sample_ids"].numpy()
        assert tokens.shape[1] == 8
        for sid in np.unique(owners[owners >= 0]):
            served.setdefault(int(sid), []).append(tokens[owners == sid])
    loader.state_dict()
    for sid, row in enumerate(source.read(range(TOTAL))):
        expected = np.append(np.frombuffer(row["text"].encode(), np.uint8).astype(np.int64) + 1, 0)
        assert np.array_equal(np.concatenate(served[sid]), expected), sid
    # The log accounts for every token of every document exactly once in the epoch.
    con = connect(root)
    per_doc = con.execute(
        """
        SELECT sample_id, sum(token_end - token_start), any_value(length),
               count(*) FILTER (WHERE token_start = 0), min(token_start), max(token_end)
        FROM lineage WHERE kind = 'span' AND epoch = 0 GROUP BY 1 ORDER BY 1
        """
    ).fetchall()
    assert [r[0] for r in per_doc] == list(range(TOTAL))
    for sid, tokens, length, starts, lo, hi in per_doc:
        assert (tokens, starts, lo, hi) == (length, 1, 0, length), sid
    draws = con.execute(
        "SELECT count(*) FROM lineage WHERE kind = 'span' AND token_start = 0 "
        "AND value LIKE '{\"flip\": _}'"
    ).fetchone()
    assert draws == (TOTAL,)


def test_record_values_land_in_the_log(shards, root):
    source = ShardedSource(os.path.join(shards, "*"))

    def transform(record, ctx):
        flip = int(ctx.rng.integers(0, 1000))
        ctx.record(flip=flip, epoch=ctx.epoch)
        return {"id": record["id"], "flip": flip}

    loader = ledger.DataLoader(
        Stream(source, transform=transform),
        batch_size=5,
        seed=2,
        log=root,
        collate_fn=lambda items: items,
    )
    seen = {item["id"]: item["flip"] for b in loader for item in b}
    loader.state_dict()
    rows = (
        connect(root)
        .execute("SELECT sample_id, value FROM lineage WHERE kind = 'sample'")
        .fetchall()
    )
    assert {sid: json.loads(v) for sid, v in rows} == {
        sid: {"epoch": 0, "flip": flip} for sid, flip in seen.items()
    }


def test_resume_rereads_only_the_buffer_and_one_row_group(shards, root, monkeypatch):
    source = ShardedSource(os.path.join(shards, "*"))
    stream = Stream(source, shuffle_buffer=4)

    def make():
        return ledger.DataLoader(
            stream, batch_size=2, shuffle=True, seed=3, log=root, collate_fn=texts
        )

    loader = make()
    list(take(loader, 4))
    token = loader.state_dict()
    reads = []
    real_iter, real_read = _Source.iter_blocks, _Source.read

    def counting_iter(self, shard, start_row=0, **kw):
        for block in real_iter(self, shard, start_row, **kw):  # the rows of each block read
            reads.extend(("stream", shard) for _ in block)
            yield block

    def counting_read(self, ids, **kw):
        reads.extend(("random", int(i)) for i in ids)
        return real_read(self, ids, **kw)

    monkeypatch.setattr(_Source, "iter_blocks", counting_iter)
    monkeypatch.setattr(_Source, "read", counting_read)
    resumed = make()
    resumed.load_state_dict(token)
    next(iter(resumed))
    random_reads = [r for r in reads if r[0] == "random"]
    stream_reads = [r for r in reads if r[0] == "stream"]
    assert len(random_reads) == 4  # exactly the buffer's rows
    assert len(stream_reads) <= 2  # the next rows of the shard being read: one row group


def test_changed_file_contents_are_refused_naming_the_file(shards, root):
    source = ShardedSource(os.path.join(shards, "*"))
    loader = ledger.DataLoader(
        Stream(source, shuffle_buffer=2), batch_size=2, log=root, collate_fn=texts
    )
    list(take(loader, 2))
    token = loader.state_dict()
    path = os.path.join(shards, "part-1.parquet")
    table = pq.read_table(path)
    pq.write_table(
        table.set_column(0, "text", pa.array(["changed"] * len(table))), path, row_group_size=2
    )
    changed = ledger.DataLoader(
        Stream(ShardedSource(os.path.join(shards, "*")), shuffle_buffer=2),
        batch_size=2,
        log=root,
        collate_fn=texts,
    )
    with pytest.raises(ConfigMismatch, match=r"part-1\.parquet"):
        changed.load_state_dict(token)


def test_changed_file_list_is_refused_naming_the_file(shards, root):
    source = ShardedSource(os.path.join(shards, "*"))
    loader = ledger.DataLoader(Stream(source), batch_size=2, log=root, collate_fn=texts)
    list(take(loader, 1))
    token = loader.state_dict()
    os.remove(os.path.join(shards, "part-2.parquet"))
    fewer = ledger.DataLoader(
        Stream(ShardedSource(os.path.join(shards, "*"))), batch_size=2, log=root, collate_fn=texts
    )
    with pytest.raises(ConfigMismatch, match=r"part-2\.parquet") as info:
        fewer.load_state_dict(token)
    assert "part-3.jsonl" in str(info.value)  # what stands there now


def test_changed_buffer_is_refused(shards, root):
    source = ShardedSource(os.path.join(shards, "*"))
    loader = ledger.DataLoader(
        Stream(source, shuffle_buffer=2), batch_size=2, log=root, collate_fn=texts, num_workers=2
    )
    list(take(loader, 1))
    token = loader.state_dict()
    other = ledger.DataLoader(
        Stream(source, shuffle_buffer=3), batch_size=2, log=root, collate_fn=texts, num_workers=2
    )
    with pytest.raises(ConfigMismatch, match="shuffle_buffer=2"):
        other.load_state_dict(token)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize(
    "shapes",
    [
        [(2, 5), (0, 4)],  # workers, batches served before the next change
        [(3, 2), (1, 3), (2, 9), (0, 2)],  # several changes, some an epoch apart
        [(1, 7), (3, 1), (2, 1)],
    ],
)
def test_changed_num_workers_serves_each_sample_once_per_epoch(shards, root, packing, shapes):
    """Mid-epoch changes of num_workers, with buffers and packing remainders in flight;
    then 3 workers to the end."""
    source = ShardedSource(os.path.join(shards, "*"))
    stream = Stream(
        source,
        transform=tokenize if packing else None,
        shuffle_buffer=4,
        packer=Packer(seq_len=8) if packing else None,
    )

    def make(nw):
        return ledger.DataLoader(
            stream,
            batch_size=2,
            shuffle=True,
            seed=3,
            log=root,
            num_workers=nw,
            collate_fn=None if packing else texts,
        )

    token = None
    for workers, batches in shapes:
        loader = make(workers)
        if token is not None:
            loader.load_state_dict(token)
        list(take(loader, batches))
        token = loader.state_dict()
    third = make(3)
    third.load_state_dict(token)
    list(take(third, 3))
    inside = third.state_dict()  # a commit inside an epoch carried from the old shapes
    reference = list(take(third, 30))
    third.state_dict()
    # Same-shape resume inside the carried epoch is exact.
    again = make(3)
    again.load_state_dict(inside)
    from ledger.testing import batches_equal

    assert all(batches_equal(a, b) for a, b in zip(take(again, 30), reference, strict=True))
    # Exactly once per epoch across the three shapes, from the log.
    con = connect(root)
    last = con.execute("SELECT max(epoch) FROM lineage").fetchone()[0]
    assert last >= 2
    if packing:
        rows = con.execute(
            """
            SELECT epoch, sample_id, sum(token_end - token_start), any_value(length),
                   min(token_start), max(token_end)
            FROM lineage WHERE kind = 'span' AND epoch < ? GROUP BY 1, 2 ORDER BY 1, 2
            """,
            [last],
        ).fetchall()
        for epoch in range(last):
            docs = [r for r in rows if r[0] == epoch]
            assert [r[1] for r in docs] == list(range(TOTAL)), epoch
            for _, sid, tokens, length, lo, hi in docs:
                assert (tokens, lo, hi) == (length, 0, length), (epoch, sid)
    else:
        rows = con.execute(
            "SELECT epoch, count(*), count(DISTINCT sample_id) FROM lineage "
            "WHERE kind = 'sample' AND epoch < ? GROUP BY 1 ORDER BY 1",
            [last],
        ).fetchall()
        assert rows == [(e, TOTAL, TOTAL) for e in range(last)]


def test_missing_source_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no data file"):
        ShardedSource(str(tmp_path / "*.parquet"))
    (tmp_path / "_temporary").mkdir()
    with pytest.raises(FileNotFoundError, match=r"matches no data file \(only folders"):
        ShardedSource(str(tmp_path / "*"))
    with pytest.raises(FileNotFoundError, match="_temporary is a folder, not a data file"):
        ShardedSource(str(tmp_path / "_temporary"))


def test_a_glob_leaves_out_folders_and_an_empty_jsonl_shard_has_no_rows(tmp_path):
    """A glob over a job's output folder takes its data files, not its ``_temporary/``;
    a 0-byte JSONL shard is a shard of 0 rows, as a 0-row Parquet shard is."""
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text('{"text": "c"}\n')
    (tmp_path / "c.jsonl").write_bytes(b"")
    (tmp_path / "_temporary").mkdir()
    source = ShardedSource(str(tmp_path / "*"))
    assert [os.path.basename(f.path) for f in source.infos] == ["a.parquet", "b.jsonl", "c.jsonl"]
    assert [f.rows for f in source.infos] == [2, 1, 0]
    assert [r["text"] for r in source.read([0, 1, 2])] == ["a", "b", "c"]


def test_stream_rejects_drop_last(shards, root):
    with pytest.raises(ValueError, match="drop_last"):
        ledger.DataLoader(
            Stream(ShardedSource(os.path.join(shards, "*"))), batch_size=2, log=root, drop_last=True
        )


def test_transform_context_is_each_rows_own_even_when_reused(shards):
    """A worker hands the transform one context object again when nothing kept the last
    one; a transform that keeps it, its rng or its draws sees each row's own values."""
    from ledger.stream.sample import sample_loader

    kept = []

    def transform(record, ctx):
        value = int(ctx.rng.integers(0, 1 << 30)) if record["id"] % 2 else 0
        if record["id"] % 3 == 0:
            ctx.record(id=record["id"])
        if record["id"] % 4 == 0:
            kept.append((ctx, ctx.draws, ctx.sample_id, record["id"]))
        return value

    source = ShardedSource(os.path.join(shards, "*"))
    rows = source.read(range(TOTAL))
    reused = sample_loader(Stream(source, transform), 7, 2, per_sample_rng=False)
    got = [reused(sid, row) for sid, row in zip(range(TOTAL), rows, strict=True)]
    # The same rows, each through a loader of its own (a fresh context each).
    fresh = [
        sample_loader(Stream(source, transform), 7, 2, per_sample_rng=False)(sid, row)
        for sid, row in zip(range(TOTAL), rows, strict=True)
    ]
    assert got == fresh
    assert [d for _, d in got] == [
        json.dumps({"id": i}) if i % 3 == 0 else None for i in range(TOTAL)
    ]
    for ctx, draws, sid, i in kept:  # what it kept did not change under later rows
        assert ctx.sample_id == sid == i
        assert ctx.draws is draws and draws == ({"id": i} if i % 3 == 0 else {})


@pytest.mark.parametrize(
    "item",
    [
        *([], [5, 6], [5, True], [[1, 2], [3, 4]], [1, [2, 3]], np.arange(4, dtype=np.int32)),
        *((1, 2), [np.int32(3), 4], [1, 2.5], [2.5, 1], [True, False], [1, "a"], [1, 2**70]),
    ],
)
def test_packed_item_is_its_token_ids_then_eos(item):
    """The one-conversion path for a list of ints gives what token_ids gives, and
    refuses what it refuses."""
    from ledger.errors import UnsupportedArgument
    from ledger.stream.sample import _with_eos, token_ids

    try:
        want = [*token_ids(item, 3).astype(np.int64).tolist(), 9]
    except (UnsupportedArgument, ValueError) as e:
        with pytest.raises(type(e)):
            _with_eos(item, 9, 3)
        return
    tokens = _with_eos(item, 9, 3)
    assert tokens.dtype == np.int64 and tokens.ndim == 1
    assert tokens.tolist() == want


def test_a_list_of_exact_integers_is_its_tokens_whatever_numpy_would_promote_it_to():
    """Python ints with numpy integer scalars (np.uint64: numpy promotes the list to
    float64) are token ids as they are; a value beyond int64 is refused."""
    from ledger.errors import UnsupportedArgument
    from ledger.stream.sample import _with_eos

    tokens = _with_eos([1, np.uint64(2**63 - 1), np.int8(-3)], 9, 3)
    assert tokens.dtype == np.int64 and tokens.tolist() == [1, 2**63 - 1, -3, 9]
    with pytest.raises(UnsupportedArgument):
        _with_eos([1, np.uint64(2**63)], 9, 3)


@pytest.mark.parametrize("item", [[5, 6, 7], np.arange(4), np.arange(8)[::2], (1, 2), [[1], [2]]])
def test_a_packed_sample_holds_nothing_the_garbage_collector_tracks(item):
    """A packed sample waits in the shuffle buffer: no object the cyclic collector
    tracks (array.array, memoryview) lives on with its tokens and swells the oldest
    generation (full collections walk the whole process)."""
    import gc

    from ledger.stream.sample import _with_eos

    tokens = _with_eos(item, 9, 3)
    held: object = tokens
    while held is not None:  # the array and what it keeps alive: its base, and so on
        assert not gc.is_tracked(held), type(held)
        held = getattr(held, "base", None)
    assert tokens.tolist() == [*np.asarray(item).reshape(-1).tolist(), 9]


def test_materialize_refuses_a_dataset_of_another_kind_or_packer(tmp_path):
    """Re-creating a batch with a dataset that is not the run's kind, or a Stream with
    another packer, is refused naming the difference (it failed deep in a collate
    function, or gave another batch)."""
    from ledger.audit.queries import materialize
    from ledger.errors import UnsupportedArgument

    pq.write_table(pa.table({"text": [f"row {i} " + "x" * (i % 7) for i in range(30)]}),
                   tmp_path / "s.parquet")  # fmt: skip

    def tokens(row, ctx):
        return np.frombuffer(row["text"].encode(), np.uint8).astype(np.int64)

    def stream(packed):
        packer = Packer(seq_len=16) if packed else None
        return Stream(ShardedSource(str(tmp_path / "s.parquet")), transform=tokens, packer=packer)

    packed = str(tmp_path / "packed")
    loader = ledger.DataLoader(stream(True), batch_size=2, seed=1, log=packed)
    list(take(loader, 3))
    loader.state_dict()
    assert materialize(packed, 1, stream(True)).matches
    with pytest.raises(ConfigMismatch, match="packer"):
        materialize(packed, 1, stream(False))
    with pytest.raises(UnsupportedArgument, match=r"Stream, and a map-style"):
        materialize(packed, 1, list(range(30)))
    mapped = str(tmp_path / "map")
    loader = ledger.DataLoader(list(range(30)), batch_size=2, seed=1, log=mapped)
    list(take(loader, 3))
    loader.state_dict()
    with pytest.raises(UnsupportedArgument, match=r"map-style dataset, and a ledger\.stream"):
        materialize(mapped, 1, stream(False))
