"""The HTML report of a log, checked on the example log of the log factory."""

from __future__ import annotations

import datetime
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
    "Wall-clock time",
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
    assert page.count("<svg") == 5
    assert page.count('<div class="plot"><svg') == 5
    for title in SECTIONS:
        assert f">{title}</h" in page, title
    assert f"run <code>{RUN_ID}</code>" in page
    assert f"head <code>{HEAD}</code>" in page


def test_svg_ids_are_unique_across_plots(page: str) -> None:
    # matplotlib names glyphs the same in every figure; the prefixes keep them apart.
    defined = re.findall(r'\bid="([^"]+)"', page)
    assert len(defined) == len(set(defined))
    prefixes = {d.split("-", 1)[0] for d in defined}
    assert {"coverage", "duplicates", "ranks", "clock", "timeline"} <= prefixes


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
    assert page.count("<svg") == 5
    assert "head <code>none</code>" in page
    assert "the lineage holds no consumed sample yet" in page


def test_wall_clock_shows_the_time_before_each_restart(log: LogFactory, page: str) -> None:
    con = connect(str(log.root))
    commits, gaps = report._clock(con)
    t = datetime.datetime
    # From the last commit before each attempt started to its start: 55, 53 and 53 min.
    assert gaps == [
        (1, t(2025, 1, 2, 0, 5), t(2025, 1, 2, 1, 0)),
        (2, t(2025, 1, 2, 1, 7), t(2025, 1, 2, 2, 0)),
        (3, t(2025, 1, 2, 2, 7), t(2025, 1, 2, 3, 0)),
    ]
    # Resumed attempts of the lineage start at their parent's step (4 and 7).
    assert (t(2025, 1, 2, 1, 0), 4, 1, True) in commits
    assert (t(2025, 1, 2, 2, 0), 7, 2, True) in commits
    assert (t(2025, 1, 2, 0, 5), 5, 0, False) in commits
    assert "3 restart(s); 2 h 41 min between the last commit before a restart" in page


def test_times_are_utc_with_z_and_ids_never_wrap(page: str) -> None:
    assert '<td class="">2025-01-02T03:04:05Z</td>' in page  # run.json's created_at
    assert "white-space: nowrap" in page
    assert '<div class="scroll"><table>' in page


def test_coverage_axis_zooms_when_an_epoch_has_barely_begun() -> None:
    curves = [report._Curve(epoch=0, start=0, x=(1, 2), consumed=(4, 8), distinct=(4, 8))]
    # 8 of 10,000 ids (0.08%): the axis tops at 0.104%, not 100%, so the line climbs.
    assert report._coverage_axis_top(curves, 10_000) == pytest.approx(0.104)
    assert report._coverage_axis_top(curves, 10) == 105.0  # 80%: the 0-100% axis
    assert report._coverage_axis_top(curves, None) is None
    assert report._coverage_plot(curves, 10_000, set()) != report._coverage_plot(curves, 10, set())


def _jsonl(directory: Path, files: int, docs: int) -> None:
    directory.mkdir()
    for f in range(files):
        with open(directory / f"part-{f}.jsonl", "w") as out:
            for d in range(docs):
                out.write(json.dumps({"text": "x" * (3 + 5 * d + f)}) + "\n")


def test_token_figures_of_a_packed_run(tmp_path: Path) -> None:
    from conftest import packed_stream

    import ledger

    _jsonl(tmp_path / "shards", 2, 5)
    root = str(tmp_path / "log")
    loader = ledger.DataLoader(
        packed_stream(str(tmp_path / "shards"), shuffle_buffer=2, seq_len=16),
        batch_size=2, shuffle=True, seed=1, log=root,
    )  # fmt: skip
    tokens = padding = sequences = 0
    for batch in loader:  # one epoch: the last sequence of each worker is padded
        owner = batch["sample_ids"]
        tokens += int((owner != -1).sum())
        padding += int((owner == -1).sum())
        sequences += int(owner.shape[0])
    loader.state_dict()
    got = report._tokens(connect(root), 16)
    assert got == [report._Tokens(0, tokens, tokens + padding)]
    assert padding > 0 and (tokens + padding) == 16 * sequences
    page = write_report(root, tmp_path / "r.html").read_text()
    assert ">Tokens (packed stream)</h2>" in page
    share = f"{100 * padding / (tokens + padding):.2f}%"
    table = page.split(">Tokens (packed stream)</h2>", 1)[1].split("</table>", 1)[0]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", table)
    assert cells == ["0", str(sequences), f"{tokens:,}", str(padding), share]
    assert f"{tokens:,} tokens seen (EOS included) in {sequences} sequences of 16" in page
