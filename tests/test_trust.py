"""A gate you can trust: damaged logs, stray files and hostile tokens give typed answers.

The corruption matrix damages every kind of file of a real log (run.json, an attempt
record, a commit marker, a segment, a journal) in five ways and runs every command on it:
the only outcomes allowed are a result, a failed check (exit 3) or one ``Error:`` line
(exit 1) naming the file, and for the library a :class:`ledger.errors.LedgerError`.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner, Result
from conftest import Augmented, rewrite_run

import ledger
from ledger.audit import summarize
from ledger.audit.checks import CheckResult, check, verify
from ledger.audit.queries import reconstruct, show, where
from ledger.audit.scan import check_segment
from ledger.cli import main
from ledger.errors import LedgerError, LogCorrupted, TokenError
from ledger.journal import parse_journal
from ledger.ranks import SegmentRef
from ledger.store import Store, sha256
from ledger.testing import take

# One worker runs this module whole (pytest-xdist --dist loadgroup): its module-scoped
# fixture is built once.
pytestmark = pytest.mark.xdist_group("test_trust")

N, BATCH = 24, 3


def _write_log(root: str) -> list[torch.Tensor]:
    """A map-style run: commits at batches 2 and 4, then two uncommitted batches."""
    loader = ledger.DataLoader(Augmented(N), batch_size=BATCH, shuffle=True, seed=3, log=root)
    it = iter(loader)
    for _ in range(2):
        next(it)
    loader.state_dict()
    for _ in range(2):
        next(it)
    loader.state_dict()
    return [next(it)["id"] for _ in range(2)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("pristine") / "log")
    _write_log(root)
    return root


FILES = {
    "run": "run.json",
    "attempt": "attempts/0000.json",
    "marker": "commits/000000000004-0000.json",
    "ranks": "ranks/000000000004-0000.ranks",
    "segment": "events/attempt=0/rank=0/seg-000000000004.parquet",
    "journal": "journal/attempt=0/rank=0.msgpack",
}


def _damage(path: str, how: str) -> None:
    data = Path(path).read_bytes()
    if how == "delete":
        os.unlink(path)
        return
    if how == "flip":
        i = len(data) // 2
        data = data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :]
    elif how == "truncate":
        data = data[: len(data) * 2 // 3]
    elif how == "empty":
        data = b""
    elif how == "append":
        data = data + b"\x00garbage\xff" * 3
    Path(path).write_bytes(data)


COMMANDS = {
    "audit": ["audit"],
    "check": ["audit", "--check", "coverage", "--check", "duplicates", "--format", "csv"],
    "verify": ["verify", "--format", "csv"],
    "where": ["where", "--sample", "1"],
    "show": ["show", "--batch", "3"],
    "reconstruct": ["reconstruct", "--commit", "000000000004-0000", "--out", "{out}"],
    "sql": ["audit", "--sql", "SELECT count(*) FROM lineage"],
    "report": ["report", "--out", "{html}"],
}


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "empty", "append"])
@pytest.mark.parametrize("kind", sorted(FILES))
def test_corruption_matrix(pristine: str, tmp_path: Path, kind: str, how: str) -> None:
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    _damage(os.path.join(root, FILES[kind]), how)
    for name, args in COMMANDS.items():
        argv = [a.format(out=tmp_path / "out.parquet", html=tmp_path / "r.html") for a in args]
        result = _cli(argv[0], root, *argv[1:])
        where_ = f"{kind}/{how}: ledger {' '.join(argv)}"
        # Only a result, a failed check or one clean Error: line; never a traceback.
        assert result.exit_code in (0, 1, 3), (where_, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            where_,
            result.exception,
        )
        if result.exit_code == 1:
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("Error: "), (where_, result.stderr)
            assert "unexpected" not in lines[0], (where_, lines[0])
        if kind == "segment" and name in ("audit", "check", "verify", "reconstruct", "report"):
            assert result.exit_code != 0, (where_, "a damaged segment went unnoticed")
            assert "seg-000000000004.parquet" in result.output, (where_, result.output)
        if kind == "journal" and name in ("audit", "check", "verify"):
            assert result.exit_code in (0, 3), (where_, result.output)  # tolerated
    # The library raises only ledger's errors.
    calls = [
        lambda: summarize(root),
        lambda: check(root),
        lambda: verify(root),
        lambda: where(root, 1),
        lambda: show(root, 3),
        lambda: reconstruct(root, "000000000004-0000", tmp_path / "lib.parquet"),
    ]
    for call in calls:
        with contextlib.suppress(LedgerError):
            call()
    # Resuming raises a typed error or resumes.
    token = {
        "version": 1, "root": root, "run_id": _run_id(pristine), "commit": "000000000004-0000",
        "attempt": 0, "world_size": 1, "step": 4,
    }  # fmt: skip
    loader = ledger.DataLoader(Augmented(N), batch_size=BATCH, shuffle=True, seed=3, log=root)
    try:
        loader.load_state_dict(token)
        next(iter(loader))
    except LedgerError:
        pass


def _run_id(root: str) -> str:
    return str(json.loads(Path(root, "run.json").read_text())["run_id"])


def test_a_flipped_segment_byte_is_caught_by_every_reading_command(pristine, tmp_path):
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    seg = os.path.join(root, FILES["segment"])
    _damage(seg, "flip")
    assert _cli("audit", root).exit_code == 1
    checked = _cli("audit", root, "--check", "coverage", "--format", "csv")
    assert checked.exit_code == 3 and "sha256" in checked.output
    with pytest.raises(LogCorrupted, match=r"seg-000000000004\.parquet"):
        summarize(root)
    with pytest.raises(LogCorrupted, match=r"seg-000000000004\.parquet"):
        where(root, 1)


def test_stray_files_break_nothing(pristine, tmp_path):
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    for rel in (
        "attempts/abc.json", "attempts/notes.txt", "commits/README", "commits/x-y.json",
        "journal/attempt=x/rank=y.msgpack", "journal/attempt=0/notes.msgpack",
        "events/attempt=0/rank=0/notes.txt", "events/README.md", "stray.txt",
    ):  # fmt: skip
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        Path(root, rel).write_text("not ledger's")
    # Folders named like records (a stray copy, an unpacked archive) are not records.
    for rel in ("commits/000000000050-0000.json", "attempts/0007.json", "compactions/x.json"):
        os.makedirs(os.path.join(root, rel))
    for args in (
        ["audit"],
        ["verify"],
        ["audit", "--check", "coverage"],
        ["where", "--sample", "1"],
    ):
        result = _cli(args[0], root, *args[1:])
        assert result.exit_code == 0, (args, result.output)
    token = {
        "version": 1, "root": root, "run_id": _run_id(root), "commit": "000000000004-0000",
        "attempt": 0, "world_size": 1, "step": 4,
    }  # fmt: skip
    loader = ledger.DataLoader(Augmented(N), batch_size=BATCH, shuffle=True, seed=3, log=root)
    loader.load_state_dict(token)
    assert len(list(take(loader, 2))) == 2
    assert sorted(os.listdir(os.path.join(root, "attempts")))[:2] == ["0000.json", "0001.json"]


def test_a_segment_replaced_by_a_folder_is_a_missing_segment(pristine, tmp_path):
    """A folder (or a loop of links) where a segment should be holds no segment: the
    checks fail naming it (exit 3), and readers raise ``LogCorrupted``, as for a missing
    file, not a storage error."""
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    seg = os.path.join(root, FILES["segment"])
    os.remove(seg)
    os.makedirs(seg)
    result = _cli("verify", root, "--format", "csv")
    assert result.exit_code == 3, result.output
    assert "seg-000000000004.parquet (commit 000000000004-0000) is missing" in result.output
    with pytest.raises(LogCorrupted, match=r"seg-000000000004\.parquet.* is missing"):
        summarize(root)


def test_run_json_without_config_is_named(pristine, tmp_path):
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    run = json.loads(Path(root, "run.json").read_text())
    del run["config"]
    Path(root, "run.json").write_text(json.dumps(run))
    loader = ledger.DataLoader(Augmented(N), batch_size=BATCH, shuffle=True, seed=3, log=root)
    token = {
        "version": 1, "root": root, "run_id": run["run_id"], "commit": "000000000004-0000",
        "attempt": 0, "world_size": 1, "step": 4,
    }  # fmt: skip
    with pytest.raises(LogCorrupted, match=r"run\.json: field 'config' is missing"):
        loader.load_state_dict(token)
    v = verify(root)
    assert not v.ok and "field 'config' is missing" in v.results[0].detail


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"version": "1"}, "token version '1'"),
        ({"root": None}, "field 'root' is None"),
        ({"commit": ["x"]}, "field 'commit'"),
        ({"step": True}, "field 'step' is True"),
        ({"world_size": 0}, "field 'world_size' is 0"),
        ({"commit": "../../etc"}, "not a commit id"),
    ],
)
def test_a_mangled_token_is_a_token_error(pristine, tmp_path, change, match):
    token = {
        "version": 1, "root": pristine, "run_id": _run_id(pristine), "commit": "000000000004-0000",
        "attempt": 0, "world_size": 1, "step": 4, **change,
    }  # fmt: skip
    loader = ledger.DataLoader(Augmented(N), batch_size=BATCH, log=str(tmp_path / "other"))
    if change.get("commit") == "../../etc":
        loader = ledger.DataLoader(
            Augmented(N), batch_size=BATCH, shuffle=True, seed=3, log=pristine
        )
        with pytest.raises(LedgerError, match=match):
            loader.load_state_dict(token)
        return
    with pytest.raises(TokenError, match=match):
        loader.load_state_dict(token)


def test_damaged_journal_records_are_skipped_and_counted(pristine, tmp_path):
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    path = os.path.join(root, FILES["journal"])
    data = Path(path).read_bytes()
    intact = parse_journal(data)
    # One record per batch: its samples and its digest.
    assert intact.unreadable == 0 and [c.batch for c in intact.chunks] == [4, 5]
    # Damage one byte inside batch 4's sample record (its digest: a map-style record
    # gives its ids as a count of the order's positions).
    i = data.index(intact.chunks[0].digest)
    damaged = data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :]
    Path(path).write_bytes(damaged)
    found = parse_journal(damaged)
    assert found.unreadable == 1
    assert [(c.kind, c.batch) for c in found.chunks] == [("sample", 5)]
    s = summarize(root)
    assert s.unreadable_journal_records == 1
    assert s.attempts[0].uncommitted_batches == 1  # batch 5 only: batch 4's ids are lost
    out = _cli("audit", root)
    assert out.exit_code == 0 and "1 journal records unreadable" in out.stdout


def test_journal_parse_never_raises_on_any_prefix_or_flip(pristine):
    data = Path(pristine, FILES["journal"]).read_bytes()
    for cut in range(len(data) + 1):
        parse_journal(data[:cut])
    for i in range(len(data)):
        flipped = parse_journal(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
        assert flipped.unreadable <= 2


def test_glob_finds_the_files_the_matrix_damages(pristine):
    for rel in FILES.values():
        assert glob.glob(os.path.join(pristine, rel)), rel


def test_report_and_coverage_check_share_one_finished_epoch() -> None:
    from ledger.audit.checks import coverage
    from ledger.audit.summary import (
        EpochSummary,
        RankSummary,
        Summary,
        epoch_status,
        finished_epochs,
    )

    # Two ranks of a stream: rank 0 is in epoch 1, rank 1 still in epoch 0.
    epoch0 = EpochSummary(0, 7, 7, 0.7, 0, 0, 0, 7)
    s = Summary(
        "r", 10, (), 1, "h", (epoch0,), 0, 0, None,
        ranks=(RankSummary(0, 1, 0, 4, 8, 0), RankSummary(1, 0, 3, 3, 7, 1)),
    )  # fmt: skip
    assert finished_epochs(s) == 0
    assert coverage(s).ok
    assert epoch_status(s, epoch0) == "in progress"  # the report does not flag it red
    done = Summary(
        "r", 10, (), 1, "h", (epoch0,), 0, 0, None,
        ranks=(RankSummary(0, 1, 0, 4, 8, 0), RankSummary(1, 1, 0, 4, 7, 1)),
    )  # fmt: skip
    assert not coverage(done).ok and epoch_status(done, epoch0) == "incomplete"


DATASET_PY = '''
import torch


class Data:
    """Item i is a tensor of i; the ids in ``changed`` read back altered."""

    def __init__(self, n=24, changed=()):
        self.n, self.changed = n, set(changed)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, 1 if i in self.changed else 0]) + torch.rand(2)
'''


def _data_module(tmp_path: Path):
    import importlib.util

    path = tmp_path / "data_mod.py"
    path.write_text(DATASET_PY)
    spec = importlib.util.spec_from_file_location("data_mod", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module.Data


def test_verify_data_on_resume_catches_changed_content(tmp_path):
    from ledger.errors import ConfigMismatch

    path, Data = _data_module(tmp_path)
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Data(), batch_size=BATCH, shuffle=True, seed=1, log=root)
    list(take(loader, 4))
    token = loader.state_dict()
    last = show(root, 3).sample_ids.tolist()
    earlier = show(root, 0).sample_ids.tolist()

    def resume(changed, verify_data=True):
        again = ledger.DataLoader(
            Data(changed=changed), batch_size=BATCH, shuffle=True, seed=1, log=root,
            verify_data=verify_data,
        )  # fmt: skip
        again.load_state_dict(token)
        return again

    with pytest.raises(ConfigMismatch, match="dataset content") as e:
        resume([last[1]])
    assert e.value.field == "dataset content" and "Batch 3 of rank 0" in str(e.value)
    resume([last[1]], verify_data=False)  # the option is what reads the batch again
    resume([earlier[0]])  # one batch of reads: only the last committed batch is compared
    assert len(list(take(resume([]), 2))) == 2

    # `ledger verify --data` compares every batch of a range.
    base = ["verify", root, "--data", "--dataset", f"{path}:Data", "--format", "csv"]
    ok = _cli(*base)
    assert ok.exit_code == 0 and "data,True,4 batches of rank 0 re-created" in ok.stdout, ok.output
    kwargs = json.dumps({"changed": [earlier[0]]})
    bad = _cli(*base, "--dataset-kwargs", kwargs)
    assert bad.exit_code == 3, bad.output
    assert "1 of 4 batches of rank 0 re-created from the dataset differ" in bad.stdout
    assert "batches 0" in bad.stdout
    assert _cli(*base, "--dataset-kwargs", kwargs, "--batches", "1:4").exit_code == 0
    usage = _cli(*base, "--batches", "4:1")
    assert usage.exit_code == 2 and "START:STOP" in usage.output


@pytest.mark.parametrize("workers", [0, 2])
def test_a_changed_stream_row_is_caught_where_it_is_read_again(tmp_path, workers):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ledger.errors import ConfigMismatch
    from ledger.stream import ShardedSource, Stream

    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(2):
        ids = list(range(s * 12, s * 12 + 12))
        # Uncompressed and without statistics: an edit of a value leaves the footer as it was.
        pq.write_table(
            pa.table({"id": ids, "text": [f"row {i:03d}" for i in ids]}),
            shards / f"s{s}.parquet", row_group_size=4, compression="NONE",
            write_statistics=False,
        )  # fmt: skip
    root = str(tmp_path / "log")

    def make():
        source = ShardedSource(str(shards / "*.parquet"))
        return ledger.DataLoader(
            Stream(source, shuffle_buffer=5), batch_size=2, shuffle=True, seed=2, log=root,
            num_workers=workers, collate_fn=lambda rows: [r["text"] for r in rows],
        )  # fmt: skip

    loader = make()
    list(take(loader, 3))
    token = loader.state_dict()
    assert os.listdir(os.path.join(root, "data", "rowgroups"))  # recorded when first read
    fresh = make()
    fresh.load_state_dict(token)
    expected = list(take(fresh, 2))
    for path in shards.iterdir():  # the same bytes count, another value in every row
        data = path.read_bytes()
        footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
        path.write_bytes(data[:footer].replace(b"row ", b"ROW ") + data[footer:])
    with pytest.raises(ConfigMismatch, match=r"s[01]\.parquet row group \d+") as e:
        resumed = make()
        resumed.load_state_dict(token)  # the footers still match the run's fingerprint
        list(take(resumed, 2))
    assert "holds other rows than when this run first read it" in str(e.value)
    assert expected and all(t.startswith("row ") for b in expected for t in b)


@pytest.mark.parametrize(
    ("source", "named"),
    [
        (None, "not a list of shard fingerprints"),
        ([7], "source[0]"),
        ([{}], "field 'path'"),
        ([{"path": "p", "size": -1, "rows": 6, "digest": "d"}], "field 'size'"),
        ([{"path": "p", "size": 1, "rows": "6", "digest": "d"}], "field 'rows'"),
    ],
)
def test_a_mangled_source_fingerprint_is_named_on_resume(tmp_path, source, named):
    """The shard fingerprint ``run.json`` records is checked before it is compared: a
    mangled one is :class:`LogCorrupted` naming the entry (before: TypeError and KeyError
    out of ``load_state_dict``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ledger.errors import LogCorrupted
    from ledger.stream import ShardedSource, Stream

    pq.write_table(pa.table({"text": [f"row {i}" for i in range(6)]}), tmp_path / "s.parquet")
    root = str(tmp_path / "log")

    def make():
        return ledger.DataLoader(
            Stream(ShardedSource(str(tmp_path / "s.parquet")), shuffle_buffer=2),
            batch_size=2, seed=2, log=root, collate_fn=lambda rows: [r["text"] for r in rows],
        )  # fmt: skip

    loader = make()
    list(take(loader, 1))
    token = loader.state_dict()
    # A log begun before attempt records named run.json's SHA-256 (with it, any edit of
    # run.json is refused first: test_an_edited_run_json_is_refused_by_every_reader).
    rewrite_run(root, lambda run: run["config"].update(source=source), begun_before=True)
    with pytest.raises(LogCorrupted, match=r"run\.json, config, source") as e:
        make().load_state_dict(token)
    assert named in str(e.value)


def test_row_group_digests_are_xxh3_and_a_run_s_older_sha256_ones_are_still_checked(tmp_path):
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq
    import xxhash

    from ledger.errors import ConfigMismatch
    from ledger.store import Store
    from ledger.stream import ShardedSource

    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"id": list(range(8))}), path, row_group_size=4)

    def ipc(g):
        sink = pa.BufferOutputStream()
        table = pq.ParquetFile(path).read_row_group(g)
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return sink.getvalue()

    source = ShardedSource(str(path))
    source.record_digests(Store(str(tmp_path / "new")))
    assert [r["id"] for r in source.read([1, 5])] == [1, 5]
    folder = tmp_path / "new" / "data" / "rowgroups" / "shard=0"
    assert sorted(os.listdir(folder)) == ["0.xxh3-128", "1.xxh3-128"]
    assert (folder / "1.xxh3-128").read_text() == xxhash.xxh3_128(ipc(1)).hexdigest()
    # A run begun before recorded SHA-256 digests: they are checked as they are.
    old = tmp_path / "old" / "data" / "rowgroups" / "shard=0"
    old.mkdir(parents=True)
    (old / "0.sha256").write_text(hashlib.sha256(ipc(0)).hexdigest())
    (old / "1.sha256").write_text(hashlib.sha256(ipc(0)).hexdigest())  # not group 1's rows
    source = ShardedSource(str(path))
    source.record_digests(Store(str(tmp_path / "old")))
    assert source.read([2])[0]["id"] == 2
    with pytest.raises(ConfigMismatch, match=r"s\.parquet row group 1"):
        source.read([5])
    assert sorted(os.listdir(old)) == ["0.sha256", "1.sha256"]


def test_a_damaged_row_group_record_is_a_damaged_log_not_changed_data(tmp_path):
    """A row-group digest record that holds no digest is the log's damage, named as such
    by the source and by ``verify``; an empty one (written without fsync, so a power loss
    can leave it so) is recorded again by the next read, and ``verify`` passes it."""
    from ledger.store import Store
    from ledger.stream import ShardedSource, Stream

    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"id": list(range(8))}), path, row_group_size=4)
    root = tmp_path / "log"
    loader = ledger.DataLoader(
        Stream(ShardedSource(str(path)), shuffle_buffer=2), batch_size=2,
        seed=0, log=str(root), collate_fn=lambda rows: [r["id"] for r in rows],
    )  # fmt: skip
    list(loader)
    loader.state_dict()
    folder = root / "data" / "rowgroups" / "shard=0"
    recorded = (folder / "1.xxh3-128").read_text()
    assert verify(str(root)).results[-1] == CheckResult(
        "rowgroups", True, "2 row-group digest records hold digests"
    )

    (folder / "1.xxh3-128").write_text("")  # a power loss after an unsynced write
    found = verify(str(root)).results[-1]
    assert found.ok and "1 empty" in found.detail
    source = ShardedSource(str(path))
    source.record_digests(Store(str(root)))
    assert source.read([5])[0]["id"] == 5
    assert (folder / "1.xxh3-128").read_text() == recorded  # recorded again

    (folder / "1.xxh3-128").write_text("not a digest\n")
    found = verify(str(root)).results[-1]
    assert not found.ok and "1.xxh3-128 does not hold a xxh3-128 digest" in found.detail
    source = ShardedSource(str(path))
    source.record_digests(Store(str(root)))
    with pytest.raises(LogCorrupted, match=r"1\.xxh3-128 does not hold a xxh3-128 digest"):
        source.read([5])


def test_verify_names_each_damaged_segment_among_many(tmp_path):
    """70 segments (more than one task of 64, each read and checked as one table):
    ``verify`` names each fault in its own words, in the markers' order: altered bytes,
    a missing file, a truncated one in the second task."""
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(Augmented(400), batch_size=2, shuffle=True, seed=3, log=root)
    it = iter(loader)
    for _ in range(70):
        next(it)
        loader.state_dict()
    clean = verify(root)
    assert clean.ok and clean.segments == 70
    assert clean.results[2].detail == "70 segments match their markers (210 events)"
    seg = "events/attempt=0/rank=0/seg-{:012d}.parquet"
    size = os.path.getsize(os.path.join(root, seg.format(66)))
    _damage(os.path.join(root, seg.format(10)), "flip")
    _damage(os.path.join(root, seg.format(40)), "delete")
    _damage(os.path.join(root, seg.format(66)), "truncate")
    damaged = verify(root)
    assert [(r.check, r.ok) for r in damaged.results] == [
        ("markers", True), ("chain", True), ("segments", False), ("duplicates", False),
        ("orphans", True), ("manifest", True),
    ]  # fmt: skip
    assert damaged.results[2].detail == (
        f"3 bad: {seg.format(10)} (commit 000000000010-0000) has another SHA-256 than its "
        f"marker; {seg.format(40)} (commit 000000000040-0000) is missing; {seg.format(66)} "
        f"(commit 000000000066-0000) has {size * 2 // 3} bytes, the marker says {size}"
    )
    assert damaged.results[3].detail == "not checked: the log is damaged"


def test_verify_names_a_segment_of_another_attempt_or_rank(pristine):
    """A segment whose bytes match its marker but whose rows are another attempt's or
    rank's (its Parquet statistics say so) is named, with what it holds."""
    store = Store(pristine)
    seg = FILES["segment"]
    data = store.read_bytes(seg)
    rows = pq.ParquetFile(os.path.join(pristine, seg)).metadata.num_rows
    named = f"{seg} (commit 000000000004-0000)"
    for attempt, rank, problem in (
        (0, 0, None),
        (0, 1, f"{named} holds rank 0..0, its path says 1"),
        (2, 0, f"{named} holds attempt 0..0, its path says 2"),
    ):
        ref = SegmentRef(rank, seg, rows, len(data), sha256(data))
        found = check_segment(store, "000000000004-0000", attempt, ref, ["sample_id"])
        if problem is None:
            assert isinstance(found, pa.Table) and found.num_rows == rows
        else:
            assert found == problem


def _set(root: str, rel: str, keys: tuple, value: object) -> None:
    path = Path(root, rel)
    doc = json.loads(path.read_text())
    node = doc
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("rel", "keys", "value"),
    [
        ("attempts/0000.json", ("pid",), 2**70),
        ("commits/000000000004-0000.json", ("world_size",), 2**63),
        ("run.json", ("config", "seed"), 2**64),
    ],
)
def test_an_integer_beyond_int64_is_named_not_an_overflow(pristine, tmp_path, rel, keys, value):
    """The log's integers are int64 (seeds: up to 2**64 - 1, as torch.manual_seed takes):
    a larger one is damage named with its file and field, not an OverflowError."""
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    _set(root, rel, keys, value)
    audit = _cli("audit", root)
    assert audit.exit_code == 1, audit.output
    assert f"{rel}" in audit.stderr and f"field '{keys[-1]}' is {value}, expected at most" in (
        audit.stderr
    ), audit.stderr
    verified = _cli("verify", root, "--format", "csv")
    assert verified.exit_code == 3 and "expected at most" in verified.output, verified.output


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("dataset_len", None, "expected an integer"),
        ("batch_size", None, "expected an integer"),
        ("seed", None, "expected an integer"),
        ("dataset_len", -1, "expected at least 0"),
        ("batch_size", 0, "expected at least 1"),
        ("packer", 1.5, "expected an object or null"),
        ("packer", True, "expected an object or null"),
    ],
)
def test_a_run_config_without_its_numbers_is_named(pristine, tmp_path, key, value, expected):
    """Every writer puts a number in run.json's dataset_len, batch_size and seed: a null or
    out-of-range one is damage named with its field (before: TypeError from int(None) in
    audit and report, a KeyError in show --materialize)."""
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    _set(root, "run.json", ("config", key), value)
    for args in (["audit", root], ["report", root, "--out", str(tmp_path / "r.html")]):
        result = _cli(*args)
        assert result.exit_code == 1, result.output
        assert f"run.json, config: field '{key}' is {value}" in result.stderr, result.stderr
        assert expected in result.stderr


def test_a_packed_run_config_without_its_sequence_length_is_named(pristine, tmp_path):
    """``config.packer.seq_len`` divides the report's token counts: a packer without a
    positive one is named (before: TypeError ``'float' object is not subscriptable`` out
    of ``ledger report`` for a mangled packer)."""
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    for packer, expected in (({"seq_len": 0}, "is 0, expected at least 1"), ({}, "seq_len")):
        _set(root, "run.json", ("config", "packer"), packer)
        for args in (["audit", root], ["report", root, "--out", str(tmp_path / "r.html")]):
            result = _cli(*args)
            assert result.exit_code == 1, result.output
            assert "run.json, config, packer: field 'seq_len'" in result.stderr, result.stderr
            assert expected in result.stderr


def test_verify_names_an_attempt_whose_parent_is_no_commit(pristine, tmp_path):
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    _set(root, "attempts/0000.json", ("parent",), "000000000099-0000")
    result = _cli("verify", root, "--format", "csv")
    assert result.exit_code == 3, result.output
    assert "0000.json: field 'parent' is '000000000099-0000', which no commit" in result.output
    got = {row["check"]: row["ok"] for row in csv.DictReader(io.StringIO(result.stdout))}
    assert got["chain"] == "False" and got["markers"] == "True"  # a finding, not unreadable
    assert got["segments"] == "True"  # the other checks still ran


@pytest.mark.parametrize("parent", [None, "000000000099-0000", "000000000004-0000"])
def test_a_damaged_parent_link_is_refused_not_an_audit_of_another_chain(pristine, tmp_path, parent):
    """A head whose marker's parent is damaged (cut to null: the chain looks shorter; or
    naming a missing or another commit) gives no answer about another lineage: the chain
    walked by parent links must be the lineage the head's marker records. Before, a null
    parent made ``audit``, ``where`` and ``reconstruct`` answer for the head alone, exit
    0 (coverage 25% instead of 50%)."""
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    _set(root, "commits/000000000004-0000.json", ("parent",), parent)
    for name in ("audit", "check", "where", "show", "reconstruct", "sql", "report"):
        out, html = tmp_path / "o.parquet", tmp_path / "r.html"
        args = [a.format(out=out, html=html) for a in COMMANDS[name]]
        result = _cli(args[0], root, *args[1:])
        if name == "check":  # checks that could not run are failed checks
            assert result.exit_code == 3 and "000000000004-0000" in result.output, result.output
            continue
        assert result.exit_code == 1, (name, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), (name, result.stderr)
        assert "000000000004-0000" in lines[0], (name, lines[0])
    verified = _cli("verify", root, "--format", "csv")
    assert verified.exit_code == 3, verified.output
    with pytest.raises(LedgerError, match="000000000004-0000"):
        summarize(root)


def test_verify_names_an_attempt_that_committed_without_its_record(pristine, tmp_path):
    """A loader claims its attempt's record before it writes anything: an attempt whose
    commits outlived its record lost it (the audit could no longer say what the attempt
    resumed from). A finding of the chain check; the duplicates are still counted."""
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    os.remove(os.path.join(root, "attempts", "0000.json"))
    result = _cli("verify", root, "--format", "csv")
    assert result.exit_code == 3, result.output
    assert "attempt 0 made " in result.output
    assert "attempts/0000.json is missing: it was removed after the attempt began" in result.output
    got = {row["check"]: row["ok"] for row in csv.DictReader(io.StringIO(result.stdout))}
    assert got["chain"] == "False" and got["markers"] == "True"
    assert got["segments"] == got["duplicates"] == "True"  # the commits' own chain holds


def test_an_attempt_record_without_its_start_time_still_reports(pristine, tmp_path):
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    loader = ledger.DataLoader(Augmented(N), batch_size=BATCH, shuffle=True, seed=3, log=root)
    loader.load_state_dict(
        {"version": 1, "root": root, "run_id": _run_id(root), "commit": "000000000002-0000",
         "attempt": 0, "world_size": 1, "step": 2}
    )  # fmt: skip
    list(take(loader, 1))
    loader.state_dict()  # attempt 1, resumed from commit 2: the report draws its start
    _set(root, "attempts/0001.json", ("created_at",), None)
    result = _cli("report", root, "--out", str(tmp_path / "r.html"))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def mixture_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A committed log of a two-source ``ledger.Mixture`` of streams."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ledger.stream import ShardedSource, Stream

    base = tmp_path_factory.mktemp("mixture")
    for s in range(2):
        rows = [f"shard {s} doc {i}" for i in range(6)]
        pq.write_table(pa.table({"text": rows}), base / f"p{s}.parquet")
    sources = {
        name: Stream(ShardedSource(str(base / f"p{s}.parquet")), shuffle_buffer=2)
        for s, name in enumerate("ab")
    }
    root = str(base / "log")
    loader = ledger.DataLoader(
        ledger.Mixture(sources, weights={"a": 0.5, "b": 0.5}), batch_size=3, seed=5, log=root,
        collate_fn=lambda rows: [r["text"] for r in rows],
    )  # fmt: skip
    list(take(loader, 3))
    loader.state_dict()
    loader.close()
    return root


@pytest.mark.parametrize(
    ("keys", "value", "named"),
    [
        (("schedule", 0, 0), 2**70, "schedule[0] is"),
        (("schedule", 0, 0), -1, "schedule[0] is"),
        (("schedule", 0), [0, {"a": "half"}], "schedule[0] is"),
        (("schedule",), None, "field 'schedule'"),
        (("targets",), [], "field 'targets' is not one map of shares per schedule entry"),
        (("sources", 0, "name"), 7, "sources[0]: field 'name'"),
        (("sources", 1, "len"), -1, "sources[1]: field 'len'"),
        (("epoch_size",), 1.5, "field 'epoch_size'"),
    ],
)
def test_a_mangled_mixture_config_is_named(mixture_log, tmp_path, keys, value, named):
    """The audits read a mixture's schedule, targets and sources from ``run.json``: a
    mangled one is damage named with its field (before: TypeError out of ``int()`` in
    ``audit`` and ``report`` for a schedule start beyond int64, KeyError for a missing
    field)."""
    root = str(tmp_path / "log")
    shutil.copytree(mixture_log, root)
    _set(root, "run.json", ("config", "mixture", *keys), value)
    for args in (["audit", root], ["report", root, "--out", str(tmp_path / "r.html")]):
        result = _cli(*args)
        assert result.exit_code == 1, result.output
        assert "run.json, config, mixture" in result.stderr, result.stderr
        assert named in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("key", "value"),
    [("dataset_len", 25), ("seed", 4), ("shuffle", False), ("batch_size", 4)],
)
def test_an_edited_run_json_is_refused_by_every_reader(pristine, tmp_path, key, value):
    """``run.json`` is created once and never rewritten; each attempt record names its
    SHA-256. A well-formed edit (another dataset length, seed, ...) would make the
    audits answer for another run, silently: every reader refuses it, naming both files,
    and ``verify`` fails. Before: ``audit`` and ``report`` exit 0 with other coverage."""
    import hashlib

    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    with open(os.path.join(root, "run.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    records = sorted(Path(root, "attempts").glob("*.json"))
    assert records and all(json.loads(r.read_text())["run_sha256"] == digest for r in records)
    assert _cli("audit", root).exit_code == 0
    _set(root, "run.json", ("config", key), value)
    named = "run.json differs from the SHA-256"
    gate = _cli("audit", root, "--check", "coverage", "--format", "csv")
    assert gate.exit_code == 3 and named in gate.output, gate.output  # the gate fails
    for args in (
        ["audit", root],
        ["where", root, "--sample", "1"],
        ["show", root, "--batch", "1"],
        ["report", root, "--out", str(tmp_path / "r.html")],
    ):
        result = _cli(*args)
        assert result.exit_code == 1, (args, result.output)
        assert named in result.stderr and "attempts/0000.json" in result.stderr, result.stderr
    verified = _cli("verify", root, "--format", "csv")
    assert verified.exit_code == 3 and named in verified.output, verified.output
    with pytest.raises(LogCorrupted, match=named):  # a loader starting on the root
        next(iter(ledger.DataLoader(Augmented(N), batch_size=BATCH, seed=3, log=root)))


def test_verify_names_an_attempt_record_of_another_run_json(pristine, tmp_path):
    """A later attempt's record naming another SHA-256 of run.json is found by verify."""
    root = str(tmp_path / "log")
    shutil.copytree(pristine, root)
    record = json.loads(Path(root, "attempts/0000.json").read_text())
    record.update(attempt=1, parent="000000000004-0000")
    Path(root, "attempts/0001.json").write_text(json.dumps(record))
    assert _cli("verify", root).exit_code == 0  # a resume's record, as a loader writes it
    _set(root, "attempts/0001.json", ("run_sha256",), "0" * 64)
    verified = _cli("verify", root, "--format", "csv")
    assert verified.exit_code == 3, verified.output
    assert "attempts/0001.json recorded when its attempt began" in verified.output
    assert _cli("audit", root).exit_code == 0  # readers compare the first record only
