"""The log itself: segments, journal, commit chain, attempts, abandoned branches."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Augmented
from hypothesis import given, settings
from hypothesis import strategies as st

import ledger
from ledger import manifest
from ledger.commits import default_head, lineage, list_commits
from ledger.digest import batch_digest
from ledger.errors import LogCorrupted
from ledger.journal import read_journal
from ledger.order import EpochOrder
from ledger.store import Store
from ledger.testing import assert_resume_exact, batches_equal, take


def _events(root):
    store = Store(root)
    rows = []
    for c in list_commits(store):
        for s in c.segments:
            rows.append(pq.read_table(os.path.join(root, s.path)).to_pylist())
    return [r for rs in rows for r in rs]


def test_events_record_exactly_what_was_consumed(root):
    loader = ledger.DataLoader(
        Augmented(10), batch_size=4, shuffle=True, seed=2, log=root, drop_last=True
    )
    seen = []
    for _ in range(2):
        for batch in loader:
            seen.append(batch["id"].tolist())
        loader.state_dict()
    events = _events(root)
    samples = [e for e in events if e["kind"] == "sample"]
    assert [e["sample_id"] for e in samples] == [i for b in seen for i in b]
    assert [e["batch"] for e in samples] == [b for b in range(4) for _ in range(4)]
    assert [e["position"] for e in samples] == [0, 1, 2, 3, 4, 5, 6, 7] * 2
    # drop_last: the tail positions 8, 9 of each epoch are logged as skips.
    skips = [(e["epoch"], e["position"], e["sample_id"]) for e in events if e["kind"] == "skip"]
    expected = [(ep, p, int(EpochOrder(10, 2, ep).sample_ids(p))) for ep in (0, 1) for p in (8, 9)]
    assert skips == expected
    assert {e["attempt"] for e in events} == {0} and {e["worker"] for e in events} == {-1}


def test_workers_are_recorded(root):
    loader = ledger.DataLoader(Augmented(16), batch_size=2, log=root, num_workers=2)
    list(loader)
    loader.state_dict()
    workers = [e["worker"] for e in _events(root) if e["kind"] == "sample"][::2]
    assert workers == [0, 1] * 4


def test_prefetched_batches_are_not_consumed(root):
    loader = ledger.DataLoader(
        Augmented(40), batch_size=2, log=root, num_workers=2, prefetch_factor=4
    )
    it = iter(loader)
    received = [next(it) for _ in range(3)]
    token = loader.state_dict()
    assert token["step"] == 3
    events = _events(root)
    assert [e["batch"] for e in events if e["kind"] == "sample"] == [0, 0, 1, 1, 2, 2]
    # One 'batch' event per consumed batch, holding the digest of what the loop received
    # in its own 32-byte column; `value` stays JSON (here: null).
    digests = [(e["batch"], e["digest"], e["value"]) for e in events if e["kind"] == "batch"]
    assert digests == [(b, bytes.fromhex(batch_digest(x)), None) for b, x in enumerate(received)]
    assert len(events) == 9


def test_digest_can_be_turned_off(root):
    loader = ledger.DataLoader(Augmented(8), batch_size=2, log=root, digest=False)
    list(loader)
    loader.state_dict()
    assert {e["kind"] for e in _events(root)} == {"sample"}


def test_resume_forms_an_abandoned_branch(root):
    def make():
        return ledger.DataLoader(Augmented(12), batch_size=3, shuffle=True, seed=4, log=root)

    a = make()
    it = iter(a)
    next(it)
    next(it)
    token2 = a.state_dict()  # commit at step 2
    next(it)
    a.state_dict()  # commit at step 3: will be abandoned
    b = make()
    b.load_state_dict(token2)
    list(take(b, 3))
    head = b.state_dict()  # step 5 of attempt 1, parent = step 2
    store = Store(root)
    commits = list_commits(store)
    assert [c.id for c in commits] == [
        "000000000002-0000",
        "000000000003-0000",
        "000000000005-0001",
    ]
    assert default_head(commits).id == head["commit"]
    assert [c.id for c in lineage(store, head["commit"])] == [
        "000000000002-0000",
        "000000000005-0001",
    ]
    attempts = sorted(os.listdir(os.path.join(root, "attempts")))
    assert attempts == ["0000.json", "0001.json"]
    with open(os.path.join(root, "attempts", "0001.json")) as f:
        meta = json.load(f)
    assert meta["parent"] == token2["commit"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), max_size=30).map(
        lambda moves: _chain_of(moves)
    )
)
def test_lineage_ranges_of_a_chain_are_those_its_commits_extend_one_by_one(chain):
    """``ranges_of`` (the audit's check of a walked chain, a few numpy passes) gives what
    each commit's marker records (``extend`` from its parent's), and ``check_chain``
    refuses the chain with a commit left out."""
    recorded = None
    for attempt, step in chain:
        recorded = manifest.extend(recorded, attempt, step)
    attempts, steps = [a for a, _ in chain], [s for _, s in chain]
    assert manifest.ranges_of(attempts, steps) == (recorded or ())
    manifest.check_chain("head", recorded, attempts, steps)
    manifest.check_chain("head", None, [], [])  # a marker without ranges: nothing to check
    if len(chain) > 1:
        with pytest.raises(LogCorrupted, match="parent links from commit head"):
            manifest.check_chain("head", recorded, attempts[1:], steps[1:])


def _chain_of(moves):
    """A chain's ``(attempt, step)``: attempts never decrease, steps always increase."""
    chain, attempt, step = [], 0, 0
    for more, gap in moves:
        attempt += more
        step += gap
        chain.append((attempt, step))
    return chain


def test_state_dict_is_idempotent_without_new_batches(root):
    loader = ledger.DataLoader(Augmented(12), batch_size=3, log=root)
    assert loader.state_dict()["commit"] == ""  # nothing consumed: no I/O commit
    list(take(loader, 2))
    t1 = loader.state_dict()
    t2 = loader.state_dict()
    assert t1 == t2
    # One marker, and its rank table in a folder of its own.
    assert os.listdir(os.path.join(root, "commits")) == [f"{t1['commit']}.json"]
    assert os.listdir(os.path.join(root, "ranks")) == [f"{t1['commit']}.ranks"]


def test_journal_holds_uncommitted_batches_and_tolerates_a_torn_tail(root):
    loader = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, log=root)
    it = iter(loader)
    next(it)
    token = loader.state_dict()
    consumed = [next(it)["id"].tolist() for _ in range(2)]
    path = os.path.join(root, "journal", "attempt=0", "rank=0.msgpack")
    with open(path, "rb") as f:
        data = f.read()
    header, chunks = read_journal(data)
    assert header["after_commit"] == token["commit"]
    # One record per batch: its samples and its content digest.
    assert [c.kind for c in chunks] == ["sample"] * 2
    assert [c.sample_ids.tolist() for c in chunks] == consumed
    assert [c.batch for c in chunks] == [1, 2]
    assert all(c.digest is not None and len(c.digest) == 32 for c in chunks)
    _, torn = read_journal(data[:-5])  # a crash mid-write: batch 2's record is torn
    assert [(c.kind, c.batch) for c in torn] == [("sample", 1)]
    assert [c.sample_ids.tolist() for c in torn] == consumed[:1]


@pytest.mark.parametrize("failure", ["raises", "short"])
def test_a_journal_that_cannot_be_written_warns_and_the_run_goes_on(root, monkeypatch, failure):
    """The journal is for forensics: a full local disk (writev raising ENOSPC, or writing
    part of a record) costs the records of those batches and one warning, not the
    batches. The journal is cut back to whole records, the batches are committed as
    usual, and a resume from that commit is exact (the loader's state never got ahead of
    its recorded events)."""
    import errno

    from ledger import journal as journal_module
    from ledger.journal import parse_journal

    def make():
        return ledger.DataLoader(Augmented(40), batch_size=4, shuffle=True, seed=2, log=root)

    reference = [b["id"].tolist() for b in take(make(), 9)]
    shutil.rmtree(root)
    loader = make()
    it = iter(loader)
    served = [next(it)["id"].tolist() for _ in range(3)]
    real = os.writev

    def full(fd, parts):
        if failure == "raises":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, [b"".join(bytes(p) for p in parts)[:7]])  # a short write

    monkeypatch.setattr(journal_module.os, "writev", full)
    with pytest.warns(RuntimeWarning, match="could not write the journal") as warned:
        served += [next(it)["id"].tolist() for _ in range(2)]
    assert len(warned) == 1  # once until the journal is written again
    monkeypatch.setattr(journal_module.os, "writev", real)
    served.append(next(it)["id"].tolist())
    path = os.path.join(root, "journal", "attempt=0", "rank=0.msgpack")
    with open(path, "rb") as f:
        contents = parse_journal(f.read())
    assert contents.unreadable == 0 and not contents.torn
    assert [c.batch for c in contents.chunks] == [0, 1, 2, 5]
    token = loader.state_dict()
    assert token["step"] == 6 and served == reference[:6]
    ids = [e["sample_id"] for e in _events(root) if e["kind"] == "sample"]
    assert ids == [i for b in served for i in b]
    resumed = make()
    resumed.load_state_dict(token)
    assert [b["id"].tolist() for b in take(resumed, 3)] == reference[6:9]


@pytest.mark.parametrize("kind", ["map", "stream", "packed"])
@pytest.mark.parametrize("during", ["record", "append"])
def test_an_interrupted_batch_recording_is_refused_until_a_resume(tmp_path, kind, during):
    """A KeyboardInterrupt that lands while a batch is being recorded (the pipeline's
    check and fold, the events' append) may leave a stream's buffers one batch past the
    loader's state: that loader then neither serves nor commits (a commit would pair a
    snapshot with another state) and a resume from the last checkpoint goes on exactly."""
    from conftest import packed_stream, text_shards

    from ledger.errors import LedgerError
    from ledger.log import Ledger

    root = str(tmp_path / "log")
    if kind != "map":
        shards = text_shards(tmp_path / "shards", 3, 6, "ab", 2)

    def make(log: str) -> ledger.DataLoader:
        if kind == "map":
            return ledger.DataLoader(Augmented(40), batch_size=4, shuffle=True, seed=4, log=log)
        if kind == "packed":
            return ledger.DataLoader(packed_stream(shards, 5), batch_size=2, seed=4, log=log)
        from ledger.stream import ShardedSource, Stream

        stream = Stream(ShardedSource(f"{shards}/*"), lambda r, c: r["text"], shuffle_buffer=5)
        return ledger.DataLoader(stream, batch_size=2, seed=4, log=log, collate_fn=list)

    reference = list(take(make(str(tmp_path / "reference")), 8))
    loader = make(root)
    loader._ensure_started()
    target = type(loader._pipeline) if during == "record" else Ledger
    name = "record" if during == "record" else "append"
    real = getattr(target, name)
    armed = []

    def interrupted(self, *args):
        out = real(self, *args)  # the batch folded (and, for append, its events kept)
        if armed:
            raise KeyboardInterrupt
        return out

    setattr(target, name, interrupted)
    try:
        it = iter(loader)
        served = [next(it) for _ in range(3)]
        token = loader.state_dict()
        served.append(next(it))
        armed.append(True)
        with pytest.raises(KeyboardInterrupt):
            next(it)
    finally:
        setattr(target, name, real)
    with pytest.raises(LedgerError, match="recording batch 4 was interrupted"):
        iter(loader)
    with pytest.raises(LedgerError, match="recording batch 4 was interrupted"):
        loader.state_dict()
    loader.load_state_dict(token)
    rest = list(take(loader, 5))
    assert batches_equal(served[:3] + rest, reference)


def test_stateful_with_distributed_checkpoint(root, tmp_path):
    def make():
        return ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, seed=9, log=root)

    reference = list(take(make(), 8))
    loader = make()
    list(take(loader, 3))
    dcp.save({"loader": loader}, checkpoint_id=str(tmp_path / "dcp"))
    resumed = make()
    dcp.load({"loader": resumed}, checkpoint_id=str(tmp_path / "dcp"))
    assert resumed.state.batch == 3
    rest = list(take(resumed, 5))
    assert all(batches_equal(a, b) for a, b in zip(rest, reference[3:], strict=True))


def test_checker_catches_a_loader_that_skips_a_batch(root):
    class Skipping(ledger.DataLoader):
        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            list(take(self, 1))  # loses one batch on resume

    def make():
        return Skipping(Augmented(20), batch_size=4, shuffle=True, log=root)

    with pytest.raises(AssertionError, match="differs from the uninterrupted run"):
        assert_resume_exact(make, batches=6)


def test_hf_style_dataset_with_getitems(root):
    class Rows:
        def __len__(self):
            return 9

        def __getitem__(self, i):
            return {"text": f"row {i}", "label": i % 2}

        def __getitems__(self, keys):
            return [self[k] for k in keys]

    loader = ledger.DataLoader(Rows(), batch_size=4, shuffle=True, log=root, rng="off")
    batches = list(loader)
    texts = [t for b in batches for t in b["text"]]
    assert sorted(texts) == sorted(f"row {i}" for i in range(9))
    assert torch.equal(
        batches[0]["label"], torch.tensor([int(t.split()[1]) % 2 for t in batches[0]["text"]])
    )


def test_bytes_per_event_near_information_content(root):
    n = 1 << 16
    loader = ledger.DataLoader(
        list(range(n)), batch_size=256, shuffle=True, seed=0, log=root, rng="off"
    )
    list(loader)
    loader.state_dict()
    size = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(os.path.join(root, "events"))
        for f in fs
    )
    # 16 bits of information per shuffled id, plus each batch's digest (32 random bytes
    # per 256 events); the other columns are near-free. Ids delta-encoded: 2.40 bytes.
    assert size / n < 1.10 * np.log2(n) / 8 + 32 / 256


def test_large_segments_store_sample_ids_as_byte_streams(root):
    n = 100_000
    loader = ledger.DataLoader(
        list(range(n)), batch_size=256, shuffle=True, seed=0, log=root, rng="off"
    )
    for i, _ in enumerate(loader, start=1):
        if i == 10:
            loader.state_dict()  # a segment of 2,570 events: delta-encoded ids are smaller
    loader.state_dict()  # 97,821 events
    found = {}
    for d, _, fs in os.walk(os.path.join(root, "events")):
        for f in fs:
            md = pq.ParquetFile(os.path.join(d, f)).metadata
            ids = [md.row_group(g).column(6) for g in range(md.num_row_groups)]
            assert {c.path_in_schema for c in ids} == {"sample_id"}
            found[md.num_rows] = (
                {e for c in ids for e in c.encodings} - {"RLE"},
                sum(c.total_compressed_size for c in ids),
            )
    assert sorted(found) == [2570, 97821]
    assert found[2570][0] == {"DELTA_BINARY_PACKED"}
    assert found[97821][0] == {"BYTE_STREAM_SPLIT"}
    # ~log2(N) bits per id (2.21 bytes here); delta-encoded, ~log2(2N) (2.29 bytes).
    assert found[97821][1] / 97821 < 1.085 * np.log2(n) / 8


def test_failed_commit_keeps_its_events_and_the_retry_loses_nothing(root, monkeypatch):
    from ledger.errors import StorageError

    loader = ledger.DataLoader(Augmented(20), batch_size=4, shuffle=True, seed=1, log=root)
    consumed = [b["id"].tolist() for b in take(loader, 2)]
    real = Store.write_atomic

    def failing(self, rel, data):
        raise StorageError(f"injected failure writing {rel}")

    monkeypatch.setattr(Store, "write_atomic", failing)
    with pytest.raises(StorageError, match="injected"):
        loader.state_dict()
    assert not os.path.exists(os.path.join(root, "commits")) or not os.listdir(
        os.path.join(root, "commits")
    )
    consumed += [b["id"].tolist() for b in take(loader, 1)]
    monkeypatch.setattr(Store, "write_atomic", real)
    token = loader.state_dict()
    assert token["step"] == 3
    ids = [e["sample_id"] for e in _events(root) if e["kind"] == "sample"]
    assert ids == [i for b in consumed for i in b]


def test_a_full_disk_fails_a_commit_cleanly_and_the_retry_resumes_exactly(root, monkeypatch):
    """ENOSPC in the middle of a segment's write: StorageError, no partial temporary file
    left to hold the space a retry needs, nothing committed lost; once there is space the
    retried commit holds every batch and resumes exactly."""
    import errno

    from ledger import store as store_module
    from ledger.errors import StorageError

    def make():
        return ledger.DataLoader(Augmented(40), batch_size=4, shuffle=True, seed=1, log=root)

    loader = make()
    consumed = [b["id"].tolist() for b in take(loader, 2)]
    first = loader.state_dict()
    consumed += [b["id"].tolist() for b in take(loader, 2)]
    real_write = os.write
    written = []

    def full_disk(fd, data):  # the first chunk lands, then the device is full
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(len(data))
        return real_write(fd, bytes(data)[: max(1, len(data) // 2)])

    monkeypatch.setattr(store_module.os, "write", full_disk)
    with pytest.raises(StorageError, match="No space left on device; nothing was replaced"):
        loader.state_dict()
    monkeypatch.setattr(store_module.os, "write", real_write)
    leftovers = [f for _, _, fs in os.walk(root) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []
    assert [c.id for c in list_commits(Store(root))] == [first["commit"]]
    token = loader.state_dict()
    assert token["step"] == 4
    ids = [e["sample_id"] for e in _events(root) if e["kind"] == "sample"]
    assert ids == [i for b in consumed for i in b]
    after = [b["id"].tolist() for b in take(loader, 3)]
    resumed = make()
    resumed.load_state_dict(token)
    assert [b["id"].tolist() for b in take(resumed, 3)] == after


def test_resume_from_a_segment_of_many_row_groups(root):
    from ledger.segments import ROW_GROUP_ROWS

    n = ROW_GROUP_ROWS * 3 + 1000
    reference = ledger.DataLoader(
        list(range(n)), batch_size=1000, shuffle=True, log=root + "r", rng="off"
    )
    expected = [b.tolist() for b in take(reference, 200)]
    loader = ledger.DataLoader(list(range(n)), batch_size=1000, shuffle=True, log=root, rng="off")
    list(take(loader, 199))  # crosses the epoch end (198 batches) into epoch 1
    token = loader.state_dict()
    segment = next(
        os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "events")) for f in fs
    )
    assert pq.ParquetFile(segment).num_row_groups >= 3
    resumed = ledger.DataLoader(list(range(n)), batch_size=1000, shuffle=True, log=root, rng="off")
    resumed.load_state_dict(token)
    assert resumed.epoch == 1 and resumed.state.epoch_batch == 1
    assert next(iter(resumed)).tolist() == expected[199]


def test_journal_records_of_batches_and_spans_match_the_general_encoding(tmp_path):
    """The per-batch fast paths of ``Journal._record`` write the same bytes as the
    general one (:func:`ledger.journal._extras`), and read back as written."""
    import msgpack

    from ledger.journal import Journal, _extras, _raw, parse_journal
    from ledger.schema import SAMPLE, SPAN, EventChunk

    journal = Journal(str(tmp_path / "j.msgpack"), 0, 0)
    ids = np.arange(5, dtype=np.int64) * 7
    spans = np.asfortranarray(np.arange(15, dtype=np.int64).reshape(5, 3))
    chunks = [
        EventChunk(SAMPLE, 1, 2, 3, 0, ids, positions=ids + 1, digest=b"d" * 32),
        EventChunk(SAMPLE, 1, 2, 3, 0, ids, positions=ids[::-1], values=["{}"] * 5),
        EventChunk(
            SPAN, 1, 2, 3, 0, ids, positions=ids + 1, token_start=spans[:, 0],
            token_end=spans[:, 1], length=spans[:, 2],
        ),
    ]  # fmt: skip
    for chunk in chunks:
        general = msgpack.packb(
            [
                chunk.kind, chunk.epoch, chunk.batch, chunk.worker, chunk.position,
                _raw(chunk.sample_ids), _extras(chunk), chunk.digest,
            ],
            use_bin_type=True,
        )  # fmt: skip
        assert journal._record(chunk)[1] == general
        journal.append(chunk)
    journal.close()
    data = (tmp_path / "j.msgpack").read_bytes()
    # Every frame (the header's too) carries zlib's CRC-32 of its payload, whichever
    # library computed it: a reader with plain zlib checks it.
    at, frames = 0, 0
    while at < len(data):
        magic, length, crc = struct.unpack_from("<4sII", data, at)
        assert magic == b"\xffLJ\xfe" and zlib.crc32(data[at + 12 : at + 12 + length]) == crc
        at, frames = at + 12 + length, frames + 1
    assert frames == 1 + len(chunks)
    back = parse_journal(data).chunks
    assert [c.positions.tolist() for c in back] == [c.positions.tolist() for c in chunks]
    assert back[2].token_end.tolist() == spans[:, 1].tolist()
    assert back[1].values == ["{}"] * 5 and back[0].digest == b"d" * 32


def test_a_map_style_batch_is_journaled_as_a_count_of_its_orders_positions(tmp_path, monkeypatch):
    """A record gives a map-style batch's ids as ``[count, n, seed, shuffle]`` (the ids
    are the epoch's order at consecutive positions): its size does not grow with the
    batch, it reads back as the ids served, and a record whose order is wrong or whose
    positions run past the order's end is skipped and counted, not read as other ids.
    Each record carries its order: a damaged header loses no record."""
    import msgpack

    import ledger.journal as journal_module
    from ledger.journal import _FRAME, parse_journal

    def journal(batch_size):
        root = str(tmp_path / f"log-{batch_size}")
        loader = ledger.DataLoader(
            Augmented(1000), batch_size=batch_size, shuffle=True, seed=11, log=root
        )
        served = [b["id"].tolist() for b in take(loader, 3)]
        path = os.path.join(root, "journal", "attempt=0", "rank=0.msgpack")
        with open(path, "rb") as f:
            return f.read(), served

    small, _ = journal(4)
    data, served = journal(256)
    # Three records and a header, ~70 bytes each (bytes ids: 3 x 2 KiB at batch 256).
    assert len(data) < 400 and len(data) < len(small) + 32
    contents = parse_journal(data)
    assert [c.sample_ids.tolist() for c in contents.chunks] == served
    order = EpochOrder(1000, 11, 0, True)
    assert served[1] == order.sample_ids(np.arange(256, 512)).tolist()

    frames, at = [], 0
    while at < len(data):
        _, length, _ = _FRAME.unpack_from(data, at)
        frames.append(msgpack.unpackb(data[at + 12 : at + 12 + length]))
        at += 12 + length
    assert frames[2][5] == [256, 1000, 11, True]

    def framed(records):
        out = b""
        for rec in records:
            payload = msgpack.packb(rec, use_bin_type=True)
            out += _FRAME.pack(b"\xffLJ\xfe", len(payload), zlib.crc32(payload)) + payload
        return out

    bad = [
        [*frames[1][:5], [256, 1000, 11], *frames[1][6:]],  # no shuffle flag
        [*frames[1][:5], [256, 1000, 11, 1], *frames[1][6:]],  # not a bool
        [*frames[1][:4], 900, [256, 1000, 11, True], *frames[1][6:]],  # past the end
        [*frames[1][:5], [0, 1000, 11, True], *frames[1][6:]],  # no ids
        [*frames[1][:5], [256, 1000, 11, True], {"positions": b"\0" * 8}, frames[1][7]],
        [*frames[1][:4], 0, [1 << 40, 1 << 40, 11, True], *frames[1][6:]],  # 8 TiB of ids
    ]
    mixed = parse_journal(framed([frames[0], *bad, frames[2]]))
    assert mixed.unreadable == len(bad)
    assert [c.sample_ids.tolist() for c in mixed.chunks] == [served[1]]
    headless = parse_journal(framed([["not", "a", "header"], *frames[1:]]))
    assert headless.header is None
    assert [c.sample_ids.tolist() for c in headless.chunks] == served
    # The ids a journal gives by count are bounded in all, not per record.
    monkeypatch.setattr(journal_module, "_COUNTED_IDS", 600)
    bounded = parse_journal(data)
    assert bounded.unreadable == 1 and len(bounded.chunks) == 2


def test_a_background_thread_is_one_per_name_and_per_process(monkeypatch):
    """``ledger.store.background``: the same executor for a name within a process, another
    for another name, and a new one in a forked child (which inherits no threads)."""
    import threading

    from ledger.store import background

    checksum = background("checksum")
    assert background("checksum") is checksum
    catalog = background("catalog")
    assert catalog is not checksum
    names = {
        pool.submit(lambda: threading.current_thread().name).result()
        for pool in (checksum, catalog)
    }
    assert {name.rsplit("_", 1)[0] for name in names} == {"ledger-checksum", "ledger-catalog"}
    monkeypatch.setattr(os, "getpid", lambda: -1)  # what a forked child's pid looks like here
    assert background("checksum") is not checksum
