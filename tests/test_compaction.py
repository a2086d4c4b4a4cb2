"""Compaction: every view and every command answers the same before and after; a SIGKILL
at any point leaves a valid log; training may run meanwhile; S3 roots too."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import packed_stream

import ledger
from ledger.audit import connect
from ledger.cli import main
from ledger.compaction import compact, list_compactions, pieces, read_table
from ledger.store import Store
from ledger.testing import batches_equal, take

# One worker runs this module whole (pytest-xdist --dist loadgroup): its module-scoped
# fixture is built once.
pytestmark = pytest.mark.xdist_group("test_compaction")

HERE = os.path.dirname(os.path.abspath(__file__))
VIEWS = ("events", "lineage", "segments", "commits", "states", "attempts", "uncommitted")


class Ids:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import torch

        return {"id": torch.tensor(i)}


def loader(root, **kw):
    return ledger.DataLoader(Ids(23), batch_size=4, shuffle=True, seed=3, log=root, **kw)


def history(root: str) -> list[dict]:
    """Attempt 0 commits every 2 batches for 16 batches; attempt 1 resumes from batch 6
    (an abandoned branch) and commits at 9 and 12; 2 more batches stay uncommitted."""
    first = loader(root)
    tokens = []
    for done, _ in enumerate(take(first, 16), 1):
        if done % 2 == 0:
            tokens.append(first.state_dict())
    second = loader(root)
    second.load_state_dict(tokens[2])
    for done, _ in enumerate(take(second, 8), 7):
        if done in (9, 12):
            tokens.append(second.state_dict())
    return tokens


def answers(root: str) -> dict:
    """Every view's rows and every command's output."""
    con = connect(root)
    out: dict = {v: con.sql(f"SELECT * FROM {v} ORDER BY ALL").fetchall() for v in VIEWS}
    con.close()
    head = connect(root, "000000000002-0000")  # a lineage that ends inside a compacted file
    out["lineage@2"] = head.sql("SELECT * FROM lineage ORDER BY ALL").fetchall()
    head.close()
    runner = CliRunner()
    for args in (
        ["audit", root, "--format", "json"],
        ["audit", root, "--check", "all", "--format", "json"],
        ["audit", root, "--head", "8-0", "--format", "json"],
        ["verify", root, "--format", "json"],
        ["where", root, "--sample", "5", "--format", "json"],
        ["where", root, "--sample", "17", "--format", "json"],
        ["show", root, "--batch", "1", "--format", "json"],
        ["show", root, "--batch", "10", "--format", "json"],
    ):
        result = runner.invoke(main, args)
        out[" ".join(args[:1] + args[2:])] = (result.exit_code, result.output)
    out["reconstruct"] = _reconstruct(root, "000000000012-0001")
    out["report"] = _report(root).replace(root.encode(), b"<root>")  # a copy's reads the same
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A :func:`history` log and its :func:`answers`, built once for the tests that compact
    a copy of it: a copy keeps the markers' timestamps and the run id, so its answers are
    these (each test still reads them from its copy after the compaction)."""
    root = str(tmp_path_factory.mktemp("pristine") / "log")
    history(root)
    return root, answers(root)


def copy_of(pristine: tuple[str, dict], tmp_path) -> tuple[str, dict]:
    """A copy of the pristine log under ``tmp_path``, and the answers it gives."""
    root = str(tmp_path / "log")
    shutil.copytree(pristine[0], root)
    return root, pristine[1]


def _report(root: str) -> bytes:
    folder = os.environ.get("LEDGER_JOURNAL_DIR", "/tmp") if "://" in root else root + "-out"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "report.html")
    result = CliRunner().invoke(main, ["report", root, "--out", path])
    assert result.exit_code == 0, result.output
    with open(path, "rb") as f:
        return f.read()


def _reconstruct(root: str, commit: str) -> list:
    path = os.path.join(os.path.dirname(root.rstrip("/")), f"seen-{abs(hash(root))}.parquet")
    if "://" in root:
        path = os.path.join(os.environ.get("LEDGER_JOURNAL_DIR", "/tmp"), "seen.parquet")
    result = CliRunner().invoke(main, ["reconstruct", root, "--commit", commit, "--out", path])
    assert result.exit_code == 0, result.output
    return pq.read_table(path).to_pylist()


def segment_files(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "events", "attempt=*", "rank=*", "*.parquet")))


def test_every_answer_is_the_same_after_compaction(tmp_path):
    root = str(tmp_path / "log")
    tokens = history(root)
    before = answers(root)
    assert before["verify --format json"][0] == 0, before["verify --format json"]
    files = len(segment_files(root))
    result = compact(root, target_rows=20)
    # The lineage of 12-1 is 2, 4, 6 (attempt 0), 9, 12; 12's segment is the newest.
    assert (result.segments, result.files, result.retired) == (4, 2, 4)
    assert len(segment_files(root)) == files - 4
    assert answers(root) == before
    # Resume from every checkpoint, the compacted ones included, is still exact.
    reference = list(take(loader(str(tmp_path / "ref")), 20))
    for token in tokens:
        resumed = loader(root)
        resumed.load_state_dict(token)
        done = token["step"]
        got = list(take(resumed, 20 - done))
        assert all(batches_equal(a, b) for a, b in zip(got, reference[done:], strict=True))
    # A second compaction has nothing left in that lineage but the newest segment.
    assert compact(root).segments == 0


def test_a_compaction_before_an_older_commit_and_then_the_rest(tmp_path, pristine):
    root, before = copy_of(pristine, tmp_path)
    first = compact(root, "000000000006-0000")  # lineage 2, 4, 6: 6's newest is kept
    assert (first.id, first.segments) == ("000000000006-0000", 2)
    assert answers(root) == before
    second = compact(root)  # lineage 2, 4 (done), 6, 9, 12 (newest)
    assert (second.id, second.segments) == ("000000000012-0001", 2)
    assert answers(root) == before
    assert [c.id for c in list_compactions(Store(root))] == [first.id, second.id]


def test_a_log_with_rank_tables_beside_the_markers_reads_the_same(tmp_path, pristine):
    """Logs written before rank tables moved to ``ranks/`` hold them in ``commits/``, where
    their markers name them, and their compactions' catalogs in Parquet:
    every answer is the same, before and after a compaction, a resume is exact, and new
    commits on such a log go to ``ranks/``."""
    import json

    from ledger.loader import TOKEN_VERSION

    root, before = copy_of(pristine, tmp_path)
    for name in os.listdir(os.path.join(root, "ranks")):
        os.rename(os.path.join(root, "ranks", name), os.path.join(root, "commits", name))
        marker = os.path.join(root, "commits", name.replace(".ranks", ".json"))
        with open(marker) as f:
            data = json.load(f)
        data["ranks"]["path"] = f"commits/{name}"
        with open(marker, "w") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True))  # as ledger wrote them
    os.rmdir(os.path.join(root, "ranks"))
    assert answers(root) == before
    assert compact(root).segments == 4
    _as_parquet(root)
    assert answers(root) == before
    with open(os.path.join(root, "run.json")) as f:
        run_id = json.load(f)["run_id"]
    token = {"version": TOKEN_VERSION, "root": root, "run_id": run_id, "attempt": 1}
    resumed = loader(root)
    resumed.load_state_dict({**token, "commit": "000000000012-0001", "world_size": 1, "step": 12})
    reference = list(take(loader(str(tmp_path / "ref")), 16))
    got = list(take(resumed, 4))
    assert all(batches_equal(a, b) for a, b in zip(got, reference[12:], strict=True))
    new = resumed.state_dict()["commit"]
    assert os.listdir(os.path.join(root, "ranks")) == [f"{new}.ranks"]
    assert CliRunner().invoke(main, ["verify", root]).exit_code == 0


def _as_parquet(root: str) -> None:
    """The root's compactions' catalogs rewritten as Parquet files named ``.parquet``, as
    compactions wrote them before, their markers naming the new files."""
    import hashlib
    import json

    import pyarrow as pa

    for marker_path in glob.glob(os.path.join(root, "compactions", "*.json")):
        with open(marker_path) as f:
            marker = json.load(f)
        with open(os.path.join(root, marker["pieces"]["path"]), "rb") as f:
            assert f.read(4) == b"PAR1"  # what any engine reads
        for key in ("catalog",):
            rel = marker[key]["path"]
            with open(os.path.join(root, rel), "rb") as f:
                blob = f.read()
            assert blob[:6] == b"ARROW1"
            sink = pa.BufferOutputStream()
            pq.write_table(read_table(blob), sink, compression="zstd", use_dictionary=False)
            data = sink.getvalue().to_pybytes()
            os.remove(os.path.join(root, rel))
            rel = rel.replace(".arrow", ".parquet")
            with open(os.path.join(root, rel), "wb") as f:
                f.write(data)
            marker[key].update(path=rel, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        with open(marker_path, "w") as f:
            json.dump(marker, f)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_show_and_reconstruct_check_the_compacted_file_they_read(tmp_path, pristine, how):
    """As ``where`` and ``audit`` do: a byte flipped in a compacted file is caught by its
    SHA-256 (before, show answered from it), a truncated one named (before, ArrowInvalid)."""
    root, _ = copy_of(pristine, tmp_path)
    compact(root)
    (path,) = glob.glob(os.path.join(root, "events", "compacted", "*", "part-*.parquet"))
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how == "flip":
        data[len(data) // 2] ^= 0x5A
    else:
        del data[len(data) * 2 // 3 :]
    with open(path, "wb") as f:
        f.write(data)
    out = str(tmp_path / "seen.parquet")
    for args in (
        ["show", root, "--batch", "1"],
        ["reconstruct", root, "--commit", "12-1", "--out", out],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith(
            f"Error: compacted file {path} differs from the size or SHA-256"
        )


@pytest.mark.parametrize("point", ["files", "pieces", "marker", "retire"])
def test_sigkill_at_each_point_leaves_a_valid_log(tmp_path, pristine, point):
    root, before = copy_of(pristine, tmp_path)
    child = subprocess.run(
        [sys.executable, os.path.join(HERE, "compact_child.py"), root, point],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -9, child.stderr
    committed = bool(list_compactions(Store(root)))
    assert committed == (point in ("marker", "retire"))
    assert answers(root) == before  # valid, and every answer the same
    rest = compact(root)  # finishes (or redoes) the job
    assert rest.retired + rest.segments > 0
    assert not [p for p in pieces(Store(root)) if os.path.exists(os.path.join(root, p))]
    assert answers(root) == before


def test_compaction_while_training_appends(tmp_path):
    root = str(tmp_path / "log")
    ref_root = str(tmp_path / "ref")
    run = loader(root)
    reference = loader(ref_root)
    for done, _ in enumerate(take(run, 8), 1):
        if done % 2 == 0:
            run.state_dict()
    for done, _ in enumerate(take(reference, 8), 1):
        if done % 2 == 0:
            reference.state_dict()
    errors: list[BaseException] = []

    def compacting():
        try:
            for _ in range(5):
                compact(root, target_rows=16)
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=compacting)
    worker.start()
    for done, _ in enumerate(take(run, 12), 9):
        if done % 2 == 0:
            token = run.state_dict()
    for done, _ in enumerate(take(reference, 12), 9):
        if done % 2 == 0:
            reference.state_dict()
    worker.join()
    assert not errors, errors
    compact(root)
    assert list_compactions(Store(root))
    query = "SELECT epoch, batch, position, sample_id, kind FROM lineage ORDER BY ALL"
    assert connect(root).sql(query).fetchall() == connect(ref_root).sql(query).fetchall()
    resumed = loader(root)
    resumed.load_state_dict(token)
    ref = loader(ref_root)
    ref.load_state_dict(reference.state_dict())
    assert all(batches_equal(a, b) for a, b in zip(take(resumed, 5), take(ref, 5), strict=True))
    assert CliRunner().invoke(main, ["verify", root]).exit_code == 0


def test_stream_log_with_buffers_compacts(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(3):
        with open(shards / f"part-{s}.jsonl", "w") as f:
            for i in range(5 + s):
                f.write(f'{{"text": "shard {s} doc {i} {"x" * (3 * i)}"}}\n')
    root = str(tmp_path / "log")

    def make():
        return ledger.DataLoader(
            packed_stream(str(shards), shuffle_buffer=3),
            batch_size=2,
            shuffle=True,
            seed=5,
            log=root,
            num_workers=2,
        )

    first = make()
    tokens = []
    reference = []
    for done, batch in enumerate(take(first, 12), 1):
        reference.append(batch)
        if done % 3 == 0:
            tokens.append(first.state_dict())
    con = connect(root)
    query = "SELECT * FROM events ORDER BY ALL"
    events = con.sql(query).fetchall()
    assert compact(root).segments == 3
    assert connect(root).sql(query).fetchall() == events
    for token in tokens:
        resumed = make()
        resumed.load_state_dict(token)
        done = token["step"]
        got = list(take(resumed, 12 - done))
        assert all(batches_equal(a, b) for a, b in zip(got, reference[done:], strict=True))


def test_compaction_on_s3(s3, tmp_path):
    root = s3.new_root("compact")
    history(root)
    before = answers(root)
    result = CliRunner().invoke(main, ["compact", root])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("compaction 000000000012-0001: 4 segments")
    assert answers(root) == before
    store = Store(root)
    assert all(not store.exists(p) for p in pieces(store))


def test_pieces_share_row_groups_and_markers_come_from_the_catalog(tmp_path, pristine, monkeypatch):
    root, before = copy_of(pristine, tmp_path)
    result = compact(root)
    assert (result.segments, result.files) == (4, 1)
    # One file, one row group: a piece is a range of rows, not row groups of its own.
    (path,) = {p.path for p in pieces(Store(root)).values()}
    assert pq.ParquetFile(os.path.join(root, path)).metadata.num_row_groups == 1
    assert sorted(p.first_row for p in pieces(Store(root)).values()) == [0, 10, 20, 29]
    # The markers of the compacted history are read from the compaction's catalog.
    from ledger.commits import list_commits, parse_once
    from ledger.compaction import catalogued

    store = Store(root)
    with parse_once():
        held = catalogued(store)
        listed = list_commits(store)
        assert {c.id for c in listed} == set(held)
        assert all(held[c.id] is c for c in listed)
        assert listed == list_commits(store, catalog=False)
    # The audit's columns of the commits, taken from the catalog, are the markers' own.
    from ledger.history import History, read_history

    with parse_once():
        columns = read_history(store)
        markers = History.of(list_commits(store, catalog=False))
    assert columns is not None and markers is not None and len(columns) == 10
    for name in ("ids", "parent", "created_at"):
        assert getattr(columns, name).equals(getattr(markers, name)), name
    for name in ("step", "attempt", "world_size", "starts", "rows"):
        assert np.array_equal(getattr(columns, name), getattr(markers, name)), name
    assert columns.segments().equals(markers.segments())
    assert columns.segments()["path"].to_pylist() == [
        s.path for c in list_commits(store) for s in c.segments
    ]
    assert answers(root) == before
    # show reads a compacted segment's rows as a table: no piece is encoded again as a
    # Parquet file of its own (what open_segment makes for other readers).
    from ledger import segments
    from ledger.audit.queries import show

    def refuse(*args: object) -> bytes:
        raise AssertionError("a compacted piece was encoded again")

    with monkeypatch.context() as patched:
        patched.setattr(segments, "encode", refuse)
        assert show(root, 10).batch == 10
    # They come from the catalog: a catalogued commit's own rank table is not read.
    os.remove(os.path.join(root, "ranks", "000000000002-0000.ranks"))
    with parse_once():
        again = read_history(Store(root))
    assert again is not None and np.array_equal(again.rows, markers.rows)


def test_verify_fails_a_marker_that_differs_from_its_catalog_copy(tmp_path):
    root = str(tmp_path / "log")
    history(root)
    compact(root)
    marker = os.path.join(root, "commits", "000000000004-0000.json")
    with open(marker) as f:
        text = f.read()
    with open(marker, "w") as f:
        f.write(text.replace('"created_at": "20', '"created_at": "19', 1))
    result = CliRunner().invoke(main, ["verify", root, "--format", "csv"])
    assert result.exit_code == 3, result.output
    assert "1 commit markers differ from the catalog of a compaction (000000000004-0000)" in (
        result.output
    )


def _rewrite_catalog(root: str, change) -> None:
    """Replace the catalog of the root's one compaction by ``change(table)``, naming the
    new bytes in its marker (a consistent catalog, as a compaction could have written)."""
    import hashlib
    import json

    import pyarrow as pa

    (marker_path,) = glob.glob(os.path.join(root, "compactions", "*.json"))
    with open(marker_path) as f:
        marker = json.load(f)
    path = os.path.join(root, marker["catalog"]["path"])
    with open(path, "rb") as f:
        table = change(read_table(f.read()))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)  # Parquet, as compactions wrote catalogs before
    data = sink.getvalue().to_pybytes()
    with open(path, "wb") as f:
        f.write(data)
    marker["catalog"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    with open(marker_path, "w") as f:
        json.dump(marker, f)


def test_the_catalog_carries_planned_skips_and_verify_compares_them(tmp_path):
    import pyarrow as pa

    from ledger.commits import list_commits, parse_once
    from ledger.compaction import catalogued

    root = str(tmp_path / "log")
    run = loader(root)
    list(take(run, 2))
    run.state_dict()
    run.skip(steps=range(6, 8), reason="loss spike")
    for done, _ in enumerate(take(run, 6), 3):
        if done % 2 == 0:
            run.state_dict()
    assert compact(root).segments >= 2
    store = Store(root)
    with parse_once():
        markers = {c.id: c for c in list_commits(store, catalog=False)}
        held = catalogued(store)
    assert set(held) == set(markers)
    planned = {cid: c.planned_skips for cid, c in markers.items()}
    assert ((6, 8, "loss spike"),) in planned.values()  # commits before step 6 carry it
    assert {cid: c.planned_skips for cid, c in held.items()} == planned
    for cid, c in held.items():
        assert c == markers[cid]
        assert (c.manifest, c.lineage_ranges) == (
            markers[cid].manifest,
            markers[cid].lineage_ranges,
        )
    verified = CliRunner().invoke(main, ["verify", root, "--format", "csv"])
    assert verified.exit_code == 0, verified.output

    # A catalog whose skips differ from the markers': verify names the commits.
    def other_reason(table: pa.Table) -> pa.Table:
        rows = table.to_pylist()
        for row in rows:
            for s in row["skips"] or []:
                s["reason"] = "something else"
        return pa.Table.from_pylist(rows, schema=table.schema)

    _rewrite_catalog(root, other_reason)
    with parse_once():
        assert {c.planned_skips for c in catalogued(Store(root)).values()} >= {
            ((6, 8, "something else"),)
        }
    verified = CliRunner().invoke(main, ["verify", root, "--format", "csv"])
    assert verified.exit_code == 3, verified.output
    changed = sorted(cid for cid, skips in planned.items() if skips)
    assert f"{len(changed)} commit markers differ from the catalog of a compaction" in (
        verified.output
    )

    # A catalog written before the column existed reads as planning no skips.
    _rewrite_catalog(root, lambda t: t.drop_columns(["skips"]))
    with parse_once():
        old = catalogued(Store(root))
    assert set(old) == set(markers) and all(c.planned_skips == () for c in old.values())


def test_a_catalog_of_rank_lists_reads_as_one_of_bytes(tmp_path):
    """Catalogs written before rank tables were stored as bytes hold lists of integers:
    both read the same; bytes that are not whole integers are a damaged catalog."""
    import pyarrow as pa

    from ledger.commits import parse_once
    from ledger.compaction import catalogued
    from ledger.errors import LogCorrupted
    from ledger.history import read_history

    root = str(tmp_path / "log")
    history(root)
    compact(root)
    with parse_once():
        held = catalogued(Store(root))
        columns = read_history(Store(root))
    assert columns is not None and len(held) == len(columns) == 10

    def as_lists(table: pa.Table) -> pa.Table:
        raw = table["ranks"].combine_chunks()
        assert raw.type == pa.large_binary()
        lists = [np.frombuffer(b, "<i8").tolist() for b in raw.to_pylist()]
        at = table.schema.get_field_index("ranks")
        return table.set_column(at, "ranks", pa.array(lists, pa.large_list(pa.int64())))

    _rewrite_catalog(root, as_lists)
    with parse_once():
        assert catalogued(Store(root)) == held
        again = read_history(Store(root))
    assert again is not None and again.ids.equals(columns.ids)
    assert np.array_equal(again.rows, columns.rows)

    def torn(table: pa.Table) -> pa.Table:
        at = table.schema.get_field_index("ranks")
        return table.set_column(
            at, "ranks", pa.array([b"\0" * 7] * table.num_rows, pa.large_binary())
        )

    _rewrite_catalog(root, torn)
    with parse_once(), pytest.raises(LogCorrupted, match=r"commits\.arrow is not a catalog"):
        read_history(Store(root))


def test_the_lineage_of_columnar_commits_follows_branches_and_names_a_break():
    import pyarrow as pa

    from ledger.errors import LogCorrupted
    from ledger.history import History

    def of(parents: list) -> History:
        n = len(parents)
        zeros = np.zeros(n, np.int64)
        ids = pa.array([f"c{k}" for k in range(n)])
        return History(
            ids, zeros, zeros, pa.array(parents, pa.string()), zeros + 1, ids,
            np.arange(n + 1), np.zeros((n, 26), np.int64),
        )  # fmt: skip

    # c3 resumed from c1 (c2 and c5 are an abandoned branch); c4 follows c3.
    h = of([None, "c0", "c1", "c1", "c3", "c2"])
    assert h.lineage(4).tolist() == [0, 1, 3, 4]
    assert h.lineage(5).tolist() == [0, 1, 2, 5]
    assert h.lineage(0).tolist() == [0]
    with pytest.raises(LogCorrupted, match="commit chain loops at c"):
        of(["c2", "c0", "c1"]).lineage(2)
    with pytest.raises(LogCorrupted, match="commit c1 names parent c9, which does not exist"):
        of([None, "c9", "c1"]).lineage(2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("path", None, "field 'path' is None (NoneType), expected a string"),
        ("path", ["x"], "field 'path' is ['x'] (list), expected a string"),
        (
            "path",
            "../outside.parquet",
            "field 'path' is '../outside.parquet', not a path in the root",
        ),
        ("rows", -1, "field 'rows' is -1, expected at least 0"),
        ("sha256", True, "field 'sha256' is True (bool), expected a string"),
    ],
)
def test_a_mangled_compaction_marker_is_named(tmp_path, pristine, field, value, message):
    """A compaction marker's ``files`` entries are checked field by field: a wrong type is
    LogCorrupted naming the marker and the field (before: ArrowInvalid or TypeError from
    every command)."""
    root, _ = copy_of(pristine, tmp_path)
    compact(root)
    (marker,) = glob.glob(os.path.join(root, "compactions", "*.json"))
    with open(marker) as f:
        doc = json.load(f)
    doc["files"][0][field] = value
    with open(marker, "w") as f:
        json.dump(doc, f)
    for args in (["audit", root], ["where", root, "--sample", "1"], ["show", root, "--batch", "1"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        assert "compactions/" in result.stderr and f"files[0]: {message}" in result.stderr, (
            args,
            result.stderr,
        )
