"""The audit summary of a log: attempts, per-epoch coverage and duplicates, abandoned work.

One pass over the segments (:mod:`ledger.audit.scan`) counts distinct ids per epoch and
consumed samples per segment; the rest is SQL over those counts and the small views of
:mod:`ledger.audit.views` (markers, attempts, journals).
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ledger.audit.scan import Progress, ScanResult, scan_segments
from ledger.audit.views import commits_table, connect, scan_jobs
from ledger.commits import parsing_once, read_run
from ledger.store import Store

# An event that hands a sample to the training loop: a 'sample', or the first span of a
# packed sample (its later spans are the rest of the same sample).
CONSUMED = "(kind = 'sample' OR (kind = 'span' AND token_start = 0))"


@dataclass(frozen=True, slots=True)
class AttemptSummary:
    """One attempt of the run.

    Attributes:
        attempt: the attempt number.
        parent: commit the attempt resumed from, ``None`` for a fresh start.
        commits: commit markers the attempt wrote.
        events: events (rows, all kinds) in the segments of those commits.
        uncommitted_batches: batches in the attempt's journals after its last commit:
            consumed by its training loop, never committed (lost if the attempt died).
        uncommitted_samples: samples in those batches.
        world_size: ranks of the attempt.
    """

    attempt: int
    parent: str | None
    commits: int
    events: int
    uncommitted_batches: int = 0
    uncommitted_samples: int = 0
    world_size: int = 1


@dataclass(frozen=True, slots=True)
class EpochSummary:
    """One epoch of the head's lineage.

    Attributes:
        epoch: the epoch.
        samples: ``'sample'`` events: samples handed to the training loop (rows).
        distinct: distinct sample ids among them.
        coverage: ``distinct / dataset_len``, in ``[0, 1]``.
        duplicates: ``samples - distinct``: consumptions of an id already seen that epoch.
        skipped: ``'skip'`` events: positions dropped by ``drop_last``.
        skipped_distinct: distinct ids among them.
        covered: distinct ids consumed, skipped, bad or rolled back (the epoch is
            complete when it equals the dataset length).
        errors: ``'error'`` events: bad samples left out of their batch
            (``on_error="skip"``).
        rolled_back: ``'rollback'`` events: samples of batches skipped on purpose
            (:meth:`ledger.DataLoader.skip`).
    """

    epoch: int
    samples: int
    distinct: int
    coverage: float
    duplicates: int
    skipped: int
    skipped_distinct: int = 0
    covered: int = 0
    errors: int = 0
    rolled_back: int = 0


@dataclass(frozen=True, slots=True)
class BadSample:
    """A sample whose loading raised, left out of its batch (an ``'error'`` event).

    Attributes:
        rank, epoch, batch, position, sample_id: where it was left out.
        type: the exception's type.
        message: the exception's message.
    """

    rank: int
    epoch: int
    batch: int
    position: int
    sample_id: int
    type: str
    message: str


@dataclass(frozen=True, slots=True)
class SkippedBatches:
    """A run of batches of one rank skipped on purpose (``'rollback'`` events).

    Attributes:
        rank: the rank.
        first, last: the first and last batch index skipped (inclusive).
        samples: samples in those batches (the model never saw them).
        reason: the reason given to :meth:`ledger.DataLoader.skip`.
        attempt: the attempt that skipped them.
    """

    rank: int
    first: int
    last: int
    samples: int
    reason: str
    attempt: int


@dataclass(frozen=True, slots=True)
class RankSummary:
    """One rank at the head commit.

    Attributes:
        rank: the rank.
        epoch: epoch of its next batch.
        epoch_batch: batches of that epoch it has consumed.
        batch: batches it has consumed over the lineage (its next batch index).
        samples: samples it consumed in the lineage since the world size last changed
            (a rank of an earlier shape is another process).
        behind: samples it trails the rank that consumed the most (0: not a straggler).
    """

    rank: int
    epoch: int
    epoch_batch: int
    batch: int
    samples: int
    behind: int


@dataclass(frozen=True, slots=True)
class Skew:
    """The largest spread between the ranks of one attempt at one commit of the lineage.

    Attributes:
        commit: the commit where the spread peaks.
        world_size: ranks at that commit.
        samples: max - min over its ranks of samples consumed since the attempt began.
        epochs: max - min over its ranks of the epoch of their next batch.
    """

    commit: str
    world_size: int
    samples: int
    epochs: int


@dataclass(frozen=True, slots=True)
class Position:
    """A place in the run: an epoch and a position in that epoch's global order."""

    epoch: int
    position: int


@dataclass(frozen=True, slots=True)
class Summary:
    """What a log holds, as of a head commit.

    Attributes:
        run_id: the run's id (hex).
        dataset_len: samples in the dataset, from ``run.json``.
        attempts: every attempt, in order.
        commits: commit markers in the log, all branches.
        head: id of the head commit, ``None`` when the log has no commit yet.
        epochs: per epoch of the head's lineage, in order.
        abandoned_commits: commits not in the head's lineage.
        abandoned_samples: ``'sample'`` events of those commits: samples a discarded
            model saw.
        last_position: epoch and largest position of a ``'sample'`` event of the last
            epoch of the lineage; ``None`` when the lineage has none.
        ranks: every rank of the head commit, with its progress.
        skew: the largest spread between ranks at a commit of the lineage, ``None``
            when the lineage has no commit with more than one rank.
        unreadable_journal_records: damaged journal records skipped (checksum or
            fields wrong); what they held is missing from the uncommitted counts.
        bad_samples: the first :data:`LISTED` bad samples of the lineage (``'error'``
            events), by epoch, batch and position; their number is the sum of the
            epochs' ``errors``.
        skipped_batches: every run of batches skipped on purpose in the lineage.
    """

    run_id: str
    dataset_len: int
    attempts: tuple[AttemptSummary, ...]
    commits: int
    head: str | None
    epochs: tuple[EpochSummary, ...]
    abandoned_commits: int
    abandoned_samples: int
    last_position: Position | None
    ranks: tuple[RankSummary, ...] = ()
    skew: Skew | None = None
    unreadable_journal_records: int = 0
    bad_samples: tuple[BadSample, ...] = ()
    skipped_batches: tuple[SkippedBatches, ...] = ()


LISTED = 20
"""Bad samples a summary lists (the SQL view ``lineage`` holds them all)."""


def finished_epochs(s: Summary) -> int:
    """Epochs of the lineage that are finished: every rank of the head has moved past them.

    The one definition used by the ``coverage`` check and the report: epochs
    ``0 .. finished_epochs(s) - 1`` are finished, the minimum over the head's ranks of the
    epoch of their next batch (0 when the log has no commit). An epoch one rank finished
    and another has not is in progress.
    """
    return min((r.epoch for r in s.ranks), default=0)


def uncovered_epochs(s: Summary) -> list[int]:
    """Finished epochs (:func:`finished_epochs`) in which some sample of the dataset was
    neither consumed nor skipped (``covered < dataset_len``), in order."""
    covered = {e.epoch: e.covered for e in s.epochs}
    return [e for e in range(finished_epochs(s)) if covered.get(e, 0) < s.dataset_len]


def epoch_status(s: Summary, e: EpochSummary) -> str:
    """``"duplicates"``, ``"incomplete"`` (finished and not covered), ``"finished"`` or
    ``"in progress"``: the status the report shows, by the checks' definitions."""
    if e.duplicates:
        return "duplicates"
    if e.epoch < finished_epochs(s):
        return "finished" if e.covered >= s.dataset_len else "incomplete"
    return "in progress"


@parsing_once
def summarize(root: str, head: str | None = None, progress: Progress | None = None) -> Summary:
    """Summarise the log under ``root`` as of ``head``.

    One pass over the segments (:func:`ledger.audit.scan.scan`) counts every epoch of
    the lineage and every segment; the rest comes from the commit markers.

    Args:
        root: the log root.
        head: head commit id; ``None`` for the default head (see
            :func:`ledger.audit.views.connect`).
        progress: called with ``(segments done, segments in all)`` during the scan.

    Returns:
        The summary.

    Raises:
        CommitNotFound: if ``root`` holds no run, or ``head`` names no commit.
        LogCorrupted: if the commit chain is broken, a committed segment is missing or
            differs from its marker, or holds an id outside the dataset.
    """
    con = connect(root, head)
    try:
        return _summarize(con, Store(root), progress)
    finally:
        con.close()


@parsing_once
def counts(
    con: duckdb.DuckDBPyConnection, store: Store, progress: Progress | None = None
) -> ScanResult:
    """Scan the segments of the log behind ``con`` (from :func:`connect`): per-epoch
    counts of its lineage, per-segment counts of every commit; the latter are registered
    on ``con`` as the table ``segment_counts`` (commit_id, step, attempt, rank, events,
    samples)."""
    run = read_run(store)
    config = run.get("config", {})
    scan, placed = scan_jobs(con)
    result = scan_segments(
        store,
        scan,
        dataset_len=int(config.get("dataset_len", 0)),
        packed=bool(config.get("packer")),
        progress=progress,
        # A mixture's sources repeat by design: each position of its epoch is once.
        key="position" if "mixture" in config else "sample_id",
        placed=placed,
    )
    table = result.segments.select(_SEGMENT_COUNTS.names)
    con.register("segment_counts", table)
    return result


_SEGMENT_COUNTS = pa.schema(
    [
        ("commit_id", pa.string()),
        ("step", pa.int64()),
        ("attempt", pa.int32()),
        ("rank", pa.int32()),
        ("events", pa.int64()),
        ("samples", pa.int64()),
    ]
)


def _summarize(con: duckdb.DuckDBPyConnection, store: Store, progress: Progress | None) -> Summary:
    run_id, dataset_len = _one(con, "SELECT run_id, dataset_len FROM run")
    scanned = counts(con, store, progress)
    con.register("per_commit", _per_commit(commits_table(con), scanned.segments))
    attempts = con.execute(
        f"""
        SELECT coalesce(a.attempt, c.attempt) AS attempt, any_value(a.parent),
               count(c.commit_id), coalesce(sum(c.events), 0),
               coalesce(any_value(u.batches), 0), coalesce(any_value(u.samples), 0),
               coalesce(any_value(a.world_size), any_value(c.world_size), 1)
        FROM attempts AS a FULL OUTER JOIN per_commit AS c ON a.attempt = c.attempt
        LEFT JOIN (
            SELECT attempt, count(DISTINCT (rank, batch)) AS batches,
                   count(*) FILTER (WHERE {CONSUMED}) AS samples
            FROM uncommitted GROUP BY attempt
        ) AS u ON u.attempt = coalesce(a.attempt, c.attempt)
        GROUP BY 1 ORDER BY 1
        """
    ).fetchall()
    commits, abandoned_commits, abandoned_samples = _one(
        con,
        """
        SELECT count(*), count(*) FILTER (WHERE NOT in_lineage),
               coalesce(sum(samples) FILTER (WHERE NOT in_lineage), 0)
        FROM per_commit
        """,
    )
    head = con.execute("SELECT commit_id FROM commits WHERE is_head").fetchone()
    epochs = [c for c in scanned.epochs.values() if c.samples]
    last = None
    if epochs:
        e = epochs[-1].epoch
        position = scanned.last_positions.get(e)
        last = Position(e, position) if position is not None else None
    epochs = list(scanned.epochs.values())
    return Summary(
        run_id=run_id,
        dataset_len=dataset_len,
        attempts=tuple(AttemptSummary(*row) for row in attempts),
        commits=commits,
        head=head[0] if head else None,
        epochs=tuple(
            EpochSummary(
                epoch=c.epoch,
                samples=c.samples,
                distinct=c.distinct,
                coverage=c.distinct / dataset_len if dataset_len else 0.0,
                duplicates=c.duplicates,
                skipped=c.skipped,
                skipped_distinct=c.skipped_distinct,
                covered=c.covered,
                errors=c.errors,
                rolled_back=c.rolled_back,
            )
            for c in epochs
        ),
        abandoned_commits=abandoned_commits,
        abandoned_samples=int(abandoned_samples),
        last_position=last,
        ranks=_ranks(con, head[0]) if head else (),
        skew=_skew(con),
        unreadable_journal_records=int(
            _one(con, "SELECT coalesce(sum(unreadable), 0) FROM journals")[0]
        ),
        # Read only when the scan counted some: a run without them pays nothing.
        bad_samples=_bad_samples(con) if any(c.errors for c in epochs) else (),
        skipped_batches=_skipped(con) if any(c.rolled_back for c in epochs) else (),
    )


def _per_commit(commits: pa.Table, segments: pa.Table) -> pa.Table:
    """Per commit (a row of the ``commits`` view): its ``commit_id``, ``attempt``,
    ``in_lineage``, ``world_size``, and the ``events`` and ``samples`` of its segments
    (``segments``: :attr:`ScanResult.segments`), 0 when it named none: numpy over the
    10^4 commits of a long history, where a join in SQL costs several times as much."""
    at = pc.index_in(segments["commit_id"], value_set=commits["commit_id"])
    at = at.fill_null(-1).to_numpy()
    known = at >= 0  # every segment is named by one of the commits
    table = commits.select(["commit_id", "attempt", "in_lineage", "world_size"])
    for name in ("events", "samples"):
        total = np.zeros(commits.num_rows, np.int64)
        np.add.at(total, at[known], segments[name].to_numpy()[known])
        table = table.append_column(name, pa.array(total))
    return table


def _bad_samples(con: duckdb.DuckDBPyConnection) -> tuple[BadSample, ...]:
    rows = con.execute(
        f"""
        SELECT rank, epoch, batch, position, sample_id,
               coalesce(json_extract_string(value, '$.type'), ''),
               coalesce(json_extract_string(value, '$.message'), '')
        FROM lineage WHERE kind = 'error' ORDER BY epoch, batch, rank, position LIMIT {LISTED}
        """
    ).fetchall()
    return tuple(BadSample(*r) for r in rows)


def _skipped(con: duckdb.DuckDBPyConnection) -> tuple[SkippedBatches, ...]:
    # Consecutive batches of a rank with one reason and attempt form one run
    # (gaps-and-islands: batch minus its rank within the group is constant on a run).
    rows = con.execute(
        """
        WITH b AS (
            SELECT rank, batch, attempt, count(*) AS n,
                   coalesce(json_extract_string(any_value(value), '$.reason'), '') AS reason
            FROM lineage WHERE kind = 'rollback' GROUP BY rank, batch, attempt
        ), runs AS (
            SELECT *, batch - row_number() OVER (
                PARTITION BY rank, reason, attempt ORDER BY batch) AS island
            FROM b
        )
        SELECT rank, min(batch), max(batch), sum(n), reason, attempt FROM runs
        GROUP BY rank, reason, attempt, island ORDER BY min(batch), rank
        """
    ).fetchall()
    return tuple(SkippedBatches(r[0], r[1], r[2], int(r[3]), r[4], r[5]) for r in rows)


def _ranks(con: duckdb.DuckDBPyConnection, head: str) -> tuple[RankSummary, ...]:
    rows = con.execute(
        """
        SELECT s.rank, s.epoch, s.epoch_batch, s.batch, coalesce(l.samples, 0)
        FROM states AS s LEFT JOIN (
            SELECT rank, sum(samples) AS samples FROM segment_counts
            WHERE commit_id IN (SELECT commit_id FROM commits WHERE in_lineage) AND step > (
                SELECT coalesce(max(step), -1) FROM commits WHERE in_lineage AND world_size
                    <> (SELECT world_size FROM commits WHERE commit_id = ?)
            )
            GROUP BY 1
        ) AS l USING (rank)
        WHERE s.commit_id = ? ORDER BY s.rank
        """,
        [head, head],
    ).fetchall()
    most = max((r[4] for r in rows), default=0)
    return tuple(
        RankSummary(
            rank=r[0], epoch=r[1], epoch_batch=r[2], batch=r[3], samples=r[4], behind=most - r[4]
        )
        for r in rows
    )


def _skew(con: duckdb.DuckDBPyConnection) -> Skew | None:
    """Spread between ranks at each lineage commit, counted from their attempt's start."""
    widest = pc.max(commits_table(con)["world_size"]).as_py()
    if widest is None or widest <= 1:  # no attempt of several ranks: the query finds none
        return None
    row = con.execute(
        """
        WITH per AS (
            SELECT c.commit_id, c.step, c.attempt, c.world_size, s.rank, s.epoch,
                   coalesce(e.n, 0) AS n
            FROM commits AS c JOIN states AS s USING (commit_id)
            LEFT JOIN (
                SELECT commit_id, rank, sum(samples) AS n FROM segment_counts GROUP BY ALL
            ) AS e USING (commit_id, rank)
            -- An attempt of one rank has no spread: its commits are left out at once.
            WHERE c.in_lineage AND c.attempt IN (SELECT attempt FROM commits WHERE world_size > 1)
        ), cumulative AS (
            SELECT *, sum(n) OVER (PARTITION BY attempt, rank ORDER BY step) AS seen FROM per
        )
        SELECT commit_id, any_value(world_size), max(seen) - min(seen),
               max(epoch) - min(epoch), any_value(step) AS step
        FROM cumulative GROUP BY commit_id HAVING count(*) > 1
        ORDER BY 3 DESC, 4 DESC, step LIMIT 1
        """
    ).fetchone()
    return Skew(row[0], int(row[1]), int(row[2]), int(row[3])) if row else None


def _one(con: duckdb.DuckDBPyConnection, sql: str) -> tuple:
    # fetchall: a result left unfinished would block the next registration on ``con``.
    rows = con.execute(sql).fetchall()
    assert len(rows) == 1, "an aggregate without GROUP BY returns one row"
    return rows[0]
