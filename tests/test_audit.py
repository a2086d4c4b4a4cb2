"""The audit views and summary, checked against the rows the log factory wrote."""

from __future__ import annotations

import gc
import os
import tempfile
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import duckdb
import pytest
from logfactory import DATASET_LEN, RUN_ID, LogFactory, Row, batch, example_log

from ledger.audit import AttemptSummary, EpochSummary, Position, Summary, connect, summarize
from ledger.audit.summary import RankSummary
from ledger.errors import CommitNotFound, LogCorrupted
from ledger.schema import EVENT_SCHEMA

LINEAGE = ["000000000002-0000", "000000000004-0000", "000000000006-0001",
           "000000000007-0001", "000000000007-0002"]  # fmt: skip
ABANDONED = "000000000005-0000"
EVENT_COLUMNS = "attempt, rank, worker, epoch, batch, position, sample_id, kind, commit_id, step"


@pytest.fixture
def log(tmp_path: Path) -> LogFactory:
    return example_log(tmp_path / "log")


def with_commit(factory: LogFactory, ids: list[str]) -> list[tuple]:
    """Rows of the commits ``ids`` with their commit id and step appended, sorted."""
    return sorted((*r, cid, int(cid[:12])) for cid in ids for r in factory.committed[cid])


def fetch(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple]:
    return con.execute(sql).fetchall()


def epoch_stats(rows: list[Row]) -> list[tuple[int, int, int, int]]:
    """(epoch, samples, distinct, skipped) computed in Python, the ground truth."""
    samples: dict[int, list[int]] = defaultdict(list)
    skipped: dict[int, int] = defaultdict(int)
    for _, _, _, epoch, _, _, sample_id, kind in rows:
        if kind == "sample":
            samples[epoch].append(sample_id)
        else:
            skipped[epoch] += 1
    epochs = sorted(set(samples) | set(skipped))
    return [(e, len(samples[e]), len(set(samples[e])), skipped[e]) for e in epochs]


# ---------------------------------------------------------------- views


def test_events_holds_every_committed_row_of_every_branch(log: LogFactory) -> None:
    con = connect(str(log.root))
    got = fetch(con, f"SELECT {EVENT_COLUMNS} FROM events ORDER BY ALL")
    assert got == with_commit(log, sorted(log.committed))
    assert len(got) == 26


def test_events_excludes_the_orphan_segment(log: LogFactory) -> None:
    # The orphan is attempt 0's batch 5, in a file beside the committed ones.
    assert (log.root / "events/attempt=0/rank=0/seg-000000000006.parquet").exists()
    con = connect(str(log.root))
    assert fetch(con, "SELECT count(*) FROM events WHERE attempt = 0 AND batch = 5") == [(0,)]
    assert set(log.orphans).isdisjoint(r[:8] for r in fetch(con, "SELECT * FROM events"))


def test_lineage_of_the_default_head(log: LogFactory) -> None:
    con = connect(str(log.root))
    got = fetch(con, f"SELECT {EVENT_COLUMNS} FROM lineage ORDER BY ALL")
    assert got == with_commit(log, LINEAGE)
    assert fetch(con, "SELECT DISTINCT commit_id FROM lineage ORDER BY 1") == [
        (c,) for c in LINEAGE[:-1]
    ]  # the head's own marker names no segment


@pytest.mark.parametrize(
    ("head", "chain"),
    [
        (ABANDONED, ["000000000002-0000", "000000000004-0000", ABANDONED]),
        ("000000000004-0000", ["000000000002-0000", "000000000004-0000"]),
        ("000000000002-0000", ["000000000002-0000"]),
    ],
)
def test_lineage_of_a_given_head(log: LogFactory, head: str, chain: list[str]) -> None:
    con = connect(str(log.root), head=head)
    assert fetch(con, f"SELECT {EVENT_COLUMNS} FROM lineage ORDER BY ALL") == with_commit(
        log, chain
    )
    assert fetch(con, "SELECT commit_id FROM commits WHERE in_lineage ORDER BY 1") == [
        (c,) for c in chain
    ]
    assert fetch(con, "SELECT commit_id FROM commits WHERE is_head") == [(head,)]


def test_commits_view(log: LogFactory) -> None:
    con = connect(str(log.root))
    got = fetch(
        con,
        "SELECT commit_id, step, attempt, parent, world_size, segments, rows, epoch, "
        "epoch_batch, batch, in_lineage, is_head FROM commits ORDER BY commit_id",
    )
    assert got == [
        ("000000000002-0000", 2, 0, None, 1, 1, 6, 0, 2, 2, True, False),
        ("000000000004-0000", 4, 0, "000000000002-0000", 1, 1, 7, 1, 1, 4, True, False),
        ("000000000005-0000", 5, 0, "000000000004-0000", 1, 1, 3, 1, 2, 5, False, False),
        ("000000000006-0001", 6, 1, "000000000004-0000", 1, 1, 7, 2, 0, 6, True, False),
        ("000000000007-0001", 7, 1, "000000000006-0001", 1, 1, 3, 2, 1, 7, True, False),
        ("000000000007-0002", 7, 2, "000000000007-0001", 1, 0, 0, 2, 1, 7, True, True),
    ]
    # "+00:00" in the marker, naive UTC in the view.
    assert fetch(con, "SELECT created_at FROM commits WHERE commit_id = '000000000006-0001'") == [
        (datetime(2025, 1, 2, 1, 6),)
    ]


def test_segments_view_matches_the_files(log: LogFactory) -> None:
    con = connect(str(log.root))
    for commit_id, path, rows, size in fetch(
        con, "SELECT commit_id, path, rows, bytes FROM segments ORDER BY commit_id"
    ):
        assert rows == len(log.committed[commit_id])
        assert size == os.path.getsize(log.root / path)
    assert fetch(con, "SELECT count(*) FROM segments") == [(5,)]


def test_attempts_and_run_views(log: LogFactory) -> None:
    con = connect(str(log.root))
    assert fetch(con, "SELECT * FROM attempts ORDER BY attempt") == [
        (0, None, 1, datetime(2025, 1, 2, 0, 0), "node-a", 1000),
        (1, "000000000004-0000", 1, datetime(2025, 1, 2, 1, 0), "node-a", 1001),
        (2, "000000000007-0001", 1, datetime(2025, 1, 2, 2, 0), "node-a", 1002),
        (3, "000000000007-0002", 1, datetime(2025, 1, 2, 3, 0), "node-a", 1003),
    ]
    assert fetch(con, "SELECT run_id, dataset_len, batch_size, drop_last FROM run") == [
        (RUN_ID, DATASET_LEN, 3, True)
    ]


def test_views_of_a_log_without_commits(tmp_path: Path) -> None:
    LogFactory(tmp_path)
    con = connect(str(tmp_path))
    for view in ("events", "lineage", "commits", "segments", "states", "attempts"):
        assert fetch(con, f"SELECT count(*) FROM {view}") == [(0,)], view
    assert [d[0] for d in con.execute("SELECT * FROM events").description] == [
        *EVENT_SCHEMA.names,
        "commit_id",
        "step",
    ]


def test_unknown_head_raises_commit_not_found(log: LogFactory) -> None:
    with pytest.raises(CommitNotFound, match="000000000099-0000"):
        connect(str(log.root), head="000000000099-0000")


def test_missing_root_raises_commit_not_found(tmp_path: Path) -> None:
    with pytest.raises(CommitNotFound, match=r"no run\.json"):
        connect(str(tmp_path / "nowhere"))


def test_missing_parent_raises_log_corrupted(log: LogFactory) -> None:
    (log.root / "commits/000000000004-0000.json").unlink()
    with pytest.raises(LogCorrupted, match="000000000004-0000"):
        connect(str(log.root))


def test_missing_segment_raises_log_corrupted(log: LogFactory) -> None:
    (log.root / "events/attempt=0/rank=0/seg-000000000005.parquet").unlink()
    missing = r"seg-000000000005\.parquet named by commit 000000000005-0000 is missing"
    with pytest.raises(LogCorrupted, match=missing):
        connect(str(log.root))


# ---------------------------------------------------------------- confinement


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM glob('/etc/*')",
        # even the log's own files: only the views reach them
        "SELECT * FROM read_parquet('{root}/events/attempt=0/rank=0/seg-000000000006.parquet')",
        "SELECT * FROM read_json('{root}/run.json')",
        "ATTACH '{tmp}/db.duckdb' AS other",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        "RESET enable_external_access",
        "SET temp_directory = '{tmp}'",
    ],
)
def test_user_sql_cannot_reach_files_or_unlock(log: LogFactory, tmp_path: Path, sql: str) -> None:
    con = connect(str(log.root))
    with pytest.raises(duckdb.Error):
        con.execute(sql.format(root=log.root, tmp=tmp_path))
    assert not (tmp_path / "db.duckdb").exists()
    assert fetch(con, "SELECT count(*) FROM events") == [(26,)]  # views still work


@pytest.mark.parametrize(
    "target",
    ["{tmp}/x.csv", "{root}/x.csv", "{root}/events/attempt=0/rank=0/seg-000000000002.parquet"],
)
def test_user_sql_cannot_write_files(log: LogFactory, tmp_path: Path, target: str) -> None:
    path = Path(target.format(tmp=tmp_path, root=log.root))
    before = path.read_bytes() if path.exists() else None
    con = connect(str(log.root))
    for options in ("", "(FORMAT csv, USE_TMP_FILE false)"):
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"COPY (SELECT 42 AS x) TO '{path}' {options}")
    assert (path.read_bytes() if path.exists() else None) == before


def test_spill_directory_is_removed_with_the_connection(log: LogFactory) -> None:
    con = connect(str(log.root))
    (scratch,) = con.execute("SELECT current_setting('temp_directory')").fetchone() or ("",)
    assert os.path.basename(scratch).startswith("ledger-audit-")
    assert os.path.isdir(scratch)
    con.close()
    del con
    gc.collect()
    assert not os.path.exists(scratch)


@pytest.mark.parametrize("damage", ["unknown head", "missing parent", "no run"])
def test_a_log_that_cannot_be_read_leaves_no_connection_or_spill_directory(
    log: LogFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """DuckDB opens on a background thread while the log is read: when reading fails,
    that connection is closed and its spill directory removed before the error is
    raised (nothing is left for a garbage collection)."""
    spills = tmp_path / "spills"
    spills.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spills))
    opened: list[duckdb.DuckDBPyConnection] = []
    real = duckdb.connect

    def spy(*args: object, **kwargs: object) -> duckdb.DuckDBPyConnection:
        con = real(*args, **kwargs)  # type: ignore[arg-type]
        opened.append(con)
        return con

    monkeypatch.setattr(duckdb, "connect", spy)
    root, head = str(log.root), None
    if damage == "unknown head":
        head = "000000000099-0000"
    elif damage == "missing parent":
        (log.root / "commits/000000000004-0000.json").unlink()
    else:
        root = str(tmp_path / "nowhere")
    gc.disable()  # the cleanup must not wait for a collection
    try:
        with pytest.raises((CommitNotFound, LogCorrupted)):
            connect(root, head=head)
        assert len(opened) == 1
        with pytest.raises(duckdb.ConnectionException):
            opened[0].execute("SELECT 1")  # closed
        assert list(spills.iterdir()) == []
    finally:
        gc.enable()


# ---------------------------------------------------------------- summary


def test_summary_of_the_default_head(log: LogFactory) -> None:
    assert summarize(str(log.root)) == Summary(
        run_id=RUN_ID,
        dataset_len=10,
        attempts=(
            AttemptSummary(0, None, commits=3, events=16),
            AttemptSummary(1, "000000000004-0000", commits=2, events=10),
            AttemptSummary(2, "000000000007-0001", commits=1, events=0),
            AttemptSummary(3, "000000000007-0002", commits=0, events=0),
        ),
        commits=6,
        head="000000000007-0002",
        epochs=(
            EpochSummary(0, 9, 9, 0.9, duplicates=0, skipped=1, skipped_distinct=1, covered=10),
            EpochSummary(1, 9, 8, 0.8, duplicates=1, skipped=1, skipped_distinct=1, covered=9),
            EpochSummary(2, 3, 3, 0.3, duplicates=0, skipped=0, skipped_distinct=0, covered=3),
        ),
        abandoned_commits=1,
        abandoned_samples=3,
        last_position=Position(epoch=2, position=2),
        ranks=(RankSummary(rank=0, epoch=2, epoch_batch=1, batch=7, samples=21, behind=0),),
    )


@pytest.mark.parametrize("head", [None, ABANDONED, "000000000004-0000", "000000000006-0001"])
def test_summary_epochs_match_the_rows_written(log: LogFactory, head: str | None) -> None:
    s = summarize(str(log.root), head=head)
    con = connect(str(log.root), head=head)
    chain = [c for (c,) in fetch(con, "SELECT commit_id FROM commits WHERE in_lineage")]
    rows = [r for c in chain for r in log.committed[c]]
    assert [(e.epoch, e.samples, e.distinct, e.skipped) for e in s.epochs] == epoch_stats(rows)
    assert all(e.duplicates == e.samples - e.distinct for e in s.epochs)
    last_epoch = max(r[3] for r in rows if r[7] == "sample")
    last = max(r[5] for r in rows if r[7] == "sample" and r[3] == last_epoch)
    assert s.last_position == Position(last_epoch, last)
    others = [r for c in log.committed if c not in chain for r in log.committed[c]]
    assert s.abandoned_commits == len(log.committed) - len(chain)
    assert s.abandoned_samples == sum(r[7] == "sample" for r in others)


def test_summary_of_an_abandoned_head(log: LogFactory) -> None:
    s = summarize(str(log.root), head=ABANDONED)
    assert s.head == ABANDONED
    assert s.epochs == (
        EpochSummary(0, 9, 9, 0.9, duplicates=0, skipped=1, skipped_distinct=1, covered=10),
        EpochSummary(1, 6, 6, 0.6, duplicates=0, skipped=0, skipped_distinct=0, covered=6),
    )
    assert (s.abandoned_commits, s.abandoned_samples) == (3, 9)
    assert s.last_position == Position(1, 5)


def test_summary_of_a_log_without_commits(tmp_path: Path) -> None:
    LogFactory(tmp_path)
    assert summarize(str(tmp_path)) == Summary(
        run_id=RUN_ID,
        dataset_len=10,
        attempts=(),
        commits=0,
        head=None,
        epochs=(),
        abandoned_commits=0,
        abandoned_samples=0,
        last_position=None,
    )


@pytest.mark.parametrize(
    "ids",
    [
        [7, 5, 7],  # a bitmap over ids 5..7
        [0, 2**40, 0],  # 2**40 apart: too far for a bitmap, counted by hashing
    ],
)
def test_summary_counts_distinct_ids_exactly(tmp_path: Path, ids: list[int]) -> None:
    f = LogFactory(tmp_path, dataset_len=2**41)
    f.attempt(0, None)
    f.commit(0, 1, None, batch(0, 0, 0, 0, ids=ids), (0, 1))
    (epoch,) = summarize(str(tmp_path)).epochs
    assert (epoch.samples, epoch.distinct, epoch.duplicates) == (3, 2, 1)
    assert epoch.coverage == 2 / 2**41


def test_uncommitted_batches_of_a_crashed_attempt(tmp_path) -> None:
    """Batches consumed after the last commit are in the journal, and the audit shows them."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from conftest import Augmented

    import ledger
    from ledger.testing import take

    root = str(tmp_path / "log")

    def make():
        return ledger.DataLoader(Augmented(30), batch_size=4, shuffle=True, seed=3, log=root)

    crashed = make()
    list(take(crashed, 2))
    token = crashed.state_dict()
    lost = [b["id"].tolist() for b in take(crashed, 3)]  # never committed: "killed" here
    crashed.log.close()
    resumed = make()
    resumed.load_state_dict(token)
    list(take(resumed, 4))
    resumed.state_dict()

    summary = summarize(root)
    assert [
        (a.attempt, a.uncommitted_batches, a.uncommitted_samples) for a in summary.attempts
    ] == [
        (0, 3, 12),
        (1, 0, 0),
    ]
    con = connect(root)
    rows = con.execute(
        "SELECT batch, sample_id FROM uncommitted ORDER BY batch, position"
    ).fetchall()
    assert [r[0] for r in rows] == [2] * 4 + [3] * 4 + [4] * 4
    assert [r[1] for r in rows] == [i for b in lost for i in b]
