"""The HTML report of a log, checked on the example log of the log factory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from logfactory import RUN_ID, LogFactory, example_log

import ledger.audit.report as report
from ledger.audit import connect, summarize, write_report
from ledger.errors import CommitNotFound

HEAD = "000000000007-0002"
SECTIONS = [
    "Summary",
    "Epochs",
    "Coverage per epoch",
    "Duplicates over time",
    "Per-rank progress",
    "Ranks at the head",
    "Commits and abandoned branches",
    "Attempts",
    "Orphan segments and uncommitted work",
]


@pytest.fixture
def log(tmp_path: Path) -> LogFactory:
    return example_log(tmp_path / "log")


@pytest.fixture
def page(log: LogFactory, tmp_path: Path) -> str:
    out = write_report(str(log.root), tmp_path / "report.html")
    assert out == tmp_path / "report.html"
    return out.read_text(encoding="utf-8")


def table_rows(page: str, first_header: str) -> list[list[str]]:
    """Cell texts of the table whose first header cell is ``first_header``."""
    tables = re.findall(r"<table>(.*?)</table>", page, re.S)
    start = rf"<thead><tr><th[^>]*>{re.escape(first_header)}</th>"
    match = [t for t in tables if re.match(start, t)]
    assert len(match) == 1, f"{len(match)} tables start with {first_header!r}"
    body = match[0].split("<tbody>", 1)[1]
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr.*?</tr>", body)]


def test_page_is_self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    lowered = page.lower()
    for external in ('src="http', 'href="http', "<script", "<link", "@import", "url(http"):
        assert external not in lowered, external
    # Every reference inside the inline SVGs points at an id defined in the page.
    ids = set(re.findall(r'\bid="([^"]+)"', page))
    refs = set(re.findall(r'href="#([^"]+)"', page)) | set(re.findall(r"url\(#([^)]+)\)", page))
    assert refs and refs <= ids


def test_page_has_every_plot_and_section(page: str) -> None:
    assert page.count("<svg") == 4
    assert page.count('<div class="plot"><svg') == 4
    for title in SECTIONS:
        assert f">{title}</h" in page, title
    assert f"run <code>{RUN_ID}</code>" in page
    assert f"head <code>{HEAD}</code>" in page


def test_svg_ids_are_unique_across_plots(page: str) -> None:
    # matplotlib names glyphs the same in every figure; the prefixes keep them apart.
    defined = re.findall(r'\bid="([^"]+)"', page)
    assert len(defined) == len(set(defined))
    prefixes = {d.split("-", 1)[0] for d in defined}
    assert {"coverage", "duplicates", "ranks", "timeline"} <= prefixes


def test_epochs_table_shows_the_duplicate_of_epoch_1(page: str) -> None:
    # epoch, samples, distinct, coverage, duplicates, skipped, status
    assert table_rows(page, "epoch") == [
        ["0", "9", "9", "90.00%", "0", "1", "finished"],
        ["1", "9", "8", "80.00%", "1", "1", "duplicates"],
        ["2", "3", "3", "30.00%", "0", "0", "in progress"],
    ]
    assert '<tr class="bad"><td class="l">1</td>' in page
    # The findings are the checks' verdicts, in the checks' words.
    assert '<li class="bad">duplicates: duplicate consumptions: epoch 1: 1</li>' in page
    # Sample 3 of epoch 1 was never served: 8 distinct + 1 skipped < 10.
    assert '<li class="bad">coverage: epoch 1: 1 samples neither consumed nor skipped</li>' in page


def test_plot_data_puts_the_duplicate_at_batch_5(log: LogFactory) -> None:
    con = connect(str(log.root))
    width, steps = report._count(con)
    curves = report._epoch_curves(con, summarize(str(log.root)), width)
    assert width == 1
    assert steps == [2, 4, 6, 7]
    got = [(c.epoch, c.start, c.x, c.consumed, c.distinct) for c in curves]
    assert got == [
        (0, 0, (1, 2, 3), (3, 6, 9), (3, 6, 9)),
        # after batch 5 (6 batches consumed): 9 consumed, 8 distinct, so 1 duplicate
        (1, 3, (4, 5, 6), (3, 6, 9), (3, 6, 8)),
        (2, 6, (7,), (3,), (3,)),
    ]
    lines, band = report._rank_progress(con)
    assert lines == {0: [(2, 6), (4, 12), (6, 18), (7, 21)]}
    assert band == []


def test_bucketed_plot_data_keeps_the_totals(log: LogFactory, monkeypatch) -> None:
    monkeypatch.setattr(report, "MAX_POINTS", 2)  # 7 batches, 2 points: buckets of 4
    con = connect(str(log.root))
    width, _ = report._count(con)
    curves = report._epoch_curves(con, summarize(str(log.root)), width)
    assert width == 4
    got = [(c.epoch, c.start, c.x, c.consumed, c.distinct) for c in curves]
    assert got == [
        (0, 0, (3,), (9,), (9,)),
        (1, 3, (4, 6), (3, 9), (3, 8)),
        (2, 6, (7,), (3,), (3,)),
    ]


def test_many_ranks_become_a_band(log: LogFactory, monkeypatch) -> None:
    monkeypatch.setattr(report, "_MAX_RANK_LINES", 0)
    con = connect(str(log.root))
    report._count(con)
    lines, band = report._rank_progress(con)
    assert lines == {}
    assert band == [(2, 6, 6.0, 6), (4, 12, 12.0, 12), (6, 18, 18.0, 18), (7, 21, 21.0, 21)]


def test_abandoned_branch_orphan_and_attempts(page: str) -> None:
    assert "1 abandoned commit(s), with 3 sample(s) seen by discarded models" in page
    assert "events/attempt=0/rank=0/seg-000000000006.parquet" in page
    assert "1 orphan segment(s)" in page
    # attempt, resumed from, world size, commits, events, uncommitted batches/samples, ...
    rows = table_rows(page, "attempt")
    assert [r[:5] for r in rows] == [
        ["0", "fresh start", "1", "3", "16"],
        ["1", "000000000004-0000", "1", "2", "10"],
        ["2", "000000000007-0001", "1", "1", "0"],
        ["3", "000000000007-0002", "1", "0", "0"],
    ]
    assert table_rows(page, "rank") == [["0", "2", "1", "7", "21", "0"]]


def test_output_is_deterministic(log: LogFactory, tmp_path: Path) -> None:
    first = write_report(str(log.root), tmp_path / "a.html").read_bytes()
    second = write_report(str(log.root), tmp_path / "b.html").read_bytes()
    assert first == second
    # ... and in a fresh interpreter (no matplotlib state, another hash seed).
    code = (
        "import sys; from ledger.audit import write_report; write_report(sys.argv[1], sys.argv[2])"
    )
    env_out = tmp_path / "c.html"
    subprocess.run(
        [sys.executable, "-c", code, str(log.root), str(env_out)],
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert env_out.read_bytes() == first


def test_head_selects_the_lineage(log: LogFactory, tmp_path: Path) -> None:
    abandoned = "000000000005-0000"
    page = write_report(str(log.root), tmp_path / "r.html", head=abandoned).read_text()
    assert f"head <code>{abandoned}</code>" in page
    # The abandoned branch's lineage has no duplicate; attempt 1's commits are now off it.
    assert [r[4] for r in table_rows(page, "epoch")] == ["0", "0"]
    assert "3 abandoned commit(s), with 9 sample(s)" in page


def test_bad_head_raises(log: LogFactory, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    with pytest.raises(CommitNotFound):
        write_report(str(log.root), out, head="000000000099-0009")
    assert not out.exists()


def test_log_strings_are_escaped(log: LogFactory, tmp_path: Path) -> None:
    record = log.root / "attempts/0000.json"
    data = json.loads(record.read_text())
    data["host"] = '<img src="http://x/y.png">&'
    record.write_text(json.dumps(data))
    page = write_report(str(log.root), tmp_path / "r.html").read_text()
    assert "&lt;img src=&quot;http://x/y.png&quot;&gt;&amp;" in page
    assert "<img" not in page


def test_log_without_commits(tmp_path: Path) -> None:
    f = LogFactory(tmp_path / "log")
    f.attempt(0, None)
    page = write_report(str(f.root), tmp_path / "r.html").read_text()
    assert page.count("<svg") == 4
    assert "head <code>none</code>" in page
    assert "the lineage holds no consumed sample yet" in page
