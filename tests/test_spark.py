"""The audit on Spark (local mode) answers exactly what the DuckDB audit answers.

One SparkSession for the module (starting one takes tens of seconds). On each log --
the log factory's example (version-1 markers, an orphan, an abandoned branch, a
duplicate), a map-style run with a resume, uncommitted batches and a compaction, a packed
stream with two workers, and a hand-built log of three ranks with an uneven rank, an
elastic resume, an orphan segment and an orphan manifest -- every view's rows, the summary
and every check equal DuckDB's. Skipped only when pyspark or Java is missing; CI sets
``LEDGER_REQUIRE_SPARK=1`` so that a missing one fails instead.
"""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import packed_stream
from logfactory import LogFactory, batch, example_log
from test_compaction import history

import ledger
from ledger import ranks
from ledger.audit import connect, summarize
from ledger.audit.checks import check, verify
from ledger.audit.names import CHECKS
from ledger.commits import (
    PipelineState,
    SegmentRef,
    claim_attempt,
    commit_id,
    new_commit,
    open_run,
    write_commit,
)
from ledger.compaction import compact
from ledger.errors import LogCorrupted
from ledger.schema import EVENT_SCHEMA
from ledger.segments import encode, segment_path
from ledger.store import Store, sha256
from ledger.testing import take

# One worker runs this module whole (pytest-xdist --dist loadgroup): its module-scoped
# fixture is built once.
pytestmark = pytest.mark.xdist_group("test_spark")

_REQUIRED = os.environ.get("LEDGER_REQUIRE_SPARK") == "1"


def _spark_or_skip():
    try:
        import pyspark  # noqa: F401
    except ImportError:
        if _REQUIRED:
            raise
        pytest.skip("pyspark is not installed (pip install 'ledger[spark]')")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        if _REQUIRED:
            pytest.fail("java is missing: tools/setup.sh installs openjdk-17-jre-headless")
        pytest.skip("java is not installed")
    from ledger.audit import spark as engine

    # Tiny logs: one partition, and no code generation (whole-stage or per expression:
    # expressions interpreted, as Spark's own test suites also run them) or adaptive
    # re-planning, whose compile and planning time dominates queries over a few hundred
    # rows; the JVM's quick JIT only (C1): with C2 the module took about 4x longer here.
    config = {
        "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        "spark.sql.shuffle.partitions": "1",
        "spark.default.parallelism": "1",
        "spark.sql.codegen.wholeStage": "false",
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.codegen.factoryMode": "NO_CODEGEN",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
    }
    session = engine.session("local[1]", "ledger-tests", config)
    session.sparkContext.setLogLevel("ERROR")
    return engine, session


@pytest.fixture(scope="module")
def spark():
    engine, session = _spark_or_skip()
    yield engine, session
    session.stop()


VIEWS = ("events", "lineage", "commits", "segments", "states", "attempts", "run",
         "uncommitted", "journals")  # fmt: skip


def assert_same(spark, root: str, head: str | None = None, *, views=VIEWS, summary=True) -> None:
    """Every view, the summary and every check of ``root`` at ``head``: Spark == DuckDB
    (``summary=False``: the views only)."""
    engine, session = spark
    got_head = engine.register(session, root, head)
    con = connect(root, head)
    try:
        for view in views:
            want = sorted(con.sql(f"SELECT * FROM {view}").fetchall(), key=repr)
            got = sorted(
                (tuple(r) for r in session.sql(f"SELECT * FROM {view}").collect()), key=repr
            )
            assert got == want, view
            columns = [d[0] for d in con.sql(f"SELECT * FROM {view} LIMIT 0").description]
            assert session.table(view).columns == columns, view
    finally:
        con.close()
    if not summary:
        return
    summary = engine.summarize(session, root, head)
    assert summary.head == got_head
    assert summary == summarize(root, head)
    got = engine.check(session, root, CHECKS, head=head, summary=summary)
    assert got == check(root, CHECKS, head=head)


# ---------------------------------------------------------------- the logs


@pytest.mark.long  # version-1 logs are audited by DuckDB in CI (test_compat)
def test_example_log_version_1_markers_orphan_abandoned_duplicate(spark, tmp_path):
    root = str(tmp_path / "log")
    example_log(tmp_path / "log")
    assert_same(spark, root)


def test_resumed_compacted_run_with_uncommitted_batches(spark, tmp_path):
    root = str(tmp_path / "log")
    history(root)
    assert compact(root, target_rows=20).segments == 4
    assert_same(spark, root)
    # A lineage that ends inside a compacted file: only its commits' row groups count.
    assert_same(spark, root, "000000000002-0000", views=("lineage", "commits"), summary=False)


def test_byte_split_sample_ids_read_as_duckdb_reads_them(spark, tmp_path):
    """A segment of 2**16 samples stores ``sample_id`` as BYTE_STREAM_SPLIT
    (:func:`ledger.segments.writer_options`), and so does its compaction: Spark decodes
    each id, paired with its position, as DuckDB does."""
    engine, session = spark
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(
        list(range(1 << 16)), batch_size=256, shuffle=True, seed=0, log=root, rng="off"
    )
    list(loader)
    loader.state_dict()
    for _ in range(2):  # batches of epoch 1, each a segment: compaction leaves the newest
        list(take(loader, 1))
        loader.state_dict()
    query = """SELECT kind, count(*), sum(sample_id), sum(sample_id * position),
                      min(sample_id), max(sample_id)
               FROM lineage GROUP BY kind ORDER BY kind"""

    def split_and_answer() -> list[tuple]:
        files = [os.path.join(d, f) for d, _, fs in os.walk(root + "/events") for f in fs]
        big = [pq.ParquetFile(f).metadata for f in files if f.endswith(".parquet")]
        (md,) = [m for m in big if m.num_rows >= 1 << 16]
        assert "BYTE_STREAM_SPLIT" in md.row_group(0).column(6).encodings
        con = connect(root)
        try:
            return con.sql(query).fetchall()
        finally:
            con.close()

    want = split_and_answer()
    (_, batches, *_), (_, samples, _, _, low, high) = want
    assert (batches, samples - batches * 256, low, high) == (258, 0, 0, (1 << 16) - 1)
    engine.register(session, root, None)
    assert [tuple(r) for r in session.sql(query).collect()] == want
    assert compact(root).segments == 2
    assert split_and_answer() == want


def test_packed_stream_with_two_workers(spark, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(3):
        with open(shards / f"part-{s}.jsonl", "w") as f:
            for i in range(5 + s):
                f.write(f'{{"text": "shard {s} doc {i} {"x" * (3 * i)}"}}\n')
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(
        packed_stream(str(shards), shuffle_buffer=3),
        batch_size=2,
        shuffle=True,
        seed=5,
        log=root,
        num_workers=2,
    )
    for done, _ in enumerate(take(loader, 9), 1):
        if done % 3 == 0:
            loader.state_dict()
    assert_same(spark, root)


N, BATCH = 12, 2


def _write_segment(store: Store, attempt: int, rank: int, batches: list[tuple[int, int, int]]):
    """Rank ``rank``'s segment holding ``(epoch, batch, first position)`` batches, at the
    path of its last batch + 1 (its state's batch)."""
    rows = [
        {"attempt": attempt, "rank": rank, "worker": -1, "epoch": e, "batch": b,
         "position": p + i, "sample_id": ((p + i) * 5 + e) % N, "kind": "sample"}
        for e, b, p in batches for i in range(BATCH)
    ]  # fmt: skip
    data = encode(pa.Table.from_pylist(rows, schema=EVENT_SCHEMA))
    rel = segment_path(attempt, rank, batches[-1][1] + 1)
    store.write_atomic(rel, data)
    return SegmentRef(rank, rel, len(rows), len(data), sha256(data))


def _commit(store, attempt, parent, states, refs):
    step = states[0].batch
    header = {
        "id": commit_id(step, attempt), "step": step, "attempt": attempt, "parent": parent,
        "world_size": len(states), "created_at": f"2026-01-01T00:0{attempt}:{step:02d}+00:00",
    }  # fmt: skip
    commit = new_commit(header, ranks.build(states, refs, []))
    write_commit(store, commit)
    return commit.id


def three_ranks(root: str) -> None:
    """Attempt 0, 3 ranks (global batch 6, 2 steps per epoch): commit 2 (epoch 0 done),
    commit 3 (rank 2 lags a batch: no segment), commit 4 (rank 2 catches up: its segment
    is seg-3, under commit 4), then an orphan segment and an orphan manifest (a crash
    before marker 5). Attempt 1 resumes from commit 3 with 2 ranks (commit 4-0000 is
    abandoned) and commits at 5."""
    store = Store(root)
    config = {"dataset_len": N, "seed": 0, "shuffle": True, "batch_size": BATCH,
              "drop_last": False, "world_size": 3, "order": "test"}  # fmt: skip
    open_run(store, config)
    a = claim_attempt(store, None, 3)

    def pos(k: int, r: int, world: int = 3) -> int:
        return (k % 2) * world * BATCH + r * BATCH

    refs = [_write_segment(store, a, r, [(0, 0, pos(0, r)), (0, 1, pos(1, r))]) for r in range(3)]
    c2 = _commit(store, a, None, [PipelineState(r, 1, 0, 2) for r in range(3)], refs)
    refs = [_write_segment(store, a, r, [(1, 2, pos(2, r))]) for r in range(2)]
    states = [PipelineState(0, 1, 1, 3), PipelineState(1, 1, 1, 3), PipelineState(2, 1, 0, 2)]
    c3 = _commit(store, a, c2, states, refs)
    refs = [_write_segment(store, a, r, [(1, 3, pos(3, r))]) for r in range(2)]
    refs.append(_write_segment(store, a, 2, [(1, 2, pos(2, 2))]))  # seg-3 of rank 2
    states = [PipelineState(0, 2, 0, 4), PipelineState(1, 2, 0, 4), PipelineState(2, 1, 1, 3)]
    _commit(store, a, c3, states, refs)
    _write_segment(store, a, 0, [(2, 4, 0)])  # orphan segment seg-5
    store.write_atomic("manifest/000000000005-0000.parquet", b"PAR1 not committed")
    b = claim_attempt(store, c3, 2)
    refs = [_write_segment(store, b, r, [(1, 3, 4 + 4 * r), (2, 4, r * BATCH)]) for r in range(2)]
    _commit(store, b, c3, [PipelineState(r, 2, 1, 5) for r in range(2)], refs)


def test_three_ranks_uneven_elastic_orphans(spark, tmp_path):
    root = str(tmp_path / "log")
    three_ranks(root)
    assert verify(root).ok
    assert_same(spark, root)
    assert_same(spark, root, "000000000004-0000", views=("lineage", "commits"), summary=False)


def test_an_altered_segment_fails_every_spark_check(spark, tmp_path):
    engine, session = spark
    root = str(tmp_path / "log")
    three_ranks(root)
    path = os.path.join(root, segment_path(0, 1, 2))
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[-9] ^= 1  # inside the footer's metadata: the same size, another SHA-256
        f.seek(0)
        f.write(bytes(data))
    results = engine.check(session, root, ["coverage", "progress"])
    assert [r.ok for r in results] == [False, False]
    assert "was altered" in results[0].detail and segment_path(0, 1, 2) in results[0].detail


def test_spark_rejects_an_id_outside_the_dataset_and_releases_its_cache(spark, tmp_path):
    """The fused per-(epoch, id) pass finds an id outside the dataset (as the DuckDB audit
    does), and a summary leaves nothing cached behind, whether it fails or not."""
    engine, session = spark
    persisted = session.sparkContext._jsc.sc().getPersistentRDDs().size()
    root = str(tmp_path / "ok")
    three_ranks(root)
    engine.summarize(session, root)
    assert session.sparkContext._jsc.sc().getPersistentRDDs().size() == persisted
    f = LogFactory(tmp_path / "bad")  # a dataset of 10 samples
    f.attempt(0, None)
    f.commit(0, 1, None, batch(0, 0, 0, 0, ids=[1, 10, 2]), (0, 1))
    bad = str(tmp_path / "bad")
    for audit in (lambda: engine.summarize(session, bad), lambda: summarize(bad)):
        with pytest.raises(LogCorrupted, match="sample id 10, outside the dataset's"):
            audit()
    assert session.sparkContext._jsc.sc().getPersistentRDDs().size() == persisted


def test_distinct_counts_at_bitmap_word_edges(spark, tmp_path):
    """The distinct counts are popcounts of 64-id words: ids at word edges (0, 63 -- the
    sign bit -- 64, 127, 128), repeated across batches and commits, skipped and consumed,
    count as DuckDB's bitmap pass counts them, and as written out here."""
    engine, session = spark
    f = LogFactory(tmp_path / "log", dataset_len=200)
    f.attempt(0, None)
    ids = [[0, 63, 64], [127, 128, 199], [63, 64, 5]]
    rows = [r for b, i in enumerate(ids) for r in batch(0, 0, b, 3 * b, i)]
    rows += [(0, 0, -1, 0, 2, 9, 130, "skip"), (0, 0, -1, 0, 2, 10, 63, "skip")]
    c3 = f.commit(0, 3, None, rows, (1, 0))
    f.commit(0, 4, c3, batch(0, 1, 3, 0, [63, 1, 2]), (1, 1))
    got = engine.summarize(session, str(tmp_path / "log"))
    assert got == summarize(str(tmp_path / "log"))
    e0, e1 = got.epochs
    assert (e0.samples, e0.distinct, e0.duplicates) == (9, 7, 2)
    assert (e0.skipped, e0.skipped_distinct, e0.covered) == (2, 2, 8)
    assert (e1.samples, e1.distinct, e1.duplicates, e1.covered) == (3, 3, 0, 3)


def test_manifest_ranges_match_the_walked_lineage(tmp_path):
    """Without Spark: each marker's ranges select exactly the walked lineage."""
    from ledger.commits import lineage, list_commits
    from ledger.manifest import in_ranges

    root = str(tmp_path / "log")
    three_ranks(root)
    store = Store(root)
    commits = list_commits(store)
    for c in commits:
        walked = {x.id for x in lineage(store, c.id)}
        assert c.lineage_ranges is not None
        picked = {x.id for x in commits if in_ranges(c.lineage_ranges, x.attempt, x.step)}
        assert picked == walked, c.id
    by_id = {c.id: c for c in commits}
    assert by_id["000000000005-0001"].lineage_ranges == ((0, 2, 3), (1, 5, 5))
    assert by_id["000000000004-0000"].lineage_ranges == ((0, 2, 4),)


def test_cli_engine_spark_prints_what_duckdb_prints(spark, tmp_path):
    from click.testing import CliRunner

    from ledger.cli import main

    root = str(tmp_path / "log")
    three_ranks(root)
    runner = CliRunner()
    for args in (  # the checks' equality is assert_same's
        ["--format", "json"],
        ["--sql", "SELECT rank, count(*) AS n FROM lineage GROUP BY rank ORDER BY rank",
         "--format", "csv"],
    ):  # fmt: skip
        duck = runner.invoke(main, ["audit", root, *args])
        got = runner.invoke(
            main, ["audit", root, "--engine", "spark", "--master", "local[1]", *args]
        )
        assert (got.exit_code, got.output) == (duck.exit_code, duck.output), args
    bad = runner.invoke(main, ["audit", root, "--engine", "spark", "--sql", "SELECT nope FROM x"])
    assert bad.exit_code == 1 and bad.output.startswith("Error: ") and bad.output[-1] == "\n"
    assert bad.output.count("\n") == 1


def test_verify_fails_on_an_altered_manifest(tmp_path):
    root = str(tmp_path / "log")
    three_ranks(root)
    rel = os.path.join(root, "manifest", "000000000003-0000.parquet")
    other = os.path.join(root, "manifest", "000000000002-0000.parquet")
    shutil.copyfile(other, rel)  # a valid manifest, of another commit
    result = {r.check: r for r in verify(root).results}["manifest"]
    assert not result.ok
    assert "000000000003-0000.parquet has another SHA-256 than commit" in result.detail


def test_verify_decodes_a_head_manifest_whose_marker_names_its_sha256(tmp_path):
    """The manifest check hashes every manifest and decodes the heads': a head's marker
    rewritten to name another commit's (valid) manifest passes the SHA-256 comparison and
    must still fail on content. An inner manifest truncated fails on its SHA-256."""
    import json
    from pathlib import Path

    root = str(tmp_path / "log")
    three_ranks(root)
    head = "000000000005-0001"
    other = Path(root, "manifest", "000000000003-0000.parquet").read_bytes()
    Path(root, "manifest", f"{head}.parquet").write_bytes(other)
    marker = Path(root, "commits", f"{head}.json")
    d = json.loads(marker.read_bytes())
    d["manifest"].update(bytes=len(other), sha256=sha256(other))
    marker.write_text(json.dumps(d))
    inner = os.path.join(root, "manifest", "000000000002-0000.parquet")
    with open(inner, "r+b") as f:
        f.truncate(100)
    result = {r.check: r for r in verify(root).results}["manifest"]
    assert not result.ok
    assert result.detail.startswith("2 bad: ")
    assert "000000000002-0000.parquet has another SHA-256 than commit" in result.detail
    assert f"manifest of {head} differs from its marker's rank table" in result.detail


def _bench_tool():
    """``tools/bench_spark.py`` as a module (tools/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "bench_spark.py"
    spec = importlib.util.spec_from_file_location("bench_spark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 4097, 100_003])
def test_bench_permutation_is_a_bijection_evaluated_per_slice(n):
    """The benchmark's Feistel permutation (no array of the whole epoch) maps [0, n) onto
    itself one to one, also when evaluated slice by slice as the log writer does; two
    seeds give two different orders (for n >= 17; small n have few orders to pick from)."""
    import itertools

    import numpy as np

    permuted = _bench_tool().permuted
    whole = permuted(np.arange(n, dtype=np.int64), n, 0)
    assert whole.dtype == np.int64
    assert sorted(whole.tolist()) == list(range(n))
    cut = [0, n // 3, n // 2, n]
    pieces = [permuted(np.arange(a, b, dtype=np.int64), n, 0) for a, b in itertools.pairwise(cut)]
    assert np.concatenate(pieces).tolist() == whole.tolist()
    if n >= 17:
        assert permuted(np.arange(n, dtype=np.int64), n, 1).tolist() != whole.tolist()


def test_bench_log_is_one_epoch_without_duplicates(tmp_path):
    """The benchmark's log at a small size: the DuckDB summary sees one epoch of distinct
    ids, every full global batch of every rank."""
    tool = _bench_tool()
    n, ranks_ = 3 * 4 * tool.BATCH + 5, 4
    root = str(tmp_path / "log")
    tool.make_log(root, n, ranks_)
    (epoch,) = summarize(root).epochs
    assert epoch.samples == epoch.distinct == 3 * 4 * tool.BATCH
    assert epoch.duplicates == 0
