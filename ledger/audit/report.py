"""A self-contained HTML report of a log: the audit summary as tables, and five plots.

The page has no external resource (no script, stylesheet, font or image is fetched): the
plots are inline SVG drawn by matplotlib's object-oriented API (no pyplot, no global
backend), with glyphs as paths. The output is a pure function of the log and the head:
no wall-clock time, and matplotlib's SVG ids are salted with a constant, so two reports
of the same log are byte-identical.

Every plot is aggregated in DuckDB before it reaches Python: the batch (or step) axis is
cut into at most :data:`MAX_POINTS` buckets, so a log of 10**8 events costs a few scans,
not 10**8 Python objects.
"""

from __future__ import annotations

import bisect
import datetime
import html
import io
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from ledger.audit.checks import coverage, duplicates
from ledger.audit.queries import output_file
from ledger.audit.summary import CONSUMED, Summary, epoch_status, summarize
from ledger.audit.views import connect
from ledger.commits import parsing_once, read_run
from ledger.segments import orphans
from ledger.store import Store

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_POINTS = 1500
"""Most points per plotted line; batches (or steps) are bucketed beyond that."""

_MAX_RANK_LINES = 16  # above this many ranks, the progress plot shows a min-median-max band
_MAX_LISTED = 50  # rows of the orphan-segment table
_WIDTH, _HEIGHT = 10.0, 3.6  # inches per plot
_LINEAGE, _ABANDONED, _UNCOMMITTED = "#1f77b4", "#d62728", "#ff7f0e"
_STEP = "step (batches handed to the training loop, per rank)"


@dataclass(frozen=True, slots=True)
class _Curve:
    """One epoch's cumulative counts, at the end of each (bucket of) batch(es).

    Attributes:
        epoch: the epoch.
        start: index of its first batch (the curve starts there at 0).
        x: batches consumed per rank after each point (last batch index + 1), shape (k,).
        consumed: ``CONSUMED`` events so far in the epoch, shape (k,).
        distinct: distinct sample ids so far in the epoch, shape (k,).
    """

    epoch: int
    start: int
    x: tuple[int, ...]
    consumed: tuple[int, ...]
    distinct: tuple[int, ...]


@parsing_once
def write_report(root: str, out: str | os.PathLike[str], head: str | None = None) -> Path:
    """Write one self-contained HTML page describing the log under ``root``.

    The page shows the run and the head, tables of the attempts, the epochs of the
    head's lineage (samples, coverage, duplicates, skipped positions), the ranks at the
    head, uncommitted work and orphan segments, token figures of a packed run (tokens
    seen, padding share), a mixture's shares (per source against target, per phase, over
    steps: :mod:`ledger.audit.mixture`), and five inline SVG plots: coverage per epoch
    (the axis zooms while an epoch is barely begun) and cumulative duplicates per epoch
    (both against the training step, i.e. the per-rank batch index + 1), samples
    consumed per rank against the commit step, commits against wall-clock time (the time
    before each restart shaded), and the commit timeline with abandoned branches. Cells
    never wrap (commit ids are copied whole); wide tables scroll. The same log and head
    always give the same bytes. Cost: about four scans of the lineage's events in DuckDB
    (one more over each epoch that holds a duplicate, one of the spans of a packed run);
    about 5 s for 2 * 10**7 events here (before the token figures and the wall-clock
    plot were added).

    Args:
        root: the log root (a local directory).
        out: path of the HTML file to write (UTF-8, about 0.2-1 MB; replaced if it
            exists). Its directory must exist.
        head: head commit id (``"000000000042-0001"``); ``None`` for the default head,
            the newest commit of the newest attempt that has commits.

    Returns:
        The path written.

    Raises:
        CommitNotFound: if ``root`` holds no run, or ``head`` names no commit.
        LogCorrupted: if the commit chain is broken or a committed segment is missing.
        StorageError: if listing the log's segment files fails.
        OSError: if ``out`` cannot be written. The page is written to a temporary file
            beside ``out`` and renamed over it, so a failure never leaves a partial page
            at ``out`` (a stray ``.*.tmp`` file may remain beside it).
    """
    summary = summarize(root, head)
    # Pin the head summarize resolved: a live run may commit between the two reads.
    con = connect(root, summary.head) if summary.head is not None else connect(root)
    try:
        page = _page(root, summary, con)
    finally:
        con.close()
    with output_file(out) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return Path(out)


# ---------------------------------------------------------------- data (DuckDB)


def _scalar(con: duckdb.DuckDBPyConnection, sql: str) -> Any:
    row = con.execute(sql).fetchone()
    return row[0] if row else None


def _bucket(extent: int) -> int:
    """Width of a bucket so that ``extent`` units give at most MAX_POINTS buckets."""
    return max(1, math.ceil(extent / MAX_POINTS))


def _count(con: duckdb.DuckDBPyConnection) -> tuple[int, list[int]]:
    """Create the temp table ``report_counts``: consumed events of the lineage per bucket.

    One scan of ``lineage`` feeds both the per-epoch curves (grouped by epoch and batch
    bucket; ``rank`` is NULL) and the per-rank progress (grouped by rank and step bucket;
    ``epoch`` is NULL): GROUPING SETS read the events once instead of twice.

    Returns:
        The batch bucket width (batches per point) and the lineage's commit steps, sorted.
    """
    batches = _scalar(
        con,
        "SELECT max(s.batch) FROM states AS s JOIN commits AS c USING (commit_id) "
        "WHERE c.in_lineage",
    )
    steps = [int(r[0]) for r in con.execute(
        "SELECT DISTINCT step FROM commits WHERE in_lineage ORDER BY 1"
    ).fetchall()]  # fmt: skip
    width, step_width = _bucket(int(batches or 0)), _bucket(steps[-1] if steps else 0)
    con.execute(
        f"""
        CREATE TEMP TABLE report_counts AS
        SELECT epoch, batch // {width} AS b, rank, step // {step_width} AS s,
               min(batch) AS lo, max(batch) AS hi, max(step) AS x, count(*) AS n
        FROM lineage WHERE {CONSUMED}
        GROUP BY GROUPING SETS ((epoch, b), (rank, s))
        """
    )
    return width, steps


def _epoch_curves(con: duckdb.DuckDBPyConnection, summary: Summary, width: int) -> list[_Curve]:
    """Cumulative consumed and distinct counts per epoch of the lineage, per batch bucket.

    Needs ``report_counts`` (:func:`_count`). A first consumption of an id is found by a
    GROUP BY (epoch, sample_id), the one costly step; it runs only for the epochs the
    summary found duplicates in. In the other epochs every consumption is a first one.

    Returns:
        The curves, by epoch.
    """
    # Epochs are ints read back from DuckDB, so formatting them into SQL is safe.
    dups = ", ".join(str(int(e.epoch)) for e in summary.epochs if e.duplicates)
    if dups:
        firsts = f"""
            SELECT epoch, first // {width} AS b, count(*) AS new FROM (
                SELECT epoch, min(batch) AS first FROM lineage
                WHERE {CONSUMED} AND epoch IN ({dups}) GROUP BY epoch, sample_id
            ) GROUP BY ALL
        """
        new = f"CASE WHEN c.epoch IN ({dups}) THEN coalesce(f.new, 0) ELSE c.n END"
    else:
        firsts = "SELECT NULL::INTEGER AS epoch, NULL::BIGINT AS b, NULL::BIGINT AS new"
        new = "c.n"
    rows = con.execute(
        f"""
        WITH firsts AS ({firsts})
        SELECT c.epoch, c.lo, c.hi + 1, sum(c.n) OVER w, sum({new}) OVER w
        FROM report_counts AS c LEFT JOIN firsts AS f USING (epoch, b)
        WHERE c.rank IS NULL
        WINDOW w AS (PARTITION BY c.epoch ORDER BY c.b)
        ORDER BY c.epoch, c.b
        """
    ).fetchall()
    curves: list[_Curve] = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][0] == rows[i][0]:
            j += 1
        part = rows[i:j]
        curves.append(
            _Curve(
                epoch=int(part[0][0]),
                start=int(min(r[1] for r in part)),
                x=tuple(int(r[2]) for r in part),
                consumed=tuple(int(r[3]) for r in part),
                distinct=tuple(int(r[4]) for r in part),
            )
        )
        i = j
    return curves


def _rank_progress(
    con: duckdb.DuckDBPyConnection,
) -> tuple[dict[int, list[tuple[int, int]]], list[tuple[int, int, float, int]]]:
    """Cumulative samples consumed per rank at each (bucket of) lineage commit step(s).

    Needs ``report_counts`` (:func:`_count`).

    Returns:
        ``(lines, band)``: with at most ``_MAX_RANK_LINES`` ranks, ``lines`` maps a rank
        to its ``(step, cumulative samples)`` points and ``band`` is empty; with more,
        ``lines`` is empty and ``band`` holds ``(step, min, median, max)`` over the ranks.
    """
    cum = """
        WITH cum AS (
            SELECT rank, s, x, sum(n) OVER (PARTITION BY rank ORDER BY s) AS c
            FROM report_counts WHERE epoch IS NULL
        )
    """
    ranks = int(_scalar(con, "SELECT count(DISTINCT rank) FROM report_counts") or 0)
    if ranks <= _MAX_RANK_LINES:
        lines: dict[int, list[tuple[int, int]]] = {}
        rows = con.execute(f"{cum} SELECT rank, x, c FROM cum ORDER BY rank, s").fetchall()
        for rank, x, c in rows:
            lines.setdefault(int(rank), []).append((int(x), int(c)))
        return lines, []
    band = con.execute(
        f"{cum} SELECT max(x), min(c), median(c), max(c) FROM cum GROUP BY s ORDER BY s"
    ).fetchall()
    return {}, [(int(x), int(lo), float(mid), int(hi)) for x, lo, mid, hi in band]


@dataclass(frozen=True, slots=True)
class _Tokens:
    """Token figures of one epoch of a packed lineage (``span`` events).

    Attributes:
        epoch: the epoch.
        tokens: tokens handed to the training loop (EOS included), per span
            ``token_end - token_start``.
        slots: sequence positions they filled: per batch, the batch's tokens rounded up to
            whole sequences of ``seq_len`` (only a worker's last sequence of an epoch is
            padded, and it ends its batch).
    """

    epoch: int
    tokens: int
    slots: int


def _tokens(con: duckdb.DuckDBPyConnection, seq_len: int) -> list[_Tokens]:
    """Tokens and padded sequence positions per epoch of the lineage (one scan of spans)."""
    rows = con.execute(
        f"""
        SELECT epoch, sum(t), sum(ceil(t / {int(seq_len)}) * {int(seq_len)}) FROM (
            SELECT epoch, rank, batch, sum(token_end - token_start) AS t
            FROM lineage WHERE kind = 'span' GROUP BY ALL
        ) GROUP BY 1 ORDER BY 1
        """
    ).fetchall()
    return [_Tokens(int(e), int(t), int(slots)) for e, t, slots in rows]


def _clock(
    con: duckdb.DuckDBPyConnection,
) -> tuple[list[tuple[Any, int, int, bool]], list[tuple[int, Any, Any]]]:
    """Commits against wall-clock time, and the gap before each restart.

    Returns:
        ``(commits, gaps)``: ``(created_at, step, attempt, in_lineage)`` per commit, and
        per resumed attempt of the lineage its start at its parent's step, by time; per
        attempt after the first, ``(attempt, last commit before it started or
        the previous attempt's start, its start)``: time in which nothing was committed,
        the job being down or its work since the last commit lost.
    """
    commits = [
        (t, int(step), int(a), bool(lin))
        for t, step, a, lin in con.execute(
            "SELECT created_at, step, attempt, in_lineage FROM commits ORDER BY created_at, step"
        ).fetchall()
    ]
    starts = con.execute("SELECT attempt, created_at FROM attempts ORDER BY attempt").fetchall()
    gaps = []
    for i, (attempt, start) in enumerate(starts):
        if i == 0 or start is None:
            continue
        before = [c[0] for c in commits if c[0] <= start]
        last = max(before) if before else starts[i - 1][1]
        if last is not None and last < start:
            gaps.append((int(attempt), last, start))
    # An attempt starts at its parent's step: its line begins at (start time, that step).
    for a, began, step in con.execute(
        "SELECT a.attempt, a.created_at, c.step FROM attempts AS a JOIN commits AS c "
        "ON c.commit_id = a.parent WHERE a.created_at IS NOT NULL AND a.attempt IN "
        "(SELECT attempt FROM commits WHERE in_lineage) ORDER BY 1"  # a record may lack it
    ).fetchall():
        commits.append((began, int(step), int(a), True))
    commits.sort(key=lambda c: (c[0], c[1]))
    return commits, gaps


def _orphans(root: str, con: duckdb.DuckDBPyConnection) -> list[str]:
    """Segment files under ``events/`` that no commit marker names (relative paths)."""
    named = {r[0] for r in con.execute("SELECT path FROM segments").fetchall()}
    return orphans(Store(root), named)


# ---------------------------------------------------------------- plots (matplotlib)


def _figure(height: float = _HEIGHT) -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(_WIDTH, height), layout="constrained")
    ax = fig.add_subplot()
    ax.grid(True, color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def _svg(fig: Figure, name: str) -> str:
    """``fig`` as an ``<svg>`` element whose ids are unique on the page (prefixed ``name``)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": f"ledger-report-{name}", "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    # Several SVGs share one HTML document's id namespace: prefix every id and reference.
    svg = re.sub(r'\bid="([^"]+)"', rf'id="{name}-\1"', svg)
    svg = re.sub(r'href="#([^"]+)"', rf'href="#{name}-\1"', svg)
    svg = re.sub(r"url\(#([^)]+)\)", rf"url(#{name}-\1)", svg)
    # The page's CSS sizes the plot; the viewBox keeps its aspect ratio.
    return re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r"<svg\1", svg, count=1)


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")


def _epoch_color(epoch: int) -> str:
    return f"C{epoch % 10}"


def _label_epochs(ax: Axes, curves: Sequence[_Curve]) -> None:
    """Write each epoch's number above the middle of its stretch of batches."""
    every = max(1, math.ceil(len(curves) / 40))
    top = ax.get_xaxis_transform()
    ax.text(0, 1.02, "epoch", transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
    for c in curves[::every]:
        ax.text((c.start + c.x[-1]) / 2, 1.02, str(c.epoch), transform=top, ha="center",
                va="bottom", fontsize=8, color=_epoch_color(c.epoch))  # fmt: skip


def _coverage_axis_top(curves: Sequence[_Curve], dataset_len: int | None) -> float | None:
    """Top of the coverage axis in %: 105 once an epoch reached half the dataset; below
    that 1.3 times the highest point, so a barely begun epoch is not a flat line at 0
    (``None``: no dataset length, the axis counts ids)."""
    if not dataset_len:
        return None
    top = max((100.0 * d / dataset_len for c in curves for d in c.distinct), default=0.0)
    return 105.0 if top >= 50 else max(top * 1.3, 1e-3)


def _coverage_plot(curves: Sequence[_Curve], dataset_len: int | None, short: set[int]) -> str:
    fig, ax = _figure()
    ax.set_xlabel(_STEP)
    if not curves:
        _empty(ax, "no consumed sample in the lineage")
        return _svg(fig, "coverage")
    scale = 100.0 / dataset_len if dataset_len else 1.0
    ax.set_ylabel("% of the dataset's ids seen" if dataset_len else "distinct ids seen")
    axis_top = _coverage_axis_top(curves, dataset_len)
    if axis_top == 105.0:
        ax.axhline(100, color="#555555", linestyle="--", linewidth=0.8)
        ax.set_ylim(0, 105)
    elif axis_top is not None:
        ax.set_ylim(0, axis_top)
        ax.text(0.99, 0.97, f"axis zoomed to {axis_top:.3g}%: 100% is far above",
                transform=ax.transAxes, ha="right", va="top", fontsize=8,
                color="#555555")  # fmt: skip
    for c in curves:
        ys = [0.0] + [d * scale for d in c.distinct]
        ax.plot([c.start, *c.x], ys, color=_epoch_color(c.epoch), linewidth=1.6)
        if c.epoch in short:
            ax.plot([c.x[-1]], [ys[-1]], marker="o", color=_ABANDONED, markersize=5)
    last = curves[-1]
    pct = f"{last.distinct[-1] * scale:.3g}% " if dataset_len else ""
    of = f" of {dataset_len:,}" if dataset_len else ""
    ax.annotate(f"epoch {last.epoch}: {pct}({last.distinct[-1]:,}{of} ids)",
                (last.x[-1], last.distinct[-1] * scale), textcoords="offset points",
                xytext=(-4, 6), ha="right", fontsize=8, color=_epoch_color(last.epoch))  # fmt: skip
    ax.set_xlim(left=0)
    _label_epochs(ax, curves)
    return _svg(fig, "coverage")


def _duplicates_plot(curves: Sequence[_Curve]) -> str:
    from matplotlib.ticker import MaxNLocator

    total = sum(c.consumed[-1] - c.distinct[-1] for c in curves)
    fig, ax = _figure(_HEIGHT if total else _HEIGHT / 1.6)  # a flat line needs little room
    ax.set_xlabel(_STEP)
    ax.set_ylabel("duplicates so far\nin the epoch")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if not curves:
        _empty(ax, "no consumed sample in the lineage")
        return _svg(fig, "duplicates")
    for c in curves:
        ys = [0] + [n - d for n, d in zip(c.consumed, c.distinct, strict=True)]
        ax.plot([c.start, *c.x], ys, color=_epoch_color(c.epoch), linewidth=1.6,
                drawstyle="steps-post")  # fmt: skip
    ax.set_ylim(bottom=0, top=max(1.0, ax.get_ylim()[1]))
    ax.set_xlim(left=0)
    if total == 0:
        _empty(ax, "no duplicate in any epoch of the lineage")
    _label_epochs(ax, curves)
    return _svg(fig, "duplicates")


def _ranks_plot(
    lines: dict[int, list[tuple[int, int]]],
    band: Sequence[tuple[int, int, float, int]],
    steps: Sequence[int],
    resumes: Sequence[tuple[int, int, int]],
) -> str:
    from matplotlib.ticker import MaxNLocator, StrMethodFormatter

    fig, ax = _figure()
    ax.set_xlabel(_STEP)
    ax.set_ylabel("samples consumed (cumulative)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    if not lines and not band:
        _empty(ax, "no commit with events in the lineage")
        return _svg(fig, "ranks")
    for step, attempt, world in resumes:
        ax.axvline(step, color="#888888", linestyle=":", linewidth=1)
        ax.text(step, 1.02, f" attempt {attempt}: {world} rank{'s' * (world != 1)}",
                transform=ax.get_xaxis_transform(), fontsize=8, va="bottom",
                color="#555555")  # fmt: skip
    if band:
        band = [(0, 0, 0.0, 0), *band]
        xs = [b[0] for b in band]
        ax.fill_between(xs, [b[1] for b in band], [b[3] for b in band], step="post",
                        alpha=0.3, label="min to max over ranks")  # fmt: skip
        ax.plot(xs, [b[2] for b in band], drawstyle="steps-post", label="median rank")
    styles = ["-", "--", "-.", ":"]
    for i, (rank, points) in enumerate(sorted(lines.items())):
        xs, ys = [0], [0]
        for x, y in points:
            # A point is the count at a commit; the samples came in during the interval
            # since the lineage's previous commit. Before it the rank was flat (or absent).
            k = bisect.bisect_left(steps, x)
            before = steps[k - 1] if k > 0 else 0
            if before > xs[-1]:
                xs.append(before)
                ys.append(ys[-1])
            xs.append(x)
            ys.append(y)
        ax.plot(xs, ys, linestyle=styles[i % len(styles)], linewidth=2.4 - 1.2 * i / len(lines),
                marker="o" if len(points) <= 60 else "", markersize=3,
                label=f"rank {rank}")  # fmt: skip
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8, ncols=min(4, max(1, len(lines))))
    return _svg(fig, "ranks")


def _clock_plot(
    commits: Sequence[tuple[Any, int, int, bool]], gaps: Sequence[tuple[int, Any, Any]]
) -> str:
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter

    fig, ax = _figure()
    ax.set_xlabel("wall-clock time (UTC)")
    ax.set_ylabel("commit step")
    if not commits:
        _empty(ax, "no commit yet")
        return _svg(fig, "clock")
    for attempt, lo, hi in gaps:
        ax.axvspan(lo, hi, color=_ABANDONED, alpha=0.12, linewidth=0)
        ax.axvline(hi, color="#888888", linestyle=":", linewidth=1)
        ax.text(hi, 1.02, f" attempt {attempt}", transform=ax.get_xaxis_transform(),
                fontsize=8, va="bottom", color="#555555")  # fmt: skip
    dropped = [(t, step) for t, step, _, lin in commits if not lin]
    kept = sorted({a for _, _, a, lin in commits if lin})
    for i, attempt in enumerate(kept):  # one line per attempt: none crosses a restart
        pts = [(t, step) for t, step, a, lin in commits if lin and a == attempt]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=_LINEAGE, marker="o",
                markersize=3 if len(pts) <= 300 else 0, linewidth=1.6,
                label="commits in the lineage" if i == 0 else None)  # fmt: skip
    if dropped:
        ax.scatter([d[0] for d in dropped], [d[1] for d in dropped], marker="X", s=30,
                   color=_ABANDONED, zorder=3, label="abandoned commit")  # fmt: skip
    if gaps:
        ax.axvspan(gaps[0][1], gaps[0][1], color=_ABANDONED, alpha=0.12,
                   label="no commit before a restart (down, or work lost)")  # fmt: skip
    locator = AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    return _svg(fig, "clock")


def _duration(seconds: float) -> str:
    """``"2 h 05 min"``, ``"4 min 10 s"`` or ``"12.5 s"``."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    if seconds >= 60:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{seconds:.1f} s"


def _timeline_plot(con: duckdb.DuckDBPyConnection) -> str:
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D

    commits = con.execute(
        "SELECT commit_id, step, attempt, parent, in_lineage, is_head FROM commits "
        "ORDER BY attempt, step"
    ).fetchall()
    attempts = dict(
        con.execute(
            "SELECT attempt, max(world_size) FROM ("
            " SELECT attempt, world_size FROM attempts UNION ALL"
            " SELECT attempt, world_size FROM commits) GROUP BY 1"
        ).fetchall()
    )
    starts = con.execute("SELECT attempt, parent FROM attempts ORDER BY 1").fetchall()
    lost = con.execute(
        f"SELECT attempt, min(batch), max(batch) + 1 FROM uncommitted WHERE {CONSUMED} "
        "GROUP BY 1 ORDER BY 1"
    ).fetchall()
    fig, ax = _figure(min(6.0, max(2.4, 1.4 + 0.6 * len(attempts))))
    ax.set_xlabel("commit step (batches consumed by rank 0 along the lineage)")
    if not commits and not attempts:
        _empty(ax, "no commit and no attempt in the log")
        return _svg(fig, "timeline")
    at = {cid: (step, attempt) for cid, step, attempt, *_ in commits}
    kept: list[list[tuple[int, int]]] = []
    dropped: list[list[tuple[int, int]]] = []
    for _cid, step, attempt, parent, in_lineage, _ in commits:
        if parent in at:
            link = [at[parent], (step, attempt)]
            (kept if in_lineage else dropped).append(link)
    with_commit = {c[2] for c in commits}
    resumed = [
        [at[parent], (at[parent][0], attempt)]
        for attempt, parent in starts
        if attempt not in with_commit and parent in at
    ]
    ax.add_collection(LineCollection(kept, colors=_LINEAGE, linewidths=1.8, zorder=1))
    ax.add_collection(LineCollection(dropped + resumed, colors=_ABANDONED, linewidths=1,
                                     linestyles="--", zorder=1))  # fmt: skip
    many = len(commits) > 3000  # an SVG of more markers than that is slow to display
    size = 36 if len(commits) < 60 else 12 if len(commits) < 600 else 4
    for in_lineage, color, marker in ((True, _LINEAGE, "o"), (False, _ABANDONED, "X")):
        pts = [(c[1], c[2]) for c in commits if c[4] == in_lineage]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=size, marker=marker,
                       color=color, zorder=2, rasterized=many)  # fmt: skip
    for _cid, step, attempt, *_ in (c for c in commits if c[5]):
        ax.scatter([step], [attempt], s=220, marker="*", color="gold", edgecolors="black",
                   zorder=3)  # fmt: skip
    for _, (step, attempt) in resumed:
        ax.scatter([step], [attempt], s=size, marker="o", facecolors="white",
                   edgecolors=_ABANDONED, zorder=2)  # fmt: skip
    for attempt, lo, hi in lost:
        ax.plot([lo, hi], [attempt, attempt], color=_UNCOMMITTED, linewidth=7, alpha=0.6,
                solid_capstyle="butt", zorder=0)  # fmt: skip
    ys = sorted(set(attempts) | with_commit)
    ax.set_yticks(ys, [f"attempt {a}\n{attempts.get(a) or '?'} rank(s)" for a in ys])
    ax.set_ylim(max(ys) + 0.6, min(ys) - 0.6)  # attempt 0 on top: time runs down
    ax.grid(False, axis="y")
    ax.autoscale(axis="x")
    ax.set_xlim(0, max(1.0, ax.get_xlim()[1]))
    if not commits:
        _empty(ax, "no commit yet")
    legend = [
        (bool(commits), Line2D([], [], color=_LINEAGE, marker="o", linewidth=1.8,
                      label="commit in the lineage")),
        (bool(dropped), Line2D([], [], color=_ABANDONED, marker="X", linestyle="--",
                               label="abandoned commit / branch")),
        (bool(commits), Line2D([], [], color="gold", marker="*", markeredgecolor="black",
                      markersize=12, linestyle="", label="head")),
        (bool(resumed), Line2D([], [], color=_ABANDONED, marker="o", markerfacecolor="white",
                               linestyle="--", label="resumed, never committed")),
        (bool(lost), Line2D([], [], color=_UNCOMMITTED, linewidth=7, alpha=0.6,
                            label="batches consumed, not committed")),
    ]  # fmt: skip
    handles = [h for shown, h in legend if shown]
    if handles:
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1),
                  borderaxespad=0)  # fmt: skip
    return _svg(fig, "timeline")


# ---------------------------------------------------------------- HTML


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto;
       max-width: 1100px; padding: 0 1em; color: #222; line-height: 1.45; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
code { background: #f3f3f3; padding: 0 0.25em; border-radius: 3px; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
.scroll { overflow-x: auto; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.7em; text-align: right; white-space: nowrap; }
th { white-space: normal; }
code { white-space: nowrap; }
th { background: #f6f6f6; } td.l, th.l { text-align: left; }
tr.bad td { background: #fde8e8; } .bad { color: #b00020; font-weight: 600; }
.ok { color: #1b7f3b; font-weight: 600; }
.plot svg { width: 100%; height: auto; display: block; }
.note { color: #555; font-size: 0.92em; max-width: 60em; }
ul.findings li { margin: 0.2em 0; }
"""


def _e(value: Any) -> str:
    """``value`` as escaped HTML text; ints get thousands separators (``1,234,567``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, datetime.datetime):  # the views hold naive UTC times
        return value.strftime("%Y-%m-%dT%H:%M:%SZ")
    return html.escape("" if value is None else str(value), quote=True)


def _few(numbers: Sequence[int], most: int = 10) -> str:
    """``"1, 2, 3"``, or the first ``most`` of them and how many there are in all."""
    shown = ", ".join(str(n) for n in numbers[:most])
    return shown if len(numbers) <= most else f"{shown}, … ({len(numbers)} in all)"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], bad: Sequence[bool] = ()) -> str:
    """An HTML table; the first column is left-aligned, rows flagged in ``bad`` are red."""
    head = "".join(f'<th class="{"l" if i == 0 else ""}">{_e(h)}</th>'
                   for i, h in enumerate(headers))  # fmt: skip
    body = []
    for n, row in enumerate(rows):
        cls = ' class="bad"' if n < len(bad) and bad[n] else ""
        cells = "".join(f'<td class="{"l" if i == 0 else ""}">{_e(v)}</td>'
                        for i, v in enumerate(row))  # fmt: skip
        body.append(f"<tr{cls}>{cells}</tr>")
    # Cells never wrap (commit ids are copied whole); a wide table scrolls instead.
    return (
        f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _operations(s: Summary) -> str:
    """The section on batches skipped on purpose and bad samples ("" when none)."""
    bad = sum(e.errors for e in s.epochs)
    if not s.skipped_batches and not bad:
        return ""
    parts = []
    if s.skipped_batches:
        parts.append("<h3>Batches skipped on purpose</h3>")
        parts.append(
            _table(
                ["rank", "first batch", "last batch", "samples", "attempt", "reason"],
                [(r.rank, r.first, r.last, r.samples, r.attempt, r.reason)
                 for r in s.skipped_batches],
            )
        )  # fmt: skip
    if bad:
        shown = len(s.bad_samples)
        parts.append(f"<h3>Bad samples ({bad:,}{f', first {shown}' if bad > shown else ''})</h3>")
        parts.append(
            _table(
                ["rank", "epoch", "batch", "position", "sample", "error"],
                [(b.rank, b.epoch, b.batch, b.position, b.sample_id, f"{b.type}: {b.message}")
                 for b in s.bad_samples],
                [True] * shown,
            )
        )  # fmt: skip
    parts.append(
        _note(
            "Batches skipped with <code>loader.skip()</code> or <code>load_state_dict(..., "
            "skip_batches=)</code> (e.g. after a loss spike): the model never saw them; they "
            "keep their batch indices, and every later resume continues after them. Bad "
            'samples: loading them raised under <code>on_error="skip"</code>, so each was '
            "left out of its batch. Both count as accounted for in the epochs' coverage. "
            "All of them: <code>SELECT * FROM lineage WHERE kind IN ('rollback', "
            "'error')</code>."
        )
    )
    return _section("Skipped batches and bad samples", *parts)


def _section(title: str, *parts: str) -> str:
    return f"<section><h2>{_e(title)}</h2>\n" + "\n".join(parts) + "</section>\n"


def _note(text: str) -> str:
    """A caption; ``text`` is fixed prose of this module, not log data."""
    return f'<p class="note">{text}</p>'


def _mixture_section(root: str, con: duckdb.DuckDBPyConnection) -> list[str]:
    """A mixture's shares (:mod:`ledger.audit.mixture`): per source, per phase and over
    steps; nothing for another run."""
    from ledger.audit.mixture import summarize_mixture

    store = Store(root)
    m = summarize_mixture(store, con, read_run(store)["config"])
    if m is None:
        return []
    names = [x.source for x in m.sources]
    sources = _table(
        ["source", "samples", "share", "target", "expected", "within"],
        [
            [
                x.source,
                x.count,
                f"{x.share:.2%}",
                f"{x.target:.2%}",
                f"{x.expected:.0f} ± {x.tolerance:.0f}",
                "yes" if x.ok else "NO",
            ]
            for x in m.sources
        ],
        [not x.ok for x in m.sources],
    )
    phases = _table(
        ["phase", *names],
        [[n, *(f"{x.share:.1%} ({x.target:.1%})" for x in per)] for n, per in m.phases.items()],
        [any(not x.ok for x in per) for per in m.phases.values()],
    )
    steps = _table(
        ["steps", *names],
        [[f"{a}-{b}", *(f"{sh[n]:.1%}" for n in names)] for a, b, sh in m.steps],
    )
    return [
        _section(
            "Mixture: shares of the sources",
            sources,
            "<h3>Per phase: realised (target)</h3>",
            phases,
            "<h3>Over steps</h3>",
            steps,
            _note(
                "Realised against target share of each source of the ledger.Mixture over "
                "the lineage. The check <code>ledger audit --check mixture</code> fails a "
                "source more than 4 binomial standard deviations (plus one sample) from "
                "its expected count, per phase of the run."
            ),
        )
    ]


def _page(root: str, s: Summary, con: duckdb.DuckDBPyConnection) -> str:
    run = con.execute(
        "SELECT run_id, created_at, dataset_len, seed, shuffle, batch_size, drop_last, "
        'world_size, "order" FROM run'
    ).fetchone()
    assert run is not None, "the run view has one row"
    width, steps = _count(con)
    curves = _epoch_curves(con, s, width)
    lines, band = _rank_progress(con)
    resumes = con.execute(
        """
        SELECT coalesce(p.step, 0), a.attempt, a.world_size FROM (
            SELECT attempt, any_value(world_size) AS world_size, arg_min(parent, step) AS parent
            FROM commits WHERE in_lineage GROUP BY attempt
        ) AS a LEFT JOIN commits AS p ON p.commit_id = a.parent
        WHERE a.attempt > (SELECT min(attempt) FROM commits WHERE in_lineage) ORDER BY 1, 2
        """
    ).fetchall()
    orphans = _orphans(root, con)
    clock, gaps = _clock(con)
    packer = read_run(Store(root))["config"].get("packer")
    tokens = _tokens(con, int(packer["seq_len"])) if packer else []
    created = {int(a): (t, h) for a, t, h in con.execute(
        "SELECT attempt, created_at, host FROM attempts").fetchall()}  # fmt: skip
    n = s.dataset_len

    def incomplete(e: Any) -> bool:  # finished and not covered: the checks' definitions
        return epoch_status(s, e) == "incomplete"

    short = [e for e in s.epochs if incomplete(e)]
    # The findings are the checks' verdicts on the same summary, worded by the checks.
    findings = [
        f'<li class="{"ok" if r.ok else "bad"}">{_e(r.check)}: {_e(r.detail)}</li>'
        for r in (duplicates(s), coverage(s))
    ]
    if not s.epochs:
        findings.append("<li>the lineage holds no consumed sample yet</li>")
    findings.append(
        f"<li>{s.abandoned_commits:,} abandoned commit(s), with {s.abandoned_samples:,} "
        "sample(s) seen by discarded models</li>"
    )
    lost = sum(a.uncommitted_batches for a in s.attempts)
    findings.append(
        f"<li>{lost:,} batch(es) consumed and never committed (journals); "
        f"{len(orphans)} orphan segment(s)</li>"
    )
    if gaps:
        down = sum((hi - lo).total_seconds() for _, lo, hi in gaps)
        findings.append(
            f"<li>{len(gaps)} restart(s); {_e(_duration(down))} between the last commit "
            "before a restart and the restart (down, or work lost)</li>"
        )
    if tokens:
        seen, slots = sum(t.tokens for t in tokens), sum(t.slots for t in tokens)
        findings.append(
            f"<li>{seen:,} tokens seen (EOS included) in {slots // int(packer['seq_len']):,} "
            f"sequences of {int(packer['seq_len']):,}; padding "
            f"{100 * (slots - seen) / max(slots, 1):.2f}% of the positions</li>"
        )
    behind = [r for r in s.ranks if r.behind]
    findings.append(
        f"<li>stragglers at the head: {_e(', '.join(f'rank {r.rank}' for r in behind)) or 'none'}"
        "</li>"
    )

    run_table = _table(
        ["run", ""],
        zip(["run id", "created (UTC)", "dataset length", "seed", "shuffle", "batch size",
             "drop_last", "world size", "order"],
            [*run[:3], str(run[3]), *run[4:]], strict=True),  # a seed is a name: no "1,234"
    )  # fmt: skip
    epochs_table = _table(
        ["epoch", "samples", "distinct", "coverage", "duplicates", "skipped", "status"],
        [
            (e.epoch, e.samples, e.distinct, f"{100 * e.coverage:.2f}%", e.duplicates,
             e.skipped, epoch_status(s, e))
            for e in s.epochs
        ],
        [bool(e.duplicates) or incomplete(e) for e in s.epochs],
    )  # fmt: skip
    attempts_table = _table(
        ["attempt", "resumed from", "world size", "commits", "events", "uncommitted batches",
         "uncommitted samples", "started (UTC)", "host"],
        [
            (a.attempt, a.parent or "fresh start", a.world_size, a.commits, a.events,
             a.uncommitted_batches, a.uncommitted_samples, *created.get(a.attempt, ("", "")))
            for a in s.attempts
        ],
        [bool(a.uncommitted_batches) for a in s.attempts],
    )  # fmt: skip
    tokens_part = (
        _section(
            "Tokens (packed stream)",
            _table(
                ["epoch", "sequences", "tokens", "padding", "padding share"],
                [
                    (t.epoch, t.slots // int(packer["seq_len"]), t.tokens, t.slots - t.tokens,
                     f"{100 * (t.slots - t.tokens) / max(t.slots, 1):.2f}%")
                    for t in tokens
                ],
            ),
            _note(
                "Per epoch of the lineage: sequences handed to the training loop, the tokens "
                "in them (each sample's tokens and its EOS, from the logged spans), and the "
                "positions filled with padding (a worker's last sequence of an epoch)."
            ),
        )
        if tokens
        else ""
    )  # fmt: skip
    operations_part = _operations(s)
    ranks_table = _table(
        ["rank", "epoch", "epoch batch", "batches", "samples", "behind"],
        [(r.rank, r.epoch, r.epoch_batch, r.batch, r.samples, r.behind) for r in s.ranks],
        [bool(r.behind) for r in s.ranks],
    )
    skew = (
        f"Largest skew: {s.skew.samples} samples and {s.skew.epochs} epochs between the "
        f"{s.skew.world_size} ranks of commit <code>{_e(s.skew.commit)}</code>."
        if s.skew
        else "No commit of the lineage has more than one rank."
    )
    listed = orphans[:_MAX_LISTED]
    orphan_part = (
        _table(["segment (relative to the root)"], [(p,) for p in listed], [True] * len(listed))
        + (f"<p>… and {len(orphans) - len(listed)} more.</p>" if len(orphans) > len(listed)
           else "")
        if orphans
        else "<p>No orphan segment.</p>"
    )  # fmt: skip
    bucket = (
        f" Each point covers {width} batches (the log has more than {MAX_POINTS} per line)."
        if width > 1
        else ""
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>ledger report: run {_e(s.run_id)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>ledger report</h1>",
        f"<p>run <code>{_e(s.run_id)}</code> · head <code>{_e(s.head or 'none')}</code> · "
        f"log <code>{_e(root)}</code> · {s.commits} commit(s), {len(s.attempts)} attempt(s)"
        "</p>",
        _section(
            "Summary",
            f'<ul class="findings">{"".join(findings)}</ul>',
            run_table,
            _note(
                "The <em>lineage</em> is the chain of commits that ends at the head: exactly "
                "what the head checkpoint's model saw. Every table and plot below is about "
                "the lineage, except the attempts and the commit timeline, which show all "
                "branches."
            ),
        ),
        _section(
            "Epochs",
            epochs_table,
            _note(
                "Per epoch of the lineage: samples handed to the training loop, distinct "
                "sample ids among them, coverage = distinct / dataset length, duplicates = "
                "samples − distinct, skipped = positions dropped by <code>drop_last</code>. "
                "A finished epoch should have no duplicate and distinct + skipped = dataset "
                "length."
            ),
        ),
        tokens_part,
        operations_part,
        _section(
            "Coverage per epoch",
            f'<div class="plot">{_coverage_plot(curves, n, {e.epoch for e in short})}</div>',
            _note(
                "For each epoch (number on top, one colour each), the share of the "
                "dataset's distinct sample ids consumed so far, against the training step. "
                "Each epoch climbs from 0 to 100% (dashed line), or to 100% minus the "
                "positions <code>drop_last</code> skipped. A finished epoch whose curve "
                "stops short (red dot) lost samples; a curve that flattens mid-epoch while "
                "batches go on means batches repeated ids." + bucket
            ),
        ),
        _section(
            "Duplicates over time",
            f'<div class="plot">{_duplicates_plot(curves)}</div>',
            _note(
                "For each epoch, consumptions of a sample id already consumed earlier in the "
                "same epoch of the lineage, cumulative, against the training step. A healthy "
                "run stays at 0; a jump at step <em>s</em> means batch <em>s</em> − 1 repeated "
                "a sample (often right after a resume: look for an attempt starting there in "
                "the timeline below)." + bucket
            ),
        ),
        _section(
            "Per-rank progress",
            f'<div class="plot">{_ranks_plot(lines, band, steps, resumes)}</div>',
            _note(
                "Samples each rank consumed along the lineage, cumulative, at each commit "
                "step. Dotted lines mark where an attempt resumed, with its world size. With "
                "synchronous data parallelism the ranks' lines coincide; a line that falls "
                "behind is a straggler, a line that stops is a rank that no longer exists "
                f"(the world shrank). Above {_MAX_RANK_LINES} ranks the plot shows the "
                "minimum, median and maximum over ranks."
            ),
            "<h3>Ranks at the head</h3>",
            ranks_table if s.ranks else "<p>No commit yet.</p>",
            f"<p>{skew}</p>",
        ),
        _section(
            "Wall-clock time",
            f'<div class="plot">{_clock_plot(clock, gaps)}</div>',
            _note(
                "Every commit at the time its marker was written (UTC): blue along the "
                "lineage, red crosses abandoned. A shaded stretch ends where an attempt "
                "started after a crash or a stop, and begins at the last commit before "
                "it: the job was down, or what it did since that commit was lost. A flat "
                "stretch without shading is a slow step or a long interval between "
                "checkpoints."
            ),
        ),
        _section(
            "Commits and abandoned branches",
            f'<div class="plot">{_timeline_plot(con)}</div>',
            _note(
                "Every commit marker: its step (x) and the attempt that wrote it (y, time "
                "runs down). Lines join a commit to its parent. Blue is the lineage of the "
                "head (star). Red crosses are abandoned commits: an attempt resumed from an "
                "earlier checkpoint, so the model of those commits was discarded, and the "
                "samples it saw are not in the lineage. Orange bars are batches a training "
                "loop consumed after the attempt's last commit (from its journal): work "
                "lost in a crash, or in flight in a live run."
            ),
            "<h3>Attempts</h3>",
            attempts_table,
        ),
        *_mixture_section(root, con),
        _section(
            "Orphan segments and uncommitted work",
            orphan_part,
            _note(
                "An orphan segment is a Parquet file under <code>events/</code> that no "
                "commit marker names: a rank wrote it, and the run died before the marker. "
                "Its events are in no view and reached no committed model; the run resumed "
                "from the previous commit. A live run's newest segment shows here for the "
                "moment before its marker is written. Uncommitted batches are counted per "
                "attempt in the attempts table."
            ),
        ),
        "</body></html>\n",
    ]
    return "\n".join(parts)
